#!/usr/bin/env python3
"""What a durable session's snapshot costs, per env, against a fresh ``factory(); reset(seed)``.

For every built-in env (after a reset and a few steps), CartPole-v1 and OpenEnv's echo env
(``openenv init``'s template), prints: ``snapshot_env`` µs, ``restore_env`` µs (a fresh
instance from the factory + ``restore``), the blob's bytes, ``DirectoryStore.put`` µs on
tmpfs (/dev/shm) and on disk (/var/tmp), without and with ``fsync``, and a fresh
``env = factory(); env.reset(seed=...)`` µs: the fork-versus-reset question.

Run: ``.venv/bin/python scripts/bench-snapshot.py [--quick]``. Medians of repeated batches,
one process, no server: the numbers are the env-side costs a step pays under ``--durable``.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec

from stadium._env.snapshot import restore_env, snapshot_env
from stadium._server.durability.session_store import DirectoryStore
from stadium.envs.benchmark import BenchmarkAction, BenchmarkEnv
from stadium.envs.echo import EchoAction, EchoEnv
from stadium.envs.tools import NotesEnv
from stadium.envs.wordguess import Guess, WordGuessEnv


def run(value: Any) -> Any:
    """The result of a sync call, or of a coroutine that completes without waiting."""
    if inspect.iscoroutine(value):
        try:
            value.send(None)
        except StopIteration as done:
            return done.value
        raise RuntimeError("the coroutine waited: this bench drives only envs that do not")
    return value


def per_call_us(fn: Callable[[], Any], *, budget_s: float, batches: int = 7) -> float:
    """Median over ``batches`` of the mean µs per call, each batch sized to ~budget/batches."""
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    n = max(1, min(100_000, int(budget_s / batches / once)))
    results = []
    for _ in range(batches):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        results.append((time.perf_counter_ns() - t0) / n / 1000)
    return statistics.median(results)


def cases() -> Iterator[tuple[str, Callable[[], Any], dict[str, Any], list[Any]]]:
    notes = NotesEnv.action_type
    add = msgspec.convert(
        {"type": "call_tool", "tool_name": "add_note", "arguments": {"text": "2"}}, notes
    )
    yield "echo", EchoEnv, {"seed": 1}, [EchoAction("hello")] * 3
    yield "wordguess", WordGuessEnv, {"seed": 1}, [Guess("crane"), Guess("storm")]
    yield "benchmark", BenchmarkEnv, {"seed": 1}, [BenchmarkAction()] * 3
    yield "benchmark 64 KB", BenchmarkEnv, {"seed": 1, "options": {"state_kb": 64}}, []
    yield "benchmark 1 MB", BenchmarkEnv, {"seed": 1, "options": {"state_kb": 1024}}, []
    yield "tools (10 notes)", NotesEnv, {"seed": 1}, [add] * 10
    try:
        import numpy as np

        from stadium.integrations.gymnasium import gymnasium_environment
    except ImportError:
        print("(gymnasium not installed: CartPole skipped)", file=sys.stderr)
    else:
        cartpole = gymnasium_environment("CartPole-v1")
        yield "CartPole-v1", cartpole, {"seed": 1}, [np.int64(1), np.int64(0)] * 3
    openenv = openenv_echo()
    if openenv is not None:
        yield "OpenEnv echo", openenv, {"seed": 1}, [{"message": "hello"}] * 3


def openenv_echo() -> Any:
    """``openenv init``'s echo env behind Stadium's adapter (None without openenv)."""
    try:
        init = importlib.import_module("openenv.cli.commands.init")
        from stadium.integrations.openenv import openenv_environment
    except ImportError:
        print("(openenv not installed: its echo env skipped)", file=sys.stderr)
        return None
    root = Path(tempfile.mkdtemp(prefix="bench-snapshot-"))
    init._copy_template_directory(
        "openenv.cli.templates.openenv_env",
        "",
        root / "bench_echo",
        init._create_template_replacements("bench_echo"),
        "bench_echo",
    )
    sys.path.insert(0, str(root))
    module = importlib.import_module("bench_echo.server.bench_echo_environment")
    return openenv_environment(module.BenchEchoEnvironment)


def row(
    name: str,
    factory: Callable[[], Any],
    reset: dict[str, Any],
    actions: list[Any],
    stores: list[tuple[DirectoryStore, DirectoryStore]],
    budget: float,
) -> str:
    """One env's table row."""
    env = factory()
    run(env.reset(**reset))
    for action in actions:
        run(env.step(action))
    blob = snapshot_env(env)
    snap = per_call_us(lambda: snapshot_env(env), budget_s=budget)

    def restore() -> None:
        run(restore_env(factory, blob).close())

    def fresh() -> None:
        new = factory()
        run(new.reset(**reset))
        run(new.close())

    rest = per_call_us(restore, budget_s=budget)
    puts = []
    for plain, synced in stores:
        puts.append(per_call_us(lambda s=plain: s.put("bench", blob), budget_s=budget))
        puts.append(per_call_us(lambda s=synced: s.put("bench", blob), budget_s=budget * 3))
    reset_us = per_call_us(fresh, budget_s=budget)
    run(env.close())
    cells = [f"{snap:.1f}", f"{rest:.1f}", f"{len(blob):,}", *(f"{p:.1f}" for p in puts)]
    return f"| {name} | " + " | ".join(cells) + f" | {reset_us:.1f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs (noisier)")
    args = parser.parse_args()
    budget = 0.05 if args.quick else 0.3
    disks = {"tmpfs": "/dev/shm", "disk": "/var/tmp"}
    stores = {}
    for label, base in disks.items():
        path = Path(tempfile.mkdtemp(prefix="stadium-bench-", dir=base))
        stores[label] = DirectoryStore(path), DirectoryStore(path, fsync=True)
    print(
        f"# snapshot cost, {platform.python_implementation()} {platform.python_version()}, "
        f"{platform.machine()}, {os.cpu_count()} cores; µs per call (median of 7 batches)"
    )
    head = (
        "| env | snapshot µs | restore µs | bytes | put tmpfs µs | put tmpfs fsync µs "
        "| put disk µs | put disk fsync µs | fresh factory()+reset µs |"
    )
    print(head)
    print("|---|" + "---:|" * 8)
    for name, factory, reset, actions in cases():
        print(row(name, factory, reset, actions, list(stores.values()), budget))
    for plain, _ in stores.values():
        for key in list(plain.keys()):
            plain.delete(key)
        os.rmdir(plain.path)


if __name__ == "__main__":
    main()
