"""A recording read as its least trusted writers would have it: the clients' actions and
episode ids, the envs' observations and errors (a sandboxed env's, hostile code's), and a
shard that is not one of ours. The readers: ``/web/episodes`` (``_server/http/recordings``),
``stadium replay`` and ``stadium check --actions-from`` (``_cli/replay``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import tracemalloc
import types
from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import websockets
from click.testing import CliRunner

from stadium._cli.main import cli, main
from stadium._cli.replay import replay
from stadium._errors import ConfigError, StadiumError
from stadium._server.http import recordings
from stadium._server.http.recordings import RecordingIndex, RecordingsRoutes
from stadium._server.ledger.rows import schema
from tests.conftest import UNIT
from tests.test_ledger import Walker

SHARD = "episodes-walker-100-1700000000000-1.parquet"


def episode(i: int, steps: int = 2, **values: Any) -> dict[str, Any]:
    """A row of our schema: ``steps`` steps of the Walker's kind, ``values`` over it."""
    row: dict[str, Any] = {
        "env": "walker", "env_version": "1", "episode_id": f"ep-{i}", "worker": 100,
        "started_at": 1.7e9 + i, "seed": i, "options": None, "end": "done", "error": None,
        "clipped": False, "total_reward": float(i), "steps": steps, "wall_s": 0.01 * i,
        "cpu_s": 0.001 * i, "cpu_source": "loop", "bytes_in": 10, "bytes_out": 20,
        "peak_rss_bytes": None, "reset_observation": '{"t":0}', "reset_info": "{}",
        "actions": ['{"n":0.5}'] * steps,
        "observations": [f'{{"t":{t + 1}}}' for t in range(steps)],
        "rewards": [0.5] * steps, "dones": [False] * (steps - 1) + [True],
        "truncateds": [False] * steps, "infos": ["{}"] * steps,
        "step_errors": [None] * steps, "step_s": [0.001] * steps,
    }  # fmt: skip
    row.update(values)
    return row


def write(directory: Path, rows: list[dict[str, Any]], name: str = SHARD) -> Path:
    path = directory / name
    pq.write_table(pa.Table.from_pylist(rows, schema=schema(pa)), path, compression="zstd")
    return path


def python_bytes(fn: Any, *args: Any) -> tuple[Any, int]:
    """``fn(*args)`` and the most memory Python objects took meanwhile (Arrow's buffers
    are not Python objects: tracemalloc does not see them)."""
    tracemalloc.start()
    try:
        out = fn(*args)
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# -- /web/episodes: memory, bounds, the executor ------------------------------------------


def test_opening_a_long_episode_decodes_only_its_window(tmp_path: Path) -> None:
    """An episode of 200,000 steps (a hostile one, within the 16 MiB per episode): opening
    it makes Python values of the window asked for, not of every step (which took 120 MB
    of Python objects per request, in the worker that serves the sessions)."""
    write(tmp_path, [episode(0, steps=200_000)])
    opened, peak = python_bytes(RecordingIndex(str(tmp_path)).one, SHARD, 0, 150_000, 100)
    assert opened["steps_total"] == 200_000
    assert opened["step_count"] == 100
    assert opened["window"]["observations"][0] == '{"t":150001}'
    assert peak < 4 << 20, f"{peak / 2**20:.0f} MiB of Python objects for 100 steps"


def test_the_index_holds_columns_not_python_rows(tmp_path: Path) -> None:
    """The browsed episodes stay Arrow columns: 40,000 of them held no 35 MB of dicts (a
    worker's index could reach 200,000 episodes: 170 MB in every worker that answered)."""
    write(tmp_path, [episode(i, steps=1) for i in range(40_000)])
    index = RecordingIndex(str(tmp_path))
    tracemalloc.start()
    try:
        listed = index.episodes()
        del listed
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held < 4 << 20, f"{held / 2**20:.0f} MiB of Python objects held by the index"


