"""First and repeated ``ImageStore.prepare`` of each REF given, each into an empty store.

    flock /tmp/bench.lock python scripts/bench-image-prepare.py [--root DIR] REF...

(docs/IMAGES.md, "Figures"). The store's root (default /var/tmp/stadium-image-figures) is
emptied before each REF and removed at the end. Root: layers keep their owners.
"""

from __future__ import annotations

import argparse
import shutil
import time

from stadium._server.images import ImageStore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default="/var/tmp/stadium-image-figures")
    parser.add_argument("--again", type=int, default=2000, help="prepares timed after the first")
    parser.add_argument("refs", nargs="+", metavar="REF")
    args = parser.parse_args()
    try:
        for ref in args.refs:
            shutil.rmtree(args.root, ignore_errors=True)
            store = ImageStore(args.root)
            start = time.perf_counter()
            image = store.prepare(ref)
            first = time.perf_counter() - start
            start = time.perf_counter()
            for _ in range(args.again):
                store.prepare(ref)
            again = (time.perf_counter() - start) / args.again
            print(
                f"{ref}: first {first:.2f} s ({len(image.layers)} layers, "
                f"{image.size_bytes / 2**20:.0f} MiB); again {again * 1e6:.0f} us per prepare"
            )
    finally:
        shutil.rmtree(args.root, ignore_errors=True)


if __name__ == "__main__":
    main()
