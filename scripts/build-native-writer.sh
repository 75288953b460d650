#!/usr/bin/env bash
# Build (--test: test, then build) the native --record writer (native/stadium-record-writer, Rust:
# arrow-rs' parquet) and put it beside stadium/_server/ledger/writer.py, where a recording worker
# finds it. Without cargo it says so and exits 0: the Python writer then writes the shards.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/src/stadium/_server/ledger/stadium-record-writer"
CARGO="$(command -v cargo || true)"
if [ -z "$CARGO" ] && [ -x "${HOME:-/root}/.cargo/bin/cargo" ]; then CARGO="${HOME:-/root}/.cargo/bin/cargo"; fi
if [ -z "$CARGO" ]; then
  echo "build-native-writer: no cargo: --record's shards are written by the Python writer" >&2
  exit 0
fi
MANIFEST="$ROOT/native/stadium-record-writer/Cargo.toml"
if [ "${1:-}" = "--test" ]; then  # its own unit tests first (make test)
  "$CARGO" test --quiet --release --manifest-path "$MANIFEST"
fi
"$CARGO" build --quiet --release --manifest-path "$MANIFEST"
install -m 0755 "$ROOT/native/stadium-record-writer/target/release/stadium-record-writer" "$DEST.tmp"
mv -f "$DEST.tmp" "$DEST"
