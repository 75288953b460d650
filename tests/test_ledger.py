"""The episode ledger: each episode's cost (sent with the step that ends it, summed in
/metrics), ``--record`` (Parquet shards read back by pyarrow and pandas; a filter, a
redaction hook, a full disk), ``stadium replay`` and ``stadium check --actions-from``."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import glob
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pyarrow.parquet as pq
import pytest
import websockets
from click.testing import CliRunner

import stadium
from stadium import AsyncClient
from stadium._cli.main import cli
from stadium._cli.replay import replay
from stadium._server.ledger import record as record_module
from tests.conftest import UNIT, serve, wait_until
from tests.test_metrics import scrape, value


class Move(msgspec.Struct):
    n: float = 0.0


class Obs(msgspec.Struct):
    value: int
    t: int


def burn(seconds: float) -> None:
    """Spend ``seconds`` of this thread's CPU."""
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass


class Walker(stadium.Environment[Move, Obs, stadium.State]):
    """Deterministic given its seed; reward = the action's ``n``; done after ``length``
    steps (a reset option, 3 by default)."""

    blocking = False

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Obs:
        self.rng = random.Random(seed)
        self.t = 0
        self.length = int((options or {}).get("length", 3))
        return Obs(0, 0)

    def step(self, action: Move) -> stadium.StepResult[Obs]:
        if action.n < 0:
            raise ValueError("n must be >= 0")
        self.t += 1
        obs = Obs(self.rng.randrange(10**9), self.t)
        return stadium.StepResult(obs, reward=action.n, done=self.t >= self.length)


class SeedIgnoring(Walker):
    """Walker whose reset ignores the seed (OpenEnv's #1102): caught at the first step."""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Obs:
        obs = super().reset(seed=seed, options=options)
        self.rng = random.Random()
        return obs


class Burner(Walker):
    """Each step burns 10 ms of CPU, on the event loop (a non-blocking sync env)."""

    def step(self, action: Move) -> stadium.StepResult[Obs]:
        burn(0.01)
        return super().step(action)


class PoolBurner(Burner):
    """Burner whose steps run on the env thread pool (a blocking sync env)."""

    blocking = True


class Sleeper(Walker):
    """Each step sleeps 50 ms on the pool: wall time, next to no CPU."""

    blocking = True

    def step(self, action: Move) -> stadium.StepResult[Obs]:
        time.sleep(0.05)
        return super().step(action)


def redact(record: dict[str, Any]) -> dict[str, Any] | None:
    """The test's --record-redact hook: no episode of seed 13; observations blanked."""
    if record["seed"] == 13:
        return None
    for step in record["steps"]:
        step["observation"] = "[redacted]"
    return record


async def _episode(url: str, seed: int, moves: list[float], **options: Any) -> list[Any]:
    async with AsyncClient(url) as env:
        await env.reset(seed=seed, **options)
        return [await env.step({"n": n}) for n in moves]


# -- cost -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "source"), [(Burner, "loop"), (PoolBurner, "thread")], ids=["loop", "pool"]
)
async def test_a_step_burning_10ms_of_cpu_costs_that(env: type[Walker], source: str) -> None:
    async with serve(env) as server:
        results = await _episode(server.url, 1, [1.0, 1.0, 1.0])
        assert [r.cost is None for r in results] == [True, True, False]
        cost = results[-1].cost
        assert cost.steps == 3
        assert cost.cpu_source == source
        # Three steps of >= 10 ms of CPU each, measured inside the worker: at least 30 ms,
        # and no more than the episode's wall time (reset to last reply).
        assert 0.03 <= cost.cpu_s <= cost.wall_s
        m = await scrape(server.url)
        name = server.runtime.spec.name
        assert value(m, "stadium_episodes_total", env=name) == 1
        assert value(m, "stadium_episode_steps_total", env=name) == 3
        assert value(m, "stadium_episode_cpu_seconds_total", env=name) == pytest.approx(cost.cpu_s)


async def test_an_env_that_sleeps_costs_wall_time_not_cpu() -> None:
    async with serve(Sleeper) as server:
        results = await _episode(server.url, 1, [0.0, 0.0, 0.0])
        cost = results[-1].cost
        assert cost.wall_s >= 0.15
        assert cost.cpu_s < cost.wall_s / 3  # the pool thread slept: its CPU clock stood still