def routes(directory: Path, web: bool = True) -> RecordingsRoutes:
    recorder = types.SimpleNamespace(config=types.SimpleNamespace(directory=str(directory)))
    runtime = types.SimpleNamespace(
        ledger=types.SimpleNamespace(recorder=recorder), doors=types.SimpleNamespace(tenants=None)
    )
    endpoints: Any = types.SimpleNamespace(runtime=runtime, web=web)
    inner: Any = types.SimpleNamespace(web=False, route=lambda method, path: None)
    return RecordingsRoutes(endpoints, inner)


async def post(r: RecordingsRoutes, path: str, body: Any) -> tuple[int, Any]:
    handler = r.route("POST", path)
    assert handler is not None
    answer = await handler(msgspec.json.encode(body))
    return answer.status, msgspec.json.decode(answer.body)


async def test_long_texts_are_cut_in_the_list_and_bad_shards_skipped(tmp_path: Path) -> None:
    """A client's 1 MB episode id and an env's 1 MB error come back cut in the list (200 of
    them made a 400 MB answer); a shard of another schema beside ours (``started_at`` a
    string) is left out, not a 500 for the whole list."""
    write(tmp_path, [episode(1, episode_id="<script>" + "i" * 1_000_000, error="E" * 1_000_000)])
    other = pa.table({name: ["x"] for name in recordings.SUMMARY})
    pq.write_table(other, tmp_path / "episodes-x-1-1700000000001-1.parquet")
    status, listed = await post(routes(tmp_path), "/web/episodes", {})
    assert status == 200, listed
    assert listed["total"] == 1
    (ep,) = listed["episodes"]
    assert len(ep["episode_id"]) == recordings.LIST_TEXT_MAX
    assert len(ep["error"]) == recordings.LIST_TEXT_MAX
    status, opened = await post(routes(tmp_path), "/web/episodes/one", {"file": SHARD, "row": 0})
    assert status == 200
    assert len(opened["episode_id"]) < recordings.TEXT_MAX + 100  # cut, and says so
    assert opened["episode_id"].endswith("more characters)")


async def test_the_newest_shards_are_the_last_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shards browsed are the ones written last, whichever worker wrote them: a worker
    started later (a greater start in its names) was taken as newer in all its shards, so
    a long-running worker's recent episodes fell out of the newest ``FILES_MAX``."""
    monkeypatch.setattr(recordings, "FILES_MAX", 2)
    old = [write(tmp_path, [episode(i)], f"episodes-walker-200-2000-{i}.parquet") for i in (1, 2)]
    for i, path in enumerate(old):
        os.utime(path, (1_000_000 + i, 1_000_000 + i))
    write(tmp_path, [episode(3, episode_id="recent")], "episodes-walker-100-1000-900.parquet")
    status, listed = await post(routes(tmp_path), "/web/episodes", {})
    assert status == 200
    assert "recent" in [ep["episode_id"] for ep in listed["episodes"]]


