"""What a sandboxed session's network costs (``--sandbox-network allowlist|public``): making
and removing its namespace, veth pair and rules, as the worker does off its event loop.
Root, iproute2 and nftables. ``python scripts/bench-netns.py [N]`` (default 50 each)."""

from __future__ import annotations

import statistics
import sys
import time

from stadium._server.isolation.worker.netns import Networks, leftovers


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 50
    for mode, allowed in (("allowlist", ("10.214.9.2", "192.0.2.0/24")), ("public", ())):
        nets = Networks(mode, allowed, "bench")
        made: list[float] = []
        removed: list[float] = []
        for _ in range(count):
            t = time.perf_counter()
            net = nets.create()
            made.append(time.perf_counter() - t)
            t = time.perf_counter()
            nets.remove(net)
            removed.append(time.perf_counter() - t)
        nets.close([])
        p99 = sorted(made)[int(0.99 * (count - 1))]
        print(
            f"{mode:9}  create p50 {statistics.median(made) * 1e3:5.1f} ms  "
            f"p99 {p99 * 1e3:5.1f} ms  remove p50 {statistics.median(removed) * 1e3:5.1f} ms"
        )
    left = leftovers()
    assert not any(left.values()), left
    print("left behind: nothing")


if __name__ == "__main__":
    main()