async def test_bytes_in_and_out_are_the_frames_exactly() -> None:
    async with serve(Walker) as server:
        async with websockets.connect(server.url.replace("http", "ws") + "/ws") as ws:
            sent = [
                b'{"type":"reset","data":{"seed":7,"length":2}}',
                b'{"type":"step","data":{"n":0.5}}',
                b'{"type":"step","data":{"n":0.25},"id":"x"}',
            ]
            replies = []
            for frame in sent:
                await ws.send(frame)
                replies.append(await ws.recv())
        last = json.loads(replies[-1])
        cost = last["cost"]
        assert last["data"]["done"] is True
        assert last["id"] == "x"
        # The last reply as counted: without its cost member.
        tail = replies[-1].encode() if isinstance(replies[-1], str) else replies[-1]
        bare = tail[: tail.index(b',"cost":')] + b"}"
        assert json.loads(bare) == {k: v for k, v in last.items() if k != "cost"}
        assert cost["bytes_in"] == sum(len(f) for f in sent)
        assert cost["bytes_out"] == sum(len(r) for r in replies[:-1]) + len(bare)
        assert cost["steps"] == 2
        # state carries the running episode's cost so far (here: none running)
        async with websockets.connect(server.url.replace("http", "ws") + "/ws") as ws:
            await ws.send(b'{"type":"state"}')
            assert "cost" not in json.loads(await ws.recv())
            await ws.send(b'{"type":"reset","data":{"seed":1}}')
            await ws.recv()
            await ws.send(b'{"type":"step","data":{"n":1}}')
            await ws.recv()
            await ws.send(b'{"type":"state"}')
            state = json.loads(await ws.recv())
            assert state["data"]["step_count"] == 1
            assert state["cost"]["steps"] == 1


@pytest.mark.parametrize("isolation", [None, "process"])
async def test_a_forks_episode_is_accounted_from_the_fork(isolation: str | None) -> None:
    """A fork made mid-episode ends its copy of the episode with a cost of its own (the
    steps after the fork; it had none: its accounting never began without a reset), and
    both episodes are counted, their steps once each."""
    options = {} if isolation is None else {"isolation": isolation}
    async with serve(Walker, **options) as server:
        async with AsyncClient(server.url) as parent:
            await parent.reset(seed=3, options={"length": 4})
            await parent.step({"n": 1})
            child = await parent.fork()
            try:
                ran = [await child.step({"n": 1}) for _ in range(3)]
            finally:
                await child.close()
            mine = [await parent.step({"n": 1}) for _ in range(3)]
        name = server.runtime.spec.name
        m = await scrape(server.url)
    assert ran[-1].observation["t"] == 4
    assert ran[-1].done
    forked = ran[-1].cost
    assert forked is not None, "the fork's episode ended without its cost"
    assert forked.steps == 3
    assert forked.wall_s > 0
    assert forked.bytes_in > 0
    assert forked.bytes_out > 0
    if isolation == "process":
        assert forked.cpu_source == "process"
    assert mine[-1].cost is not None
    assert mine[-1].cost.steps == 4
    assert value(m, "stadium_episodes_total", env=name) == 2
    assert value(m, "stadium_episode_steps_total", env=name) == 7


@pytest.mark.slow  # OpenEnv's client takes seconds to import
async def test_openenv_clients_ignore_the_cost_member() -> None:
    """OpenEnv 0.10's EnvClient reads only ``type`` and ``data`` of a reply."""
    from openenv.core.generic_client import GenericEnvClient

    async with serve(Walker) as server:
        async with GenericEnvClient(base_url=server.url) as env:
            await env.reset(seed=1)
            results = [await env.step({"n": 1.0}) for _ in range(3)]
    assert [r.done for r in results] == [False, False, True]
    assert results[-1].reward == 1.0


# -- recording ------------------------------------------------------------------------------


def _shards(directory: Path) -> list[str]:
    return sorted(glob.glob(str(directory / "*.parquet")))


def _rows(directory: Path) -> list[dict[str, Any]]:
    return [row for path in _shards(directory) for row in pq.read_table(path).to_pylist()]


async def _recorded(directory: Path, n: int) -> list[dict[str, Any]]:
    await wait_until(lambda: len(_rows(directory)) >= n, 30 * UNIT, f"{n} episodes recorded")
    return _rows(directory)


