#!/usr/bin/env bash
# Runs the in-process libfabric tests (smoke, conformance over tcp and shm,
# engine over tcp) against libfabric 2.x: Debian 13 (trixie)'s libfabric1
# package and the libraries it needs, unpacked under target/libfabric2 and
# loaded through trixie's own dynamic loader. Nothing is installed
# system-wide. The cross-process tests are not run here (their peers
# re-exec the test binary without this loader).
#
# Skips (exit 0, with a message) when trixie's packages cannot be fetched;
# fails when a test fails or the loaded library is not 2.x.
set -euo pipefail
cd "$(dirname "$0")/.."
dir="$PWD/target/libfabric2"
root="$dir/root"
mkdir -p "$dir/lists/partial" "$dir/cache/archives/partial" "$root"
cat > "$dir/trixie.sources" <<SRC
Types: deb
URIs: http://deb.debian.org/debian
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
apt_opts=(-o "Dir::Etc::SourceList=$dir/trixie.sources" -o Dir::Etc::SourceParts=/dev/null
  -o "Dir::State::Lists=$dir/lists" -o "Dir::Cache=$dir/cache" -o APT::Sandbox::User=root)
pkgs=(libfabric1 libc6 libibverbs1 ibverbs-providers librdmacm1t64 libpsm2-2 libnl-3-200
  libnl-route-3-200 libatomic1 libgcc-s1 libnuma1 libuuid1)
if [ ! -e "$root/.done" ]; then
  if ! apt-get "${apt_opts[@]}" -qq update >/dev/null 2>&1; then
    echo "libfabric2: SKIP: cannot fetch Debian trixie package lists"
    exit 0
  fi
  for p in "${pkgs[@]}"; do
    if ! (cd "$dir/cache" && apt-get "${apt_opts[@]}" -qq download "$p/trixie" >/dev/null 2>&1); then
      echo "libfabric2: SKIP: cannot download $p from trixie"
      exit 0
    fi
  done
  for d in "$dir"/cache/*.deb; do dpkg -x "$d" "$root"; done
  touch "$root/.done"
fi
loader="$root/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"
libpath="$root/usr/lib/x86_64-linux-gnu:$root/lib/x86_64-linux-gnu"
echo "libfabric2: $(ls "$dir"/cache/libfabric1_*.deb | xargs -n1 basename)"

tests=(smoke conformance_tcp conformance_shm engine_tcp)
args=()
for t in "${tests[@]}"; do args+=(--test "$t"); done
bins=$(cargo test -p weft-libfabric "${args[@]}" --no-run --message-format=json 2>/dev/null \
  | grep -o '"executable":"[^"]*"' | cut -d'"' -f4)
[ -n "$bins" ] || { echo "libfabric2: no test binaries built" >&2; exit 1; }
for b in $bins; do
  echo "libfabric2: $(basename "$b") against libfabric 2.x"
  WEFT_EXPECT_LIBFABRIC_MAJOR=2 "$loader" --library-path "$libpath" "$b"
done
