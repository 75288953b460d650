"""``stadium bench rl``: the RL-step workload's plan (seeded turns and think times), its
bounded concurrent resets, its figures, and the command against real servers."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from stadium import ConfigError
from stadium._core.urls import ws_url
from stadium.bench.arms import free_port
from stadium.bench.clientwatch import CLIENT_GC_THRESHOLDS, ClientStats
from stadium.bench.rl import (
    PRESETS,
    EpisodeRecord,
    RlProfile,
    episodes,
    parse_range,
    run_profile,
    summarize,
)
from stadium.bench.sessions import ws_connection_class
from tests.conftest import UNIT, serve

SMALL = RlProfile(
    sessions=24, concurrent_resets=4, turns=(1, 4), think_s=(0.0, 0.01), tool_s=0.002, seed=7,
    connect_timeout=10 * UNIT, request_timeout=10 * UNIT,
)  # fmt: skip


def test_the_openenv_stress_preset_is_the_stress_tests_defaults() -> None:
    p = PRESETS["openenv-stress"]
    assert (p.sessions, p.concurrent_resets, p.turns, p.think_s) == (
        2000,
        256,
        (3, 20),
        (1.0, 20.0),
    )


def test_episodes_are_seeded_and_within_the_ranges() -> None:
    plan = episodes(PRESETS["openenv-stress"])
    assert len(plan) == 2000
    assert plan == episodes(PRESETS["openenv-stress"])  # the same seed, the same episodes
    other = episodes(dataclasses.replace(PRESETS["openenv-stress"], seed=1))
    assert [e.thinks for e in other] != [e.thinks for e in plan]
    assert {e.turns for e in plan} == set(range(3, 21))  # every count in range, none outside
    thinks = [t for e in plan for t in e.thinks]
    assert 1.0 <= min(thinks) < 1.1
    assert 19.9 < max(thinks) <= 20.0
    assert [e.index for e in plan] == list(range(2000))


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"sessions": 0}, "--sessions"),
        ({"concurrent_resets": 0}, "--concurrent-resets"),
        ({"turns": (5, 3)}, "--turns"),
        ({"think_s": (-1.0, 2.0)}, "--think"),
        ({"tool_s": -0.001}, "--tool-ms"),
    ],
)
def test_a_bad_profile_says_which_option_is_wrong(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        dataclasses.replace(SMALL, **changes)


def test_parse_range() -> None:
    assert parse_range("3-20", int) == (3, 20)
    assert parse_range("0.5-2", float) == (0.5, 2.0)
    assert parse_range("4", int) == (4, 4)
    with pytest.raises(ConfigError, match="LOW-HIGH"):
        parse_range("a-b", int)


def test_summary_subtracts_the_envs_own_time_and_counts_failures() -> None:
    profile = dataclasses.replace(SMALL, tool_s=0.010)
    records = [
        EpisodeRecord(0, 2, ok=True, connect_s=0.001, reset_s=0.002, turn_s=[0.011, 0.012]),
        EpisodeRecord(1, 1, ok=True, connect_s=0.003, reset_s=0.004, turn_s=[0.015]),
        EpisodeRecord(2, 3, error="refused", detail="x"),
    ]
    s = summarize("stadium", profile, records, wall_s=2.0, server_cpu_s=0.003, server_cores=1.0)
    assert (s.sessions, s.ok, s.failed, s.errors) == (3, 2, 1, {"refused": 1})
    assert (s.turns, s.planned_turns) == (3, 6)
    assert s.overhead_p50_ms == pytest.approx(2.0)
    assert s.overhead_p99_ms == s.overhead_max_ms == pytest.approx(5.0)
    assert s.connect_p99_ms == pytest.approx(3.0)
    assert s.sessions_per_s_per_core == pytest.approx(1.0)  # 2 ok sessions in 2 s on 1 core
    assert s.turns_per_s_per_core == pytest.approx(1.5)
    assert s.server_cpu_per_turn_us == pytest.approx(1000.0)
    halved = summarize("x", profile, records, wall_s=2.0, server_cpu_s=None, server_cores=2.0)
    assert halved.turns_per_s_per_core == pytest.approx(0.75)
    assert halved.server_cpu_per_turn_us is None


async def test_episodes_run_their_turns_with_resets_bounded() -> None:
    base = ws_connection_class()
    state = {"resetting": 0, "peak": 0}

    class Counting(base):  # type: ignore[misc, valid-type]
        async def connect(self, limit: float) -> None:
            state["resetting"] += 1
            state["peak"] = max(state["peak"], state["resetting"])
            await super().connect(limit)

        async def request(self, kind: str, body: bytes, limit: float) -> dict[str, Any]:
            reply: dict[str, Any] = await super().request(kind, body, limit)
            if kind == "reset":
                state["resetting"] -= 1
            return reply

    async with serve("benchmark") as server:
        records = await run_profile(SMALL, ws_url(server.url), Counting)
    plan = episodes(SMALL)
    assert [r.index for r in records] == list(range(24))
    assert all(r.ok for r in records), [r.detail for r in records if not r.ok]
    assert [len(r.turn_s) for r in records] == [e.turns for e in plan]
    assert state["peak"] == SMALL.concurrent_resets  # reached, never passed
    # Every reply took at least the env's own time (its wait): the overhead is >= 0.
    assert min(t for r in records for t in r.turn_s) >= SMALL.tool_s
    # Each turn's send time (from the run's start): one per turn, in order, each after the
    # previous turn's reply.
    for r in records:
        assert len(r.turn_at) == len(r.turn_s)
        assert all(a >= 0.0 for a in r.turn_at)
        for (a, s), b in zip(zip(r.turn_at, r.turn_s, strict=False), r.turn_at[1:], strict=False):
            assert b >= a + s


class _Late:
    """A connection with no socket whose replies 'arrive' at once (``replied_at``, as the
    picows client notes it in its frame callback) but whose waiting task resumes late."""

    def __init__(self, url: str, source: str | None) -> None:
        self.replied_at = 0.0
        self.sent: list[str] = []

    async def connect(self, limit: float) -> None:
        pass

    async def request(self, kind: str, body: bytes, limit: float) -> dict[str, Any]:
        self.sent.append(kind)
        self.replied_at = time.monotonic()
        await asyncio.sleep(0.05)  # the client busy elsewhere before this task resumes
        return {}

    def close(self) -> None:
        pass

    async def closed(self, limit: float) -> str:
        return ""

    def abort(self) -> None:
        pass


async def test_a_turn_is_timed_to_its_replys_arrival_not_the_tasks_resumption() -> None:
    profile = dataclasses.replace(SMALL, sessions=3, turns=(2, 2), think_s=(0.0, 0.0))
    watch: list[ClientStats] = []
    records = await run_profile(profile, "ws://unused", _Late, watch=watch)
    assert all(r.ok for r in records)
    turns = [t for r in records for t in r.turn_s]
    assert len(turns) == 6
    assert max(turns) < 0.05  # the 50 ms before each resumption is not counted
    # The client watched itself meanwhile: its collector quiet, its loop probed.
    assert len(watch) == 1
    assert watch[0].probes > 0
    assert gc.get_threshold() != CLIENT_GC_THRESHOLDS  # restored after the run


async def test_a_connection_without_replied_at_is_timed_on_resumption() -> None:
    class Plain(_Late):
        async def request(self, kind: str, body: bytes, limit: float) -> dict[str, Any]:
            del self.replied_at  # an HTTP-style connection: no frame callback
            self.replied_at = 0.0
            await asyncio.sleep(0.05)
            return {}

    profile = dataclasses.replace(SMALL, sessions=1, turns=(1, 1), think_s=(0.0, 0.0))
    records = await run_profile(profile, "ws://unused", Plain)
    assert records[0].ok
    assert records[0].turn_s[0] >= 0.05


async def test_the_picows_client_notes_when_each_reply_arrived() -> None:
    conn_class = ws_connection_class()
    async with serve("benchmark") as server:
        conn = conn_class(ws_url(server.url), None)
        try:
            await conn.connect(10 * UNIT)
            assert conn.replied_at == 0.0
            t = time.monotonic()
            await conn.request("reset", b'{"type":"reset","data":{}}', 10 * UNIT)
            assert t <= conn.replied_at <= time.monotonic()
        finally:
            conn.abort()


async def test_episodes_against_no_server_fail_as_refused() -> None:
    url = f"ws://127.0.0.1:{free_port()}/ws"
    records = await run_profile(dataclasses.replace(SMALL, sessions=5), url)
    s = summarize("none", SMALL, records, wall_s=1.0, server_cpu_s=None, server_cores=1.0)
    assert (s.ok, s.failed, s.turns) == (0, 5, 0)
    assert set(s.errors) <= {"refused", "disconnected"}, s.errors


@pytest.mark.slow
def test_the_command_runs_each_arm_and_tables_them(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "stadium", "bench", "rl", "--arm", "stadium", "--arm", "floor",
           "--sessions", "12", "--concurrent-resets", "3", "--turns", "1-3",
           "--think", "0-0.02", "--tool-ms", "1", "--cpus", "", "--load-cpus", "",
           "--output-dir", str(tmp_path)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120 * UNIT, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    raw = json.loads((tmp_path / "rl.json").read_text())
    assert set(raw["arms"]) == {"stadium", "floor"}
    turns = [len(e.thinks) for e in episodes(RlProfile(12, 3, (1, 3), (0.0, 0.02), 0.001))]
    for arm in ("stadium", "floor"):
        summary = raw["arms"][arm]["summary"]
        assert (summary["ok"], summary["failed"]) == (12, 0)
        assert summary["turns"] == summary["planned_turns"] == sum(turns)
        assert summary["server_cpu_s"] is not None  # the server's process tree was sampled
        assert summary["server_cores"] == os.cpu_count()  # no --cpus: every core
        client = raw["arms"][arm]["client"]  # the client watched itself
        assert client["probes"] > 0
        assert client["lag_ms"]["p99"] is not None
        turn_at = [a for e in raw["arms"][arm]["episodes"] for a in e["turn_at"]]
        assert len(turn_at) == summary["turns"]
    table = (tmp_path / "rl.md").read_text()
    assert "stadium: client loop lag p50" in table
    assert "| stadium | 12 / 12 |" in table
    assert "| floor | 12 / 12 |" in table