@pytest.mark.parametrize("writer", ["native", "python"])
async def test_every_episode_is_recorded_and_replays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str
) -> None:
    monkeypatch.setenv("STADIUM_RECORD_WRITER", writer)
    async with serve(Walker, record=str(tmp_path)) as server:
        url = server.url
        await _episode(url, 1, [0.5, 1.0, 0.25])  # done
        async with AsyncClient(url) as env:
            await env.reset(seed=2, length=5)
            await env.step({"n": 1.0})
            with pytest.raises(stadium.ExecutionError):
                await env.step({"n": -1.0})  # the env raises: recorded as the step's error
            await env.reset(seed=3)  # ends episode 2 ("reset")
            await env.step({"n": 2.0})
        # the session closed: episode 3 ended ("closed")
        rows = await _recorded(tmp_path, 3)
    by_seed = {r["seed"]: r for r in rows}
    first, second, third = by_seed[1], by_seed[2], by_seed[3]
    assert first["env"] == server.runtime.spec.name
    assert first["end"] == "done"
    assert first["actions"] == ['{"n":0.5}', '{"n":1.0}', '{"n":0.25}']
    assert first["rewards"] == [0.5, 1.0, 0.25]
    assert first["total_reward"] == 1.75
    assert first["dones"] == [False, False, True]
    assert [json.loads(o)["t"] for o in first["observations"]] == [1, 2, 3]
    assert first["steps"] == 3
    assert first["bytes_in"] > 0
    assert first["cpu_source"] == "loop"
    assert second["end"] == "reset"
    assert json.loads(second["options"]) == {"length": 5}
    assert second["step_errors"][0] is None
    assert "n must be >= 0" in second["step_errors"][1]
    assert second["error"] == second["step_errors"][1]
    assert second["observations"][1] is None
    assert third["end"] == "closed"
    assert third["steps"] == 1
    frame = pq.read_table(_shards(tmp_path)[0]).to_pandas()  # pandas reads it as is
    assert {"episode_id", "actions", "cpu_s", "wall_s"} <= set(frame.columns)

    # Replayed in process: the same env gives the same episodes; a seed-ignoring one is
    # caught at its first step, in every episode.
    same = replay(str(tmp_path), "tests.test_ledger:Walker", jobs=2)
    assert same.total == 3
    assert same.divergences == []
    other = replay(str(tmp_path), "tests.test_ledger:SeedIgnoring")
    assert sorted((d.step, d.field) for d in other.divergences) == [(1, "observation")] * 3
    assert '- "value":' in other.divergences[0].diff
    runner = CliRunner()
    ok = runner.invoke(cli, ["replay", str(tmp_path), "tests.test_ledger:Walker"])
    assert ok.exit_code == 0, ok.output
    assert "3 episode(s) replayed" in ok.output
    bad = runner.invoke(cli, ["replay", str(tmp_path), "tests.test_ledger:SeedIgnoring"])
    assert bad.exit_code == 1
    assert "DIVERGED" in bad.output
    assert "observation at step 1" in bad.output
    # stadium check with the first recorded episode's actions
    checked = runner.invoke(
        cli, ["check", "tests.test_ledger:Walker", "--actions-from", str(tmp_path)]
    )
    assert checked.exit_code == 0, checked.output


