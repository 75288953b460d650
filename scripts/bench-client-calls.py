"""Python calls per step on the client side (BENCHMARKS.md, "Client calls per step").

``stadium bench ops`` counts the server's calls; this counts the clients': one resumable
:class:`stadium.AsyncClient` stepping alone, and a batched :class:`stadium.SessionPool`
(256 sessions on one ``stadium.batch`` connection, resumable), both against a
``stadium serve benchmark`` subprocess, counted with cProfile (deterministic: no clocks).
With ``--ref REF`` the same counts are taken with the clients of git ref ``REF`` too
(``git archive`` into a temporary directory), side by side, against the same server.

Usage: ``.venv/bin/python scripts/bench-client-calls.py [--steps N] [--ref main]``.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ACTION = {"wait_seconds": 0.0}


async def count(url: str, steps: int, size: int) -> tuple[float, float]:
    """Python calls per step: one AsyncClient, then per session-step of a batched pool."""
    import stadium  # the tree on sys.path / PYTHONPATH

    async with stadium.AsyncClient(url) as env:
        assert env.session_id is not None, "not a resumable session"
        await env.reset(seed=1)
        for _ in range(50):
            await env.step(ACTION)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            await env.step(ACTION)
        prof.disable()
        one = pstats.Stats(prof).total_calls / steps  # type: ignore[attr-defined]
    rounds = max(1, steps // size)
    async with stadium.SessionPool(url, size, batch=True) as pool:
        await pool.reset(seeds=range(size))
        for _ in range(5):
            await pool.step([ACTION] * size)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(rounds):
            await pool.step([ACTION] * size)
        prof.disable()
        batched = pstats.Stats(prof).total_calls / (rounds * size)  # type: ignore[attr-defined]
    return one, batched


def measure(src: Path, url: str, steps: int, size: int) -> tuple[float, float]:
    """The counts with the clients of the source tree ``src``, in a fresh interpreter."""
    out = subprocess.run(
        [sys.executable, __file__, "--child", url, "--steps", str(steps), "--size", str(size)],
        env={**os.environ, "PYTHONPATH": str(src), "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    one, batched = out.stdout.split()
    return float(one), float(batched)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--size", type=int, default=256, help="the batched pool's sessions")
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
            print(f"{'clients of':<16} {'AsyncClient':>12} {'batched pool':>13}  (calls per step)")
            for name, src in trees.items():
                one, batched = measure(src, url, args.steps, args.size)
                print(f"{name:<16} {one:>12.2f} {batched:>13.2f}")


if __name__ == "__main__":
    main()