async def test_reads_are_bounded_before_they_are_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shard whose episodes would pass ``ROWS_MAX`` is not read (it was read whole, and
    kept, past the bound); an episode in a row group over ``GROUP_BYTES_MAX`` uncompressed
    (by the footer) is ``413``, not read (a copied shard's million-row group was)."""
    monkeypatch.setattr(recordings, "ROWS_MAX", 5)
    big = write(tmp_path, [episode(i) for i in range(10)], "episodes-walker-1-1-1.parquet")
    os.utime(big, (1_000_000, 1_000_000))
    write(tmp_path, [episode(i) for i in range(3)], "episodes-walker-1-1-2.parquet")
    r = routes(tmp_path)
    status, listed = await post(r, "/web/episodes", {})
    assert (status, listed["total"]) == (200, 3)
    monkeypatch.setattr(recordings, "GROUP_BYTES_MAX", 1000)
    status, answer = await post(r, "/web/episodes/one", {"file": big.name, "row": 0})
    assert (status, answer["code"]) == (413, "TOO_LARGE")


async def test_filters_of_the_wrong_type_are_refused(tmp_path: Path) -> None:
    """A filter of another type is 422 (it was ignored: every episode matched), and so are
    a 400-digit bound (``float()`` overflowed: a 500), a body whose strings are not UTF-8
    and one nested 100,000 deep (msgspec raises UnicodeDecodeError, RecursionError: 500s)."""
    write(tmp_path, [episode(1), episode(2, error="E: x")])
    r = routes(tmp_path)
    for path in ("/web/episodes", "/web/episodes/one"):
        handler = r.route("POST", path)
        assert handler is not None
        for body in (b'{"file": "\xff\xfe", "env": "\xff"}', b"[" * 100_000):
            assert (await handler(body)).status == 422
    for bad in ({"env": ["walker"]}, {"min_reward": "1"}, {"error": "yes"}, {"max_cpu_s": 10**400}):
        status, answer = await post(r, "/web/episodes", bad)
        assert status == 422, (bad, answer)
    status, answer = await post(r, "/web/episodes", {"error": True, "min_reward": 1.5})
    assert (status, answer["total"]) == (200, 1)
    assert [len(answer["costs"]["walker"][k]) for k in ("cpu_s", "wall_s")] == [1, 1]


async def test_reads_take_one_executor_thread_and_a_bounded_queue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests for episodes are read one at a time: a burst of them does not take every
    thread of the loop's executor (where a sandbox's replies are decoded), and past
    ``WAITING_MAX`` waiting they are answered 503 at once."""
    write(tmp_path, [episode(1)])
    release = threading.Event()
    inside = [0, 0]  # now, most

    def slow_one(self: RecordingIndex, *args: Any) -> dict[str, Any] | None:
        inside[0] += 1
        inside[1] = max(inside)
        release.wait(10 * UNIT)
        inside[0] -= 1
        return None

    monkeypatch.setattr(RecordingIndex, "one", slow_one)
    r = routes(tmp_path)
    body = {"file": SHARD, "row": 0}
    burst = [asyncio.create_task(post(r, "/web/episodes/one", body)) for _ in range(12)]
    await asyncio.sleep(0.1 * UNIT)
    loop = asyncio.get_running_loop()
    try:  # the executor still runs other work meanwhile
        assert await asyncio.wait_for(loop.run_in_executor(None, lambda: 7), 5 * UNIT) == 7
    finally:
        release.set()
    statuses = sorted(status for status, _ in await asyncio.gather(*burst))
    assert inside[1] == 1
    assert statuses.count(503) == 12 - recordings.WAITING_MAX
    assert statuses.count(404) == recordings.WAITING_MAX


def test_the_json_endpoints_follow_the_web_switch(tmp_path: Path) -> None:
    """``ENABLE_WEB_INTERFACE=false`` turns the recordings' JSON endpoints off with the
    page (they answered every recorded observation with the page off)."""
    assert routes(tmp_path, web=False).route("POST", "/web/episodes") is None
    assert routes(tmp_path, web=False).route("POST", "/web/episodes/one") is None
    assert routes(tmp_path, web=True).route("POST", "/web/episodes") is not None


# -- stadium replay / check --actions-from --------------------------------------------------


def replayed(*args: str) -> Any:
    return CliRunner().invoke(cli, ["replay", *args])


def test_escape_sequences_in_a_recording_do_not_reach_the_terminal(tmp_path: Path) -> None:
    """A client's episode id and an env's version holding terminal escapes (OSC 52 writes
    the operator's clipboard; ``\\r`` and CSI rewrite lines) are printed escaped."""
    osc52, clear = "\x1b]52;c;Y3VybCBldmlsLnNoIHwgc2g=\x07", "\x1b[2J\r"
    write(tmp_path, [episode(1, episode_id=f"ep{osc52}", env_version=f"1{clear}")])
    result = replayed(str(tmp_path), "tests.test_ledger:SeedIgnoring")
    assert result.exit_code == 1, result.output
    assert "DIVERGED" in result.output
    for control in ("\x1b", "\r", "\x07"):
        assert control not in result.output
    assert "ep\\x1b]52;c;" in result.output


def test_a_shard_of_another_schema_is_a_clear_error(tmp_path: Path) -> None:
    """A Parquet file in the directory that is not ours (a column missing, a column of
    another type, step lists of different lengths, an action that is not JSON): exit 2
    with one line saying which, no traceback."""
    cases = {
        "missing": lambda rows: pa.Table.from_pylist(rows, schema=schema(pa)).drop_columns(
            ["observations"]
        ),
        "typed": lambda rows: pa.Table.from_pylist(
            [{**r, "seed": str(r["seed"])} for r in rows],
            schema=schema(pa).set(5, pa.field("seed", pa.string())),
        ),
        "lengths": lambda rows: pa.Table.from_pylist(
            [{**r, "observations": r["observations"][:1]} for r in rows], schema=schema(pa)
        ),
        "json": lambda rows: pa.Table.from_pylist(
            [{**r, "reset_observation": "{not json\x1b[2J"} for r in rows], schema=schema(pa)
        ),
    }
    expected = {
        "missing": "no column 'observations'",
        "typed": "has string in column 'seed'",
        "lengths": "step lists of different lengths",
        "json": "not JSON",
    }
    for case, make in cases.items():
        directory = tmp_path / case
        directory.mkdir()
        pq.write_table(make([episode(1, steps=3)]), directory / SHARD)
        result = replayed(str(directory), "tests.test_ledger:Walker")
        # a ConfigError: `stadium` prints its one line and exits 2 (main)
        assert isinstance(result.exception, ConfigError), (case, result.exception)
        assert expected[case] in str(result.exception), (case, result.exception)
        assert "\x1b" not in str(result.exception)
        checked = CliRunner().invoke(
            cli, ["check", "tests.test_ledger:Walker", "--actions-from", str(directory)]
        )
        if case != "json":  # actions alone: the reset's observation is not read
            assert isinstance(checked.exception, ConfigError), (case, checked.exception)


def test_an_error_line_is_printed_escaped(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An error whose text another party chose (a ``--url`` server's error reply) cannot
    act on the terminal through ``error: ...``."""

    def hostile(*args: Any, **kwargs: Any) -> Any:
        raise StadiumError("the server said \x1b]52;c;ZXZpbA==\x07 no")

    monkeypatch.setattr("stadium._cli.replay.replay", hostile)
    with pytest.raises(SystemExit):
        main(["replay", str(tmp_path), "--url", "ws://127.0.0.1:9"])
    err = capsys.readouterr().err
    assert "\\x1b]52;c;ZXZpbA==\\x07 no" in err
    assert "\x1b" not in err


class ResetRaises(Walker):
    """Its reset raises for every seed (the recorded one did not)."""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        raise RuntimeError("no reset today")


def test_a_reset_that_raises_or_options_not_an_object_are_reported(tmp_path: Path) -> None:
    """A replayed reset that raises is the episode's divergence (it was a traceback that
    ended the replay); recorded options that are not a JSON object are a ConfigError."""
    write(tmp_path, [episode(1)])
    report = replay(str(tmp_path), "tests.test_recordings_hostile:ResetRaises")
    ((step, field, replayed_error),) = [(d.step, d.field, d.replayed) for d in report.divergences]
    assert (step, field) == (0, "error")
    assert replayed_error == "RuntimeError: no reset today"
    listed = tmp_path / "listed"
    listed.mkdir()
    write(listed, [episode(1, options="[1, 2]")])
    with pytest.raises(ConfigError, match="options are not a JSON object"):
        replay(str(listed), "tests.test_ledger:Walker")


def test_replay_reads_a_few_episodes_at_a_time(tmp_path: Path) -> None:
    """16 shards of a 20,000-step episode each: replay holds a few of them as Python
    values at a time, not all (it read every shard whole first: 16 x 7 MB here; a
    recording larger than memory could not be replayed)."""
    for i in range(16):
        write(tmp_path, [episode(i, steps=20_000)], f"episodes-walker-100-17-{i}.parquet")
    report, peak = python_bytes(replay, str(tmp_path), "tests.test_ledger:Walker")
    assert report.total == 16
    assert len(report.divergences) == 16  # the recorded reset is not the Walker's
    assert peak < 40 << 20, f"{peak / 2**20:.0f} MiB of Python objects"


RESET_OK = json.dumps({"type": "observation", "data": {"observation": {"t": 0}, "done": False}})


@contextlib.asynccontextmanager
async def hostile_server(step_reply: str | None, reset_reply: str = RESET_OK) -> Any:
    """A WebSocket server on port 0 answering a reset with ``reset_reply`` and every step
    with ``step_reply`` (``None``: never); a ``close`` closes."""

    async def handler(ws: Any) -> None:
        with contextlib.suppress(websockets.ConnectionClosed):
            async for message in ws:
                kind = json.loads(message)["type"]
                if kind == "close":
                    await ws.close()
                    return
                reply = reset_reply if kind == "reset" else step_reply
                if reply is not None:
                    await ws.send(reply)

    async with websockets.serve(handler, "127.0.0.1", 0) as server:
        yield f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def test_a_hostile_url_server(tmp_path: Path) -> None:
    """``replay --url`` against a server that answers what it likes: an error reply whose
    text holds an OSC 52 sequence is a divergence printed escaped (it was raised, and
    printed raw on the `error:` line); a frame that cannot be read, or none within
    ``--timeout``, ends the replay with a StadiumError (the server failed, not the env;
    a silent server held each reply 600 s with no option to shorten it)."""
    write(tmp_path, [episode(1)])
    osc52 = {"message": "\x1b]52;c;ZXZpbA==\x07 no", "code": "EXECUTION_ERROR"}
    error = json.dumps({"type": "error", "data": osc52})
    async with hostile_server(error, reset_reply=error) as url:
        result = await asyncio.to_thread(replayed, str(tmp_path), "--url", url)
    assert result.exit_code == 1, (result.output, result.exception)
    assert "error at reset" in result.output
    assert "\\u001b]52;c;ZXZpbA==\\u0007 no" in result.output
    assert "\x1b" not in result.output
    async with hostile_server("\x1b[2J{not json") as url:
        with pytest.raises(StadiumError, match="cannot be read"):
            await asyncio.to_thread(replay, str(tmp_path), url=url)
    async with hostile_server(None) as url:
        with pytest.raises(StadiumError, match="no reply within"):
            await asyncio.wait_for(
                asyncio.to_thread(replay, str(tmp_path), url=url, timeout=0.5 * UNIT), 20 * UNIT
            )


@pytest.mark.slow  # a recording server (and its writer process)
async def test_a_clients_episode_id_reaches_replay_escaped(tmp_path: Path) -> None:
    """End to end: a client of a recording server names its episode with an OSC 52
    sequence (and markup); ``stadium replay`` of a diverging env prints it escaped."""
    from stadium import AsyncClient
    from tests.conftest import serve
    from tests.test_ledger import _recorded

    hostile = '\x1b]52;c;ZXZpbA==\x07"><img src=x onerror=alert(1)>'
    async with serve(Walker, record=str(tmp_path)) as server:
        async with AsyncClient(server.url) as env:
            await env.reset(seed=1, episode_id=hostile)
            await env.step({"n": 0.5})
        await _recorded(tmp_path, 1)
    result = await asyncio.to_thread(replayed, str(tmp_path), "tests.test_ledger:SeedIgnoring")
    assert result.exit_code == 1, (result.output, result.exception)
    assert '\\x1b]52;c;ZXZpbA==\\x07"><img' in result.output
    assert "\x1b" not in result.output
