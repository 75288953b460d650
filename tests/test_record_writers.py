"""The two ``--record`` writers (native and Python, ``ledger/writers.py``) on the same stream:
equal tables, the filter, the shard rotation, a malformed stream."""

from __future__ import annotations

import os
import struct
import subprocess
import time
from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stadium._env.cost import EpisodeCost
from stadium._server.ledger import pipe, writers
from stadium._server.ledger import record as record_module
from stadium._server.ledger.episode import EndReason
from tests.conftest import UNIT


def _native_built() -> None:
    assert os.access(writers.NATIVE, os.X_OK), (
        f"{writers.NATIVE} is missing: `make record-deps` builds it"
    )


def _json_reply(data: Any) -> bytes:
    return msgspec.json.encode({"type": "observation", "data": data})


def _mp_reply(data: Any) -> bytes:
    return msgspec.msgpack.encode({"type": "observation", "data": data})


def _episodes() -> list[tuple[str, bool, bytes, list[tuple[bytes, bytes | str]], EndReason]]:
    """Episodes with odd values: each (id, json, reset frame, steps, end)."""
    j = _json_reply
    odd_json = [
        (b'{"type":"step","data":{"a":1}}', j({"observation": [1, 2.5, "x"], "reward": 1,
                                               "done": False, "metadata": {"k": "v"}})),
        (b'{"type":"step","data": [ 1 , 2 ] }',
         b'{"type":"observation","data":{"observation": {"s":"\\u00e9\\n\\"q\\"", "f": 1e-7,'
         b' "g": 1E16, "h": -0, "big": 123456789012345678901234567890},'
         b' "reward": 0.1, "done": false, "truncated": false}}'),
        (b'{"type":"step"}', j({"observation": None, "reward": True, "done": False})),
        (b'{"type":"step","data":null}', j({"reward": "x", "metadata": None})),
        (b'{"type":"step","data":"s"}', j({"observation": 1.5e300, "reward": float("nan")})),
        (b'{"data":{"b":[]}}', j({"observation": {}, "reward": -2.5e-6, "done": True})),
    ]  # fmt: skip
    failed = [
        (b'{"type":"step","data":{"a":1}}', j({"observation": 1, "reward": 2.0})),
        (b'{"type":"step","data":{"a":"\\u00e9  x"}}', "ENV_ERROR: it broke \u00e9"),
        (b'{"type":"step","data":{"a":3}}', j({"observation": {"x": [1.0, 2]}, "reward": 1,
                                               "metadata": {"m": 1}, "done": True})),
    ]  # fmt: skip
    not_bool = [  # the usual path refuses "done": 1 (a typed bool): the plain path then
        (b'{"type":"step","data":{"a":1}}', j({"observation": [1, 2], "reward": 1, "done": 1})),
    ]
    m = _mp_reply
    mp = [
        (msgspec.msgpack.encode({"type": "step", "data": {"a": b"\x00\xff", "i": 7}}),
         m({"observation": {"bin": b"abc", "ext": msgspec.msgpack.Ext(1, b"xy"),
                            "f": 0.5, "n": None, 3: "int key"},
            "reward": 2, "done": False, "metadata": {"t": [1, 2]}})),
        (msgspec.msgpack.encode({"type": "step"}), m({"observation": None, "reward": 1.25})),
        (msgspec.msgpack.encode({"type": "step", "data": None}),
         m({"observation": "s\u00e9", "reward": None, "truncated": True, "metadata": None})),
    ]  # fmt: skip
    mp_failed = [
        (msgspec.msgpack.encode({"type": "step", "data": [1]}), m({"observation": 1})),
        (msgspec.msgpack.encode({"type": "step", "data": [2]}), "BAD: no"),
    ]
    plain = [(b'{"type":"step","data":{"a":%d}}' % i, j({"observation": {"step": i},
              "reward": 1.0, "done": i == 4, "metadata": {}})) for i in range(5)]  # fmt: skip
    # a request the same as the step before's is not scanned again by the native writer
    same, other = b'{"type":"step","data": { "w" : [0.0, "a"] } }', b"{}"
    s, t = b'{"data":"s"}', b'{"d":"ssss"}'  # the same length
    repeats: list[tuple[bytes, bytes | str]] = [
        (r, j({"observation": {"step": i}, "reward": 0.5, "done": False}))
        for i, r in enumerate([same, same, other, same, s, s, t, s])
    ]
    mp_same = msgspec.msgpack.encode({"type": "step", "data": {"a": [1, None]}})
    mp_other = msgspec.msgpack.encode({})
    mp_repeats: list[tuple[bytes, bytes | str]] = [
        (r, m({"observation": i, "reward": 1}))
        for i, r in enumerate([mp_same, mp_same, mp_other, mp_same])
    ]
    reset_j = j({"observation": {"start": 1}, "metadata": {"seed": 3}})
    reset_m = m({"observation": [1, 2], "metadata": None})
    return [
        ("plain", True, reset_j, plain, EndReason.DONE),
        ("odd-json", True, reset_j, odd_json, EndReason.TRUNCATED),
        ("failed", True, j({"metadata": {}}), failed, EndReason.DONE),
        ("not-bool", True, reset_j, not_bool, EndReason.RESET),
        ("msgpack", False, reset_m, mp, EndReason.CLOSED),
        ("msgpack-failed", False, reset_m, mp_failed, EndReason.DONE),
        ("empty", True, reset_j, [], EndReason.CLOSED),
        ("repeats", True, reset_j, repeats, EndReason.DONE),
        ("msgpack-repeats", False, reset_m, mp_repeats, EndReason.TRUNCATED),
    ]


