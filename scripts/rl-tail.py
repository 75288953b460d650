#!/usr/bin/env python3
"""Where an ``stadium bench rl`` run's slow turns are: by turn index, by second of the run,
and how many of them overlap a stall of the client itself.

Reads ``rl.json`` (each turn's send time ``turn_at`` and latency ``turn_s``; the client's
loop lags ``client.lags`` as ``(due_s, lag_ms, cpu_ms)`` and collections ``client.gcs``).
A lag whose CPU time is far below it means the client was off the CPU (another process
ran on its core); near it, the client was busy.

Usage (BENCHMARKS.md, "An RL step")::

    .venv/bin/python scripts/rl-tail.py bench-results/rl-openenv-stress-3/rl.json [SLOW_MS]
"""

from __future__ import annotations

import bisect
import collections
import json
import sys
from typing import Any


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p / 100))] if values else float("nan")


def report(arm: str, data: dict[str, Any], slow_ms: float) -> None:
    turns = sorted(
        (at, s * 1e3, i)
        for e in data["episodes"]
        for i, (at, s) in enumerate(zip(e["turn_at"], e["turn_s"], strict=True))
    )
    lat = [ms for _, ms, _ in turns]
    slow = [t for t in turns if t[1] > slow_ms]
    print(f"== {arm}: {len(turns)} turns, p50 {pct(lat, 50):.2f} ms, p99 {pct(lat, 99):.2f} ms, "
          f"max {max(lat, default=0):.1f} ms; {len(slow)} turns over {slow_ms:g} ms")  # fmt: skip
    by_index: dict[int, list[float]] = collections.defaultdict(list)
    for _, ms, i in turns:
        by_index[i].append(ms)
    print("  p99 by turn index:",
          " ".join(f"{i}:{pct(v, 99):.1f}" for i, v in sorted(by_index.items())[:8]))  # fmt: skip
    by_second: dict[int, list[int]] = collections.defaultdict(lambda: [0, 0])
    for at, ms, _ in turns:
        by_second[int(at)][0] += 1
        by_second[int(at)][1] += ms > slow_ms
    print("  slow turns by second of the run (s: slow/all):",
          " ".join(f"{s}:{n}/{a}" for s, (a, n) in sorted(by_second.items()) if n))  # fmt: skip
    client = data.get("client")
    if not client:
        return
    lags = client["lags"]
    print(f"  client loop lag ms: {client['lag_ms']}; {len(lags)} lags kept, "
          f"{sum(lag for _, lag, _ in lags):.0f} ms in all, the client on the CPU for "
          f"{sum(cpu for _, _, cpu in lags):.0f} ms of it; {len(client['gcs'])} collections, "
          f"{sum(d for _, _, d in client['gcs']):.1f} ms")  # fmt: skip
    windows = sorted((due - lag / 1e3, due) for due, lag, _ in lags)
    starts = [w[0] for w in windows]
    overlapping = 0
    for at, ms, _ in slow:
        j = bisect.bisect_right(starts, at + ms / 1e3)
        overlapping += any(end >= at for _, end in windows[max(0, j - 64) : j])
    print(f"  slow turns overlapping a client lag: {overlapping}/{len(slow)}")


def main() -> None:
    raw = json.load(open(sys.argv[1]))  # noqa: SIM115
    slow_ms = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
    for arm, data in raw["arms"].items():
        report(arm, data, slow_ms)


if __name__ == "__main__":
    main()
