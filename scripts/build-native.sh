#!/usr/bin/env bash
# Build one of the project's Rust programs with cargo and put it where Stadium finds it:
#
#   build-native.sh CRATE DEST MODE WITHOUT [--offline] [--test]
#
# CRATE: the folder under native/; DEST: the installed path under src/; MODE: its file mode;
# WITHOUT: what Stadium does without it, said (and exit 0) when there is no cargo; --offline:
# the crate has no dependencies to fetch; --test: its own unit tests first (make test).
# `make sandbox-deps` builds native/stadium-init (the sandbox's pid 1), `make record-deps`
# native/stadium-record-writer (the --record writer) and native/stadium-record-buffer (a
# CPython extension: its [lib] name, e.g. _recordbuf, gives the product lib_recordbuf.so).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CRATE="$1" DEST="$ROOT/$2" MODE="$3" WITHOUT="$4"
shift 4
OFFLINE=() TEST=0
for arg in "$@"; do
  case "$arg" in
    --offline) OFFLINE=(--offline) ;;
    --test) TEST=1 ;;
    *) echo "build-native: unknown option $arg" >&2; exit 2 ;;
  esac
done
CARGO="$(command -v cargo || true)"
if [ -z "$CARGO" ] && [ -x "${HOME:-/root}/.cargo/bin/cargo" ]; then CARGO="${HOME:-/root}/.cargo/bin/cargo"; fi
if [ -z "$CARGO" ]; then
  echo "build-native: no cargo for native/$CRATE: $WITHOUT" >&2
  exit 0
fi
MANIFEST="$ROOT/native/$CRATE/Cargo.toml"
if [ "$TEST" = 1 ]; then
  "$CARGO" test --quiet --release "${OFFLINE[@]}" --manifest-path "$MANIFEST"
fi
"$CARGO" build --quiet --release "${OFFLINE[@]}" --manifest-path "$MANIFEST"
PRODUCT="$ROOT/native/$CRATE/target/release/$CRATE"
LIB="$(sed -n 's/^name = "\(_[a-z_]*\)"$/\1/p' "$MANIFEST")"  # a [lib] (a Python extension)
if [ -n "$LIB" ]; then PRODUCT="$ROOT/native/$CRATE/target/release/lib$LIB.so"; fi
install -m "$MODE" "$PRODUCT" "$DEST.tmp"
mv -f "$DEST.tmp" "$DEST"
