"""The type stub matches the extension module, and py.typed is installed."""

from __future__ import annotations

import ast
import os

import weft
from weft import _weft


def _stub() -> ast.Module:
    path = os.path.join(os.path.dirname(weft.__file__), "_weft.pyi")
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read())


def test_stub_names_match_module():
    tree = _stub()
    stub_top = {
        n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))
    }
    runtime_top = {
        n for n in dir(_weft) if not n.startswith("_") and callable(getattr(_weft, n))
    }
    assert stub_top == runtime_top
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        stub_members = {
            m.name
            for m in cls.body
            if isinstance(m, ast.FunctionDef) and not m.name.startswith("_")
        }
        runtime = {m for m in dir(getattr(_weft, cls.name)) if not m.startswith("_")}
        assert stub_members == runtime, cls.name


def test_py_typed_installed():
    assert os.path.exists(os.path.join(os.path.dirname(weft.__file__), "py.typed"))
