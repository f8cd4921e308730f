import os
import sys

# The helpers next to the tests (and the worker processes' entry point).
sys.path.insert(0, os.path.dirname(__file__))
os.environ.pop("VLLM_TARGET_DEVICE", None)