@pytest.mark.slow  # importing datasets takes seconds
async def test_a_recording_loads_as_a_hugging_face_dataset(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")  # the dev extra installs it
    record = tmp_path / "rec"
    async with serve(Walker, record=str(record)) as server:
        await _episode(server.url, 1, [0.5, 1.0, 0.25])
        await _recorded(record, 1)
    ds = datasets.load_dataset(
        "parquet", data_files=str(record / "*.parquet"), split="train",
        cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    assert ds.num_rows == 1
    assert ds[0]["actions"] == ['{"n":0.5}', '{"n":1.0}', '{"n":0.25}']
    assert ds[0]["steps"] == 3


async def test_replay_on_a_server(tmp_path: Path) -> None:
    async with serve(Walker, record=str(tmp_path)) as server:
        for seed in (1, 2):
            await _episode(server.url, seed, [0.5, 1.0, 0.25])
        rows = await _recorded(tmp_path, 2)  # (the replay's own episodes are recorded too)
        report = await asyncio.to_thread(replay, "", url=server.url, jobs=2, episodes=rows)
    assert report.total == 2
    assert report.divergences == []
    async with serve(SeedIgnoring) as other:
        report = await asyncio.to_thread(replay, "", url=other.url, episodes=rows)
    assert [(d.step, d.field) for d in report.divergences] == [(1, "observation")] * 2


async def test_filter_and_redaction(tmp_path: Path) -> None:
    async with serve(
        Walker, record=str(tmp_path), record_filter="reward>0.9 or error",
        record_redact="tests.test_ledger:redact",
    ) as server:  # fmt: skip
        await _episode(server.url, 1, [0.1, 0.1, 0.1])  # total 0.3: not written
        await _episode(server.url, 2, [0.5, 0.5, 0.5])  # total 1.5: written, redacted
        await _episode(server.url, 13, [1.0, 1.0, 1.0])  # dropped by the hook
        async with AsyncClient(server.url) as env:
            await env.reset(seed=4)
            with pytest.raises(stadium.ExecutionError):
                await env.step({"n": -1.0})  # an error: written
        rows = await _recorded(tmp_path, 2)
        await wait_until(lambda: server.runtime.sessions == set(), 5 * UNIT)
    assert sorted(r["seed"] for r in rows) == [2, 4]
    kept = next(r for r in rows if r["seed"] == 2)
    assert kept["observations"] == ['"[redacted]"'] * 3
    assert kept["total_reward"] == 1.5


async def test_a_msgpack_session_is_recorded_as_json(tmp_path: Path) -> None:
    async with serve(Walker, record=str(tmp_path)) as server:
        ws_url = server.url.replace("http", "ws", 1) + "/ws"
        protocols: Any = ["stadium.msgpack"]
        async with websockets.connect(ws_url, subprotocols=protocols) as ws:
            for frame in (
                {"type": "reset", "data": {"seed": 5}},
                *({"type": "step", "data": {"n": 0.5}} for _ in range(3)),
            ):
                await ws.send(msgspec.msgpack.encode(frame))
                reply = msgspec.msgpack.decode(await ws.recv())
                assert reply["type"] == "observation", reply
        rows = await _recorded(tmp_path, 1)
    (row,) = rows
    assert row["actions"] == ['{"n":0.5}'] * 3
    assert [json.loads(o)["t"] for o in row["observations"]] == [1, 2, 3]
    assert json.loads(row["reset_observation"]) == {"value": 0, "t": 0}
    assert row["rewards"] == [0.5] * 3
    assert row["total_reward"] == 1.5


def test_a_batch_keeps_the_episodes_its_filter_keeps_and_no_pandas(tmp_path: Path) -> None:
    """The writer's column path over one batch (episodes of two encodings, one failed
    step, the filter leaving out the middle ones), written without importing pandas."""
    script = """
import sys, time, msgspec
from stadium._env.cost import EpisodeCost
from stadium._server.ledger.episode import EndReason, Episode
from stadium._server.ledger.record import parse_filter
from stadium._server.ledger.rows import Rows, Shard, write_shard
import pyarrow.parquet as pq

def frame(obs, reward, done, json):
    data = {"type": "observation", "data": {"observation": obs, "reward": reward,
            "done": done}, "id": 1}
    return msgspec.json.encode(data) if json else msgspec.msgpack.encode(data)

def request(a, json):
    data = {"type": "step", "data": {"a": a}}
    return msgspec.json.encode(data) if json else msgspec.msgpack.encode(data)

def episode(i, rewards, json=True, error=None):
    steps = []
    for t, r in enumerate(rewards):
        steps += (request(i, json), frame({"i": i, "t": t}, r, t == len(rewards) - 1, json), 0.001)
    if error:
        steps += (request(-1, json), error, 0.002)
    n = len(steps) // 3
    cost = EpisodeCost(wall_s=0.1, cpu_s=0.01, steps=n, bytes_in=10, bytes_out=20)
    return Episode(f"e{i}", time.time(), i, None, frame({"i": i}, None, False, json),
                   tuple(steps), EndReason.DONE, cost, json=json)

rows = Rows(("walker", "1"), "info", parse_filter("reward>=1 or error"), None)
shard = Shard()
batch = [episode(0, [1.0, 0.5]), episode(1, [0.1]), episode(2, [0.2], json=False),
         episode(3, [2, None], json=False), episode(4, [0.0], error="E: boom"), episode(5, [3.0])]
added, failed = rows.add(batch, shard)
assert (added, failed) == (4, []), (added, failed)
write_shard(shard, sys.argv[1])
assert "pandas" not in sys.modules
t = pq.read_table(sys.argv[1]).to_pylist()
assert sorted(r["seed"] for r in t) == [0, 3, 4, 5], [r["seed"] for r in t]
by = {r["seed"]: r for r in t}
assert by[0]["rewards"] == [1.0, 0.5] and by[0]["total_reward"] == 1.5
assert by[0]["observations"] == ['{"i":0,"t":0}', '{"i":0,"t":1}']
assert by[3]["rewards"] == [2.0, None] and by[3]["total_reward"] == 2.0
assert by[3]["observations"] == ['{"i":3,"t":0}', '{"i":3,"t":1}'], by[3]
assert by[4]["step_errors"] == [None, "E: boom"] and by[4]["observations"][1] is None
assert by[4]["error"] == "E: boom"
assert by[5]["actions"] == ['{"a":5}'] and by[5]["step_errors"] == [None]
assert by[5]["reset_observation"] == '{"i":5}' and by[5]["options"] is None
print("ok")
"""
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "shard.parquet")],
        capture_output=True, text=True, timeout=60 * UNIT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok"


