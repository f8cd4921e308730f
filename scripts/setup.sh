#!/usr/bin/env bash
# Installs what a fresh Debian 12 machine needs to build and test weft.
# Idempotent and quick when everything is already there.
set -euo pipefail

# Runtime libraries the libfabric and verbs backends load with dlopen, plus
# headers/tools used by their tests (python3 for the Python package, etcd-server
# for the rendezvous tests, which start their own etcd). The workspace itself
# builds without them.
PKGS=(pkg-config libfabric1 libfabric-bin libfabric-dev libibverbs1 libibverbs-dev python3 python3-pip python3-venv etcd-server)

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

if ! command -v cargo >/dev/null 2>&1; then
  echo "setup: cargo not found; install Rust 1.95 with rustup (see rust-toolchain.toml)" >&2
  exit 1
fi
