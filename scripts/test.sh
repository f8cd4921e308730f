#!/usr/bin/env bash
# Runs every test of the workspace (the README's test command).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

export RUST_BACKTRACE=1
# Unit, integration, property and conformance tests of every crate
# (loopback conformance runs 50+ seeds; libfabric runs over tcp and shm).
cargo test --workspace

# The in-process libfabric tests again, against libfabric 2.x (Debian 13's
# package, unpacked under target/; skipped when it cannot be fetched).
bash scripts/libfabric2.sh

# Model-checked lock-free parts (the ImmCounter, with loom), in their own
# target dir so the cfg(loom) build does not invalidate the normal one.
RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom \
  cargo test -p weft-engine --lib --release imm::loom_model