def test_the_writer_reads_the_loops_stream_and_no_pandas(tmp_path: Path) -> None:
    """The writer process's work over the loop's own stream (``Recorder`` to ``Writer``):
    interleaved episodes of two encodings cut into several reads, a failed step after a
    good one, an episode the loop dropped, the filter leaving some out; written without
    importing pandas."""
    script = """
import os, sys, time, msgspec
from stadium._env.cost import EpisodeCost
from stadium._server.ledger import record
from stadium._server.ledger.episode import EndReason
from stadium._server.ledger.writer import Writer
import pyarrow.parquet as pq

def frame(obs, reward, done, json):
    data = {"type": "observation", "data": {"observation": obs, "reward": reward,
            "done": done}, "id": 1}
    return msgspec.json.encode(data) if json else msgspec.msgpack.encode(data)

def request(a, json):
    data = {"type": "step", "data": {"a": a}}
    return msgspec.json.encode(data) if json else msgspec.msgpack.encode(data)

config = record.RecordConfig(sys.argv[1], filter="reward>=1 or error")
counts = [0.0] * 4
rec = record.Recorder(config, ("walker", "1"), "info", counts)
rec.state = record.RecorderState.RECORDING  # no pipe: the stream is taken from its buffer
blocks = []
def cut():
    rec._flush()
    blocks.append(bytes(rec._buf))
    rec._buf.clear()
json = {i: i % 2 == 0 for i in range(7)}
rewards = {0: [1.0, 0.5], 1: [0.1], 2: [2, None], 3: [0.2], 4: [0.0], 5: [3.0], 6: [5.0]}
rid = {i: rec.begin(f"e{i}", i, None, frame({"i": i}, None, False, json[i]), json[i])
       for i in range(7)}
for t in range(2):  # the episodes' steps interleaved, in two reads
    for i in range(7):
        if t < len(rewards[i]):
            reply = frame({"i": i, "t": t}, rewards[i][t], False, json[i])
            rec.step(rid[i], request(i, json[i]), reply, 0.001)
        if i == 4 and t == 0:  # a failed step after a good one, in the same read
            rec.step_failed(rid[4], request(-1, json[4]), "E: boom", 0.002)
    cut()
cost = EpisodeCost(wall_s=0.1, cpu_s=0.01, steps=2, bytes_in=10, bytes_out=20)
for i in range(7):
    rec.end(rid[i], EndReason.DONE, None if i == 6 else cost, False)  # 6: dropped
cut()

class Blocks:
    def take(self, timeout):
        return (blocks.pop(0) if blocks else b""), not blocks

Writer(config, ("walker", "1"), "info", os.getpid(), "episodes-t", counts).run(Blocks())
assert "pandas" not in sys.modules
assert counts[record.RECORDED] == 4 and counts[record.DROPPED] == 1, counts
t = pq.read_table(sys.argv[1]).to_pylist()
assert sorted(r["seed"] for r in t) == [0, 2, 4, 5], [r["seed"] for r in t]
by = {r["seed"]: r for r in t}
assert by[0]["rewards"] == [1.0, 0.5] and by[0]["total_reward"] == 1.5
assert by[0]["observations"] == ['{"i":0,"t":0}', '{"i":0,"t":1}'], by[0]
assert by[2]["rewards"] == [2.0, None] and by[2]["total_reward"] == 2.0
assert by[2]["observations"] == ['{"i":2,"t":0}', '{"i":2,"t":1}'], by[2]
assert by[4]["step_errors"] == [None, "E: boom"] and by[4]["observations"][1] is None
assert by[4]["error"] == "E: boom" and by[4]["actions"] == ['{"a":4}', '{"a":-1}'], by[4]
assert by[5]["actions"] == ['{"a":5}'] and by[5]["step_errors"] == [None]
assert by[5]["reset_observation"] == '{"i":5}' and by[5]["options"] is None
print("ok")
"""
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        capture_output=True, text=True, timeout=60 * UNIT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok"


