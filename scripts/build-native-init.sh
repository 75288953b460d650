#!/usr/bin/env bash
# Build (--test: test, then build) the sandbox's native init (native/stadium-init, Rust, no dependencies) and put it beside
# stadium/_server/isolation/template/child.py, where sandboxed sessions find it. Without cargo it says so
# and exits 0: sandboxed sessions then run the same loop in a forked interpreter (~0.8 MiB more).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/src/stadium/_server/isolation/stadium-init"
CARGO="$(command -v cargo || true)"
if [ -z "$CARGO" ] && [ -x "${HOME:-/root}/.cargo/bin/cargo" ]; then CARGO="${HOME:-/root}/.cargo/bin/cargo"; fi
if [ -z "$CARGO" ]; then
  echo "build-native-init: no cargo: sandboxed sessions' pid 1 stays a forked interpreter" >&2
  exit 0
fi
MANIFEST="$ROOT/native/stadium-init/Cargo.toml"
if [ "${1:-}" = "--test" ]; then  # its own unit tests first (make test)
  "$CARGO" test --quiet --offline --manifest-path "$MANIFEST"
fi
"$CARGO" build --quiet --release --offline --manifest-path "$MANIFEST"
# Execute-only for others: the kernel makes a process executing a file it cannot read
# undumpable from the start (the sandbox uses no copy others may read).
install -m 0711 "$ROOT/native/stadium-init/target/release/stadium-init" "$DEST.tmp"
mv -f "$DEST.tmp" "$DEST"