def _record(
    directory: Path, writer: str, monkeypatch: pytest.MonkeyPatch, only: str = "", **config: Any
) -> tuple[pa.Table, list[float], Any]:
    monkeypatch.setenv(writers.CHOICE_ENV, writer)
    counts = [0.0] * 4
    rec = record_module.Recorder(
        record_module.RecordConfig(directory=str(directory), **config),
        ("walker", "1.0"),
        "metadata",
        counts,
    )
    rec.start()
    proc = rec._proc
    assert proc is not None
    for n, (name, json, reset, steps, end) in enumerate(_episodes()):
        if (name == "not-bool") != (only == "not-bool"):
            continue  # (test_both_writers_write_equal_tables' doc)
        options = {"level": n, "name": name} if n % 2 else None
        rid = rec.begin(name, n if n % 3 else None, options, reset, json)
        assert rid is not None
        for k, (request, reply) in enumerate(steps):
            if isinstance(reply, str):  # a failed step: the error's text
                rec.step_failed(rid, request, reply, 0.001 * (k + 1))
            else:
                rec.step(rid, request, reply, 0.001 * (k + 1))
        cost = EpisodeCost(wall_s=0.5 + n, cpu_s=0.25, steps=len(steps), bytes_in=10 * n,
                           bytes_out=20, peak_rss_bytes=None if n % 2 else 1 << 20,
                           cpu_source="loop")  # fmt: skip
        rec.end(rid, end, cost, clipped=name == "plain")
    # one episode the loop dropped (its end says so), one never ended
    rid = rec.begin("dropped", 1, None, _json_reply({}), True)
    assert rid is not None
    rec.end(rid, EndReason.DONE, None, False)
    rec.begin("running", 1, None, _json_reply({}), True)
    rec.close()
    paths = sorted(directory.glob("*.parquet"))
    table = pq.read_table(paths) if paths else pq.read_table(directory)
    return table.sort_by("episode_id"), counts, proc.args


@pytest.mark.parametrize(
    ("filter_", "only"),
    [("", ""), ("reward>2 or error", ""), ("not done and steps>=1", ""), ("", "not-bool")],
)
def test_both_writers_write_equal_tables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, filter_: str, only: str
) -> None:
    """Value for value. ("not-bool" on its own: the Python writer sends every episode of a
    batch that holds one its typed decoder refuses down its plain path, and a batch is what
    ended between two of its wake-ups; the native writer decides per episode.)"""
    _native_built()
    native, n_counts, n_args = _record(tmp_path / "n", "native", monkeypatch, only, filter=filter_)
    python, p_counts, p_args = _record(tmp_path / "p", "python", monkeypatch, only, filter=filter_)
    assert n_args[0] == str(writers.NATIVE)
    assert "stadium._server.ledger.writer" in p_args
    assert native.schema.equals(python.schema), (native.schema, python.schema)
    mine = native.drop_columns(["worker", "started_at"]).to_pylist()
    theirs = python.drop_columns(["worker", "started_at"]).to_pylist()
    for a, b in zip(mine, theirs, strict=True):
        for key in a:
            assert msgspec.json.encode(a[key]) == msgspec.json.encode(b[key]), (
                a["episode_id"], key, a[key], b[key],
            )  # fmt: skip
    assert len(mine) == len(theirs)
    assert n_counts[record_module.RECORDED] == p_counts[record_module.RECORDED] == len(mine)
    assert n_counts[record_module.DROPPED] == p_counts[record_module.DROPPED] >= 1
    if not filter_:
        assert len(mine) == (1 if only else len(_episodes()) - 1)


