"""Python calls per step on the client side (BENCHMARKS.md, "Client calls per step").

``stadium bench ops`` counts the server's calls; this counts the clients': one resumable
:class:`stadium.AsyncClient` stepping alone, and a batched :class:`stadium.SessionPool`
(256 sessions on one ``stadium.batch`` connection, resumable), both against a
``stadium serve benchmark`` subprocess, counted with cProfile (deterministic: no clocks).
With ``--ref REF`` the same counts are taken with the clients of git ref ``REF`` too
(``git archive`` into a temporary directory), side by side, against the same server.
Each run also times the same steps unprofiled (the client process's CPU,
``time.process_time``, µs per step); ``--reps`` alternates the trees that many times and
prints each figure's median (the calls do not vary; the CPU times do, with the machine's load).

Usage: ``.venv/bin/python scripts/bench-client-calls.py [--steps N] [--reps N] [--ref main]``.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ACTION = {"wait_seconds": 0.0}


async def _counted(steps: int, run: Any) -> tuple[float, float]:
    """Python calls and client CPU µs per step of ``run()`` (``steps`` steps), counted with
    cProfile, then timed unprofiled."""
    prof = cProfile.Profile()
    prof.enable()
    await run()
    prof.disable()
    start = time.process_time()
    await run()
    cpu = time.process_time() - start
    return pstats.Stats(prof).total_calls / steps, cpu / steps * 1e6  # type: ignore[attr-defined]


async def count(url: str, steps: int, size: int) -> list[float]:
    """Calls and CPU per step: one AsyncClient, then per session-step of a batched pool."""
    import stadium  # the tree on sys.path / PYTHONPATH

    async with stadium.AsyncClient(url) as env:
        assert env.session_id is not None, "not a resumable session"
        await env.reset(seed=1)
        for _ in range(50):
            await env.step(ACTION)

        async def alone() -> None:
            for _ in range(steps):
                await env.step(ACTION)

        one = await _counted(steps, alone)
    rounds = max(1, steps // size)
    async with stadium.SessionPool(url, size, batch=True) as pool:
        await pool.reset(seeds=range(size))
        for _ in range(5):
            await pool.step([ACTION] * size)

        async def batched() -> None:
            for _ in range(rounds):
                await pool.step([ACTION] * size)

        many = await _counted(rounds * size, batched)
    return [*one, *many]


def measure(src: Path, url: str, steps: int, size: int) -> list[float]:
    """The figures with the clients of the source tree ``src``, in a fresh interpreter."""
    out = subprocess.run(
        [sys.executable, __file__, "--child", url, "--steps", str(steps), "--size", str(size)],
        env={**os.environ, "PYTHONPATH": str(src), "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    return [float(x) for x in out.stdout.split()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--size", type=int, default=256, help="the batched pool's sessions")
    parser.add_argument("--reps", type=int, default=1, help="runs per tree, alternated")
    parser.add_argument("--ref", help="also count the clients of this git ref, side by side")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(*asyncio.run(count(args.child, args.steps, args.size)))
        return
    sys.path.insert(0, str(ROOT / "src"))
    from stadium.bench.arms import spawn_server

    trees = {"working tree": ROOT / "src"}
    with tempfile.TemporaryDirectory(prefix="stadium-calls-") as tmp:
        if args.ref:
            archive = subprocess.run(
                ["git", "-C", str(ROOT), "archive", args.ref, "src"],
                capture_output=True, check=True, timeout=60,
            )  # fmt: skip
            subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
            trees = {args.ref: Path(tmp) / "src", **trees}
        with spawn_server("benchmark") as (_proc, url):
            runs: dict[str, list[list[float]]] = {name: [] for name in trees}
            for _ in range(args.reps):
                for name, src in trees.items():
                    runs[name].append(measure(src, url, args.steps, args.size))
        print(f"per step (median of {args.reps}): Python calls and client CPU µs")
        print(f"{'clients of':<16} {'AsyncClient':>24} {'batched pool':>24}")
        for name, figures in runs.items():
            calls, cpu, calls_b, cpu_b = (statistics.median(f) for f in zip(*figures, strict=True))
            print(f"{name:<16} {calls:>11.2f} {cpu:>9.1f} µs {calls_b:>11.2f} {cpu_b:>9.1f} µs")


if __name__ == "__main__":
    main()
