"""The recording's step buffer (``ledger/buffer.py``): the native one and the Python one do
the same, byte for byte, call for call; the recorder's stream is the same with either."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from typing import Any

import pytest

from stadium._env.cost import EpisodeCost
from stadium._server.ledger import buffer, pipe
from stadium._server.ledger import record as record_module
from stadium._server.ledger.buffer import PyStepBuffer, StepBufferType
from tests.test_record_writers import _episodes

_F_SETPIPE_SZ = 1031
_COST = EpisodeCost(wall_s=0.5, cpu_s=0.25, steps=3, bytes_in=10, bytes_out=20)


def _native() -> Callable[[int, buffer.Slow], StepBufferType]:
    made = buffer.native()
    assert made is not None, "the native step buffer is missing: `make record-deps` builds it"
    assert buffer.StepBuffer is made
    assert buffer.NATIVE
    return made


KINDS = ("native", "python")


def _make(kind: str) -> Callable[[int, buffer.Slow], StepBufferType]:
    return _native() if kind == "native" else PyStepBuffer


def _script(kind: str) -> tuple[bytes, list[tuple[Any, ...]], list[str]]:
    """One sequence of calls on a buffer of ``kind``: what it holds, what reached ``slow``,
    what each odd call raised."""
    slow_calls: list[tuple[Any, ...]] = []
    raised: list[str] = []
    buf = _make(kind)(0, lambda *a: slow_calls.append(a))
    req, rep = b'{"type":"step","data":{"a":1}}', b'{"type":"observation","data":{}}'
    buf.step(1, req, rep, 0.5)  # room 0: slow
    buf.room = 1000
    buf.step(2, req, rep, 0.25)  # the usual case
    buf.step((1 << 32) - 1, b"", b"", -0.0)
    buf.step(3, req.decode(), rep, 0.1)  # a text request: slow
    buf.step(4, req, "E: text", 0.1)  # a failed step's text: slow
    buf += b"\x00raw"
    buf.step(5, b"x" * 400, b"y" * 500, 1e300)  # with what is buffered, past the room: slow
    buf.step(6, b"x" * 100, b"y" * 100, 2.0)
    for bad in ("text", 1, None):
        try:
            buf += bad  # type: ignore[operator]
        except TypeError:
            raised.append(f"+= {type(bad).__name__}")
    return bytes(buf), slow_calls, raised


def test_both_buffers_hold_the_same_bytes_and_call_slow_alike() -> None:
    native, python = _script("native"), _script("python")
    assert native[0] == python[0]
    assert native[1] == python[1]
    assert len(python[1]) == 4  # room 0, text request, failed step, past the room
    head = pipe.HEAD.unpack_from(native[0])
    assert head == (pipe.STEP, 2, 0, 0.25, 30, 32)
    assert native[2] == python[2] == ["+= str", "+= int", "+= NoneType"]


@pytest.mark.parametrize("kind", KINDS)
def test_write_drops_what_the_pipe_took_and_keeps_the_rest(kind: str) -> None:
    """A pipe that takes part of the buffer: what it took is dropped, the rest kept in order;
    a full pipe raises BlockingIOError; a closed descriptor the OSError it is."""
    r, w = os.pipe()
    try:
        os.set_blocking(w, False)
        size = fcntl.fcntl(w, _F_SETPIPE_SZ, 4096)
        buf = _make(kind)(1 << 20, lambda *a: None)
        data = bytes(range(256)) * ((size + 3000) // 256 + 1)
        buf += data
        assert buf.write(w) == size
        assert bytes(buf) == data[size:]
        with pytest.raises(BlockingIOError):
            buf.write(w)
        assert os.read(r, size * 2) == data[:size]
        assert buf.write(w) == len(data) - size
        assert len(buf) == 0
        assert buf.write(w) == 0
        buf += b"x"
        os.close(r)
        r = -1
        with pytest.raises(BrokenPipeError):
            buf.write(w)
        buf.clear()
        assert not buf
    finally:
        for fd in (r, w):
            if fd >= 0:
                os.close(fd)


@pytest.fixture
def fixed_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(record_module.time, "time", lambda: 1234.5)


def _stream(kind: str, monkeypatch: pytest.MonkeyPatch) -> bytes:
    monkeypatch.setattr(record_module, "StepBuffer", _make(kind))
    rec = record_module.Recorder(
        record_module.RecordConfig(directory="/nonexistent", queue_bytes=4096),
        ("walker", "1"),
        "metadata",
        [0.0] * 4,
    )
    rec.state = record_module.RecorderState.RECORDING  # no writer: the buffer is read
    rec._timer = object()  # type: ignore[assignment]  # a flush due: the usual case open
    rec._open()
    began = 0
    for name, json, reset, steps, end in _episodes():
        rid = rec.begin(name, 1, None, reset, json)
        if rid is None:  # the buffer is full: dropped
            continue
        began += 1
        for request, reply in steps * 3:  # some past the queue's bound: the episode broken
            if isinstance(reply, str):
                rec.step_failed(rid, request, reply, 0.001)
            else:
                rec.step(rid, request, reply, 0.001)
        rec.end(rid, end, None if name == "empty" else _COST, False)
    assert began >= 2
    return bytes(rec._buf)


@pytest.mark.usefixtures("fixed_time")
def test_the_recorders_stream_is_the_same_with_either_buffer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    native = _stream("native", monkeypatch)
    python = _stream("python", monkeypatch)
    assert native == python
    assert 3000 < len(native) <= 4096 + 200  # bounded: episodes broken past it