def test_the_native_writer_rotates_shards_by_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _native_built()
    table, counts, _ = _record(tmp_path, "native", monkeypatch, shard_bytes=50)
    shards = sorted(tmp_path.glob("*.parquet"))
    assert len(shards) > 1, "a shard is closed once its frames reach shard_bytes"
    assert not list(tmp_path.glob("*.tmp"))
    assert all(p.name.startswith("episodes-walker-") for p in shards)
    assert [p.name[-15:] for p in shards][:2] == ["-000001.parquet", "-000002.parquet"]
    assert table.num_rows == counts[record_module.RECORDED] == len(_episodes()) - 1


def _malformed(tmp_path: Path, stream: bytes) -> tuple[int, str]:
    settings = {
        "config": {"directory": str(tmp_path), "sample": 1.0, "filter": "", "redact": "",
                   "flush_s": 1.0, "shard_bytes": 1 << 26, "queue_bytes": 1 << 20,
                   "episode_bytes": 1 << 20},
        "env": "walker", "version": "1", "info_key": "metadata", "worker": os.getpid(),
        "stem": "episodes-walker-1-2",
    }  # fmt: skip
    read_fd, write_fd = os.pipe()
    memfd = os.memfd_create("counts")
    os.ftruncate(memfd, 32)
    command = writers.writer_command(read_fd, memfd, settings)
    assert command[0] == str(writers.NATIVE)
    proc = subprocess.Popen(
        command, pass_fds=(read_fd, memfd), stderr=subprocess.PIPE, stdin=subprocess.DEVNULL
    )
    os.close(read_fd)
    os.close(memfd)
    try:
        os.write(write_fd, stream)
        _, err = proc.communicate(timeout=10 * UNIT)
    finally:
        os.close(write_fd)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err.decode()


def test_the_native_writer_ends_clearly_on_a_malformed_stream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream that cannot be the worker's: a length past every bound, an unknown kind.
    The writer writes what it holds, says why, exits 2 (no hang, no crash)."""
    _native_built()
    monkeypatch.setenv(writers.CHOICE_ENV, "native")
    reply = _json_reply({"observation": 1, "reward": 1.0})
    meta = msgspec.msgpack.encode(("e1", 1, None))
    cost = msgspec.msgpack.encode(EpisodeCost(wall_s=1.0, cpu_s=0.0, steps=1))
    good = (
        pipe.HEAD.pack(pipe.BEGIN, 1, 1, time.time(), len(meta), len(reply)) + meta + reply
        + pipe.HEAD.pack(pipe.STEP, 1, 0, 0.1, 2, len(reply)) + b"{}" + reply
        + pipe.HEAD.pack(pipe.END, 1, 0, 0.0, len(cost), 0) + cost
    )  # fmt: skip
    huge = pipe.HEAD.pack(pipe.STEP, 1, 0, 0.1, 0xFFFFFFFF, 0xFFFFFFFF)
    status, err = _malformed(tmp_path / "a", good + huge)
    assert status == 2, err
    assert "malformed" in err, err
    assert len(pq.read_table(tmp_path / "a").to_pylist()) == 1  # what it held is written
    unknown = struct.pack("<BIBdII", 9, 1, 0, 0.0, 0, 0)
    status, err = _malformed(tmp_path / "b", unknown)
    assert status == 2, err
    assert "unknown kind" in err, err
    bad_end = pipe.HEAD.pack(pipe.END, 1, 7, 0.0, 0, 0)
    status, err = _malformed(tmp_path / "c", bad_end)
    assert status == 2, err
    assert "malformed" in err, err


def test_without_the_native_binary_the_python_writer_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(writers, "NATIVE", tmp_path / "missing")
    monkeypatch.setattr(writers, "_said", False)
    monkeypatch.delenv(writers.CHOICE_ENV, raising=False)
    settings: dict[str, Any] = {"config": {"redact": ""}}
    with caplog.at_level("WARNING", logger="stadium.record"):
        first = writers.writer_command(3, 4, settings)
        second = writers.writer_command(3, 4, settings)
    assert first[1:3] == ["-m", "stadium._server.ledger.writer"] == second[1:3]
    said = [r for r in caplog.records if "native writer" in r.getMessage()]
    assert len(said) == 1, "said once"
    monkeypatch.setattr(writers, "NATIVE", Path("/bin/true"))
    assert writers.writer_command(3, 4, settings)[0] == "/bin/true"
    redact: dict[str, Any] = {"config": {"redact": "mod:fn"}}
    assert writers.writer_command(3, 4, redact)[1:3] == ["-m", "stadium._server.ledger.writer"]
