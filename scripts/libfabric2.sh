#!/usr/bin/env bash
# Runs the in-process libfabric tests against libfabric 2.x (Debian 13's
# packages from the machine's configured Debian mirror, unpacked under
# target/libfabric2; skipped when they cannot be fetched). Needs apt-get and
# dpkg; see `cargo xtask libfabric2` (xtask/src/libfabric2.rs).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo xtask libfabric2