def test_a_record_directory_another_user_could_write_is_refused(tmp_path: Path) -> None:
    """Shards are written under predictable names: a directory others can write would let
    another user plant a link the writer follows, or a shard replay and /web read."""
    from stadium._errors import ConfigError
    from stadium._server.processes.worker import record_config

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # as /tmp is
    config = stadium.ServerConfig(target="benchmark", record=str(shared))
    with pytest.raises(ConfigError, match="writable by every user"):
        record_config(config, check=True)
    os.chown(shared, 4242, 4242)
    shared.chmod(0o700)
    with pytest.raises(ConfigError, match="owned by uid 4242"):
        record_config(config, check=True)
    fresh = tmp_path / "a" / "new"  # made, private
    assert record_config(stadium.ServerConfig(target="benchmark", record=str(fresh)), check=True)
    assert fresh.stat().st_mode & 0o777 == 0o700


def test_a_bad_filter_or_hook_is_refused_before_serving() -> None:
    from stadium._errors import ConfigError
    from stadium._server.ledger import RecordConfig
    from stadium._server.ledger.record import load_redactor

    with pytest.raises(ConfigError, match="cannot read 'reward=>1'"):
        RecordConfig("/tmp/x", filter="reward=>1")
    with pytest.raises(ConfigError, match="cannot import"):
        load_redactor("tests.test_ledger:nope")
    with pytest.raises(ConfigError, match="go with --record"):
        stadium.ServerConfig(target="benchmark", record_sample=0.5)


