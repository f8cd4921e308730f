#!/usr/bin/env bash
# Runs every test of the workspace (the README's test command): installs the
# system packages it needs, then `cargo xtask test` (the workspace's tests,
# the libfabric 2.x run, the loom models; see xtask/src/main.rs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo xtask test