@contextlib.contextmanager
def _full_disk(path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``path`` on a 64 KiB tmpfs filled to the last byte (as root), else shard writes
    failing with ENOSPC."""
    if os.geteuid() != 0:

        def full(rows: Any, where: str) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), where)

        monkeypatch.setattr(record_module, "write_shard", full)
        yield
        return
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)], check=True)
    try:
        with open(path / "filler", "wb") as f, contextlib.suppress(OSError):
            f.write(b"\0" * (1 << 20))
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


@pytest.mark.parametrize("writer", ["native", "python"])
async def test_a_full_disk_pauses_recording_never_a_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str
) -> None:
    monkeypatch.setenv("STADIUM_RECORD_WRITER", writer)
    target = tmp_path / "full"
    with _full_disk(target, monkeypatch):
        async with serve(Walker, record=str(target)) as server:
            name = server.runtime.spec.name
            for seed in range(3):
                results = await _episode(server.url, seed, [1.0, 1.0, 1.0])
                assert results[-1].done
                assert results[-1].cost is not None

            async def paused() -> bool:
                m = await scrape(server.url)
                return value(m, "stadium_record_write_errors_total", env=name) >= 1

            deadline = time.monotonic() + 30 * UNIT  # (a loaded machine: the writer starts slowly)
            while not await paused():
                assert time.monotonic() < deadline, "the write never failed"
                await _episode(server.url, 9, [1.0, 1.0, 1.0])
            m = await scrape(server.url)
            assert value(m, "stadium_recording", env=name) == 0
            assert value(m, "stadium_record_dropped_episodes_total", env=name) >= 1
            assert value(m, "stadium_recorded_episodes_total", env=name) == 0
            results = await _episode(server.url, 5, [1.0, 1.0, 1.0])  # still serving
            assert results[-1].done
        assert not glob.glob(str(target / "*.parquet*"))


# -- a worker killed mid-recording --------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("writer", ["native", "python"])
async def test_a_worker_killed_mid_recording_leaves_readable_shards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str
) -> None:
    monkeypatch.setenv("STADIUM_RECORD_WRITER", writer)
    from tests.conftest import proc_alive, proc_children
    from tests.test_supervisor import _serve

    record = tmp_path / "rec"
    stop = asyncio.Event()

    async def load(url: str) -> None:
        seed = 0
        while not stop.is_set():
            seed += 1
            with contextlib.suppress(Exception):  # sessions on the killed worker fail
                await _episode(url, seed, [1.0, 1.0, 1.0])

    def shards_of(pid: int) -> list[str]:
        return sorted(glob.glob(str(record / f"episodes-*-{pid}-*.parquet")))

    with _serve(
        "tests.test_ledger:Walker", "--workers", "2", "--record", str(record),
        "--drain-timeout", "1", "--resume-grace", "0",
    ) as served:  # fmt: skip
        workers = proc_children(served.proc.pid)
        assert len(workers) == 2
        loaders = [asyncio.create_task(load(served.url)) for _ in range(4)]
        try:
            await wait_until(lambda: any(shards_of(p) for p in workers), 30 * UNIT, "shards")
            victim = max(workers, key=lambda p: len(shards_of(p)))
            mark = b"record-writer" if writer == "native" else b"ledger.writer"
            writers = [p for p in proc_children(victim) if mark in _cmdline(p)]
            assert len(writers) == 1, "the recording worker has its writer process"
            os.kill(victim, signal.SIGKILL)
            killed_at = time.time()
            await wait_until(lambda: not proc_alive(victim), 5 * UNIT, "the worker died")
            # Its writer writes what it has, then exits: it dies with its worker.
            await wait_until(lambda: not proc_alive(writers[0]), 30 * UNIT, "the writer ended")
            await asyncio.sleep(0.5)
        finally:
            stop.set()
            await asyncio.gather(*loaders)
    # Every shard with its final name is whole: pyarrow reads each one.
    paths = sorted(glob.glob(str(record / "*.parquet")))
    assert paths
    rows = {path: pq.read_table(path).to_pylist() for path in paths}
    lost = [r for p in shards_of(victim) for r in rows[p]]
    assert lost, "the killed worker's closed shards are gone"
    # Its shards were closed about every second: what it lost began at most ~1 s before
    # the kill (a generous bound: the machine is shared).
    assert killed_at - max(r["started_at"] for r in lost) < 5 * UNIT
    leftovers = glob.glob(str(record / "*.tmp"))
    assert all(f"-{victim}-" in name for name in leftovers), leftovers


@pytest.mark.slow
def test_an_episode_past_the_buffer_is_dropped_and_counted_not_waited_for(tmp_path: Path) -> None:
    """The loop's buffer full (the writer process behind): the step that does not fit drops
    its episode (counted by the writer when its end arrives); the episodes that fit are
    written by the writer process, which the close lets finish."""
    from stadium._env.cost import EpisodeCost
    from stadium._server.ledger import RecordConfig, Recorder
    from stadium._server.ledger.episode import EndReason

    counts = [0.0] * 4
    config = RecordConfig(str(tmp_path / "rec"), queue_bytes=4096)
    recorder = Recorder(config, ("walker", "1"), "info", counts)
    reply = b'{"type":"observation","data":{"observation":{"x":"' + b"y" * 200 + b'"},'
    reply += b'"reward":1.0,"done":false}}'
    try:
        kept = recorder.begin("kept", 1, {"o": 1}, reply, True)
        assert kept is not None
        recorder.step(kept, b'{"type":"step","data":{"n":1}}', reply, 0.001)
        recorder.end(kept, EndReason.DONE, EpisodeCost(steps=1), False)
        big = recorder.begin("big", 2, None, reply, True)
        assert big is not None
        for _ in range(50):  # ~12 KiB: past the 4 KiB buffer, never flushed (no loop)
            recorder.step(big, b'{"type":"step","data":{"n":1}}', reply, 0.001)
        recorder.end(big, EndReason.DONE, EpisodeCost(steps=50), False)
    finally:
        recorder.close(timeout=30 * UNIT)
    rows = [r for p in recorder.written for r in pq.read_table(p).to_pylist()]
    assert [(r["episode_id"], r["seed"], r["steps"]) for r in rows] == [("kept", 1, 1)]
    assert json.loads(rows[0]["options"]) == {"o": 1}
    assert rows[0]["worker"] == os.getpid()
    assert counts[0] == 1  # recorded
    assert counts[1] == 1  # dropped: "big"


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


class Hog(Burner):
    """Burner whose step with ``n == 2`` holds 100 MiB, touched, until the episode ends."""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Obs:
        self.held = b""
        return super().reset(seed=seed, options=options)

    def step(self, action: Move) -> stadium.StepResult[Obs]:
        if action.n == 2:
            self.held = b"\x01" * (100 << 20)  # written: every page resident
        return super().step(action)


def _no_sandbox() -> str | None:
    from stadium._server.isolation import sandbox_unavailable

    return sandbox_unavailable()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("isolation", "source"),
    [
        ("process", "process"),
        pytest.param(
            "sandbox", "cgroup",
            marks=pytest.mark.skipif(_no_sandbox() is not None, reason=f"{_no_sandbox()}"),
        ),
    ],
)  # fmt: skip
async def test_an_isolated_episode_costs_its_process_cpu_and_peak_memory(
    isolation: str, source: str
) -> None:
    """A sandboxed session's cost is its cgroups' (cpuacct.usage, the memory peak); a
    process's its /proc files: an episode that burns CPU and holds 100 MiB reports them,
    the next episode of the same process starts its peak again."""
    async with serve(Hog, isolation=isolation) as server:
        async with AsyncClient(server.url) as env:
            await env.reset(seed=1)
            steps = [await env.step({"n": n}) for n in (2.0, 0.0, 0.0)]
            hog = steps[-1].cost
            await env.reset(seed=2)  # the same process: its peak starts again
            steps = [await env.step({"n": 0.0}) for _ in range(3)]
            lean = steps[-1].cost
    assert hog.cpu_source == lean.cpu_source == source
    # three steps of >= 10 ms each in the env process (/proc: in 10 ms ticks)
    assert 0.02 - 1e-6 <= hog.cpu_s <= hog.wall_s + 0.01  # (a sum of ticks: float rounding)
    assert lean.cpu_s >= 0.02 - 1e-6
    assert hog.peak_rss_bytes >= 100 << 20
    assert lean.peak_rss_bytes < 100 << 20


def test_cgroup_v2_peak_is_read_through_the_descriptor_its_reset_wrote_to(
    tmp_path: Path,
) -> None:
    """v2's ``memory.peak`` restarts for one open file (Linux ≥ 6.12): the session's
    Cgroup keeps it open from the reset, writes to it, and reads the peak through it (a
    plain file stands in for the cgroup's here: this host runs cgroup v1)."""
    from stadium._server.ledger.usage import Cgroup

    (tmp_path / "cpu.stat").write_bytes(b"usage_usec 2500000\n")
    peak = tmp_path / "memory.peak"
    peak.write_bytes(b"")
    cgroup = Cgroup([str(tmp_path)])
    assert cgroup.cpu_seconds() == 2.5
    assert cgroup.peak_bytes() is None  # no descriptor yet: nothing read
    cgroup.reset_peak()
    assert peak.read_bytes() == b"reset\n"  # written through the descriptor
    fd = cgroup.peak_fd
    peak.write_bytes(b"104857600\n")  # the kernel's answer to that descriptor's reads
    assert cgroup.peak_bytes() == 100 << 20
    cgroup.reset_peak()
    assert cgroup.peak_fd == fd  # one descriptor for the session's episodes
    cgroup.close()
    assert cgroup.peak_bytes() is None
    gone = Cgroup([str(tmp_path / "missing")])
    gone.reset_peak()  # an older kernel's (read-only) or a missing memory.peak: not read
    assert gone.peak is None
    assert gone.peak_bytes() is None


def test_a_forks_episode_leaves_its_parents_cgroup_peak_alone(tmp_path: Path) -> None:
    """A sandboxed fork shares its parent's cgroups: its episode's start must not restart
    their memory peak, which would cut the parent's running episode's (v2 stand-in files,
    as above)."""
    from types import SimpleNamespace

    from stadium._server.ledger.usage import episode_start

    (tmp_path / "cpu.stat").write_bytes(b"usage_usec 1000000\n")
    peak = tmp_path / "memory.peak"
    peak.write_bytes(b"")
    env = SimpleNamespace(proc=SimpleNamespace(cgroups=[str(tmp_path)]))
    forked = episode_start(env, None, shared=True)
    assert forked is not None
    assert forked[1] == 1.0
    assert peak.read_bytes() == b""  # not restarted
    started = episode_start(env, None)  # a reset's: restarted
    assert started is not None
    assert peak.read_bytes() == b"reset\n"
    for where, _ in (forked, started):
        where.close()  # type: ignore[union-attr]


def test_a_text_request_is_buffered_as_its_utf8_bytes(tmp_path: Path) -> None:
    """A step's request that came as text (a JSON text frame: ``str``) is buffered as its
    UTF-8 bytes, as the same request as bytes would be (``Recorder.step``'s usual case takes
    bytes only; nothing of a refused append is left behind)."""
    from stadium._server.ledger import RecordConfig, Recorder, RecorderState

    reply = b'{"type":"observation","data":{"observation":1,"reward":1.0,"done":false}}'
    text = '{"type":"step","data":{"n":"\u00e9"}}'
    buffers = []
    for request in (text, text.encode()):
        recorder = Recorder(RecordConfig(str(tmp_path / "rec")), ("walker", "1"), "info", [0.0] * 4)
        recorder.state = RecorderState.RECORDING  # no writer: the buffer is read
        rid = recorder.begin("e", 1, None, reply, True)
        assert rid is not None
        start = len(recorder._buf)  # after the begin (its time differs)
        recorder.step(rid, request, reply, 0.001)
        buffers.append(bytes(recorder._buf)[start:])
    assert buffers[0] == buffers[1]
    assert text.encode() + reply in buffers[0]
