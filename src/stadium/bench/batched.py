"""Batched sessions: B sessions on one WebSocket connection, stepped with one frame per round.

The load of a point whose :attr:`~stadium.bench.loadspec.LoadSpec.batch` is
B > 0 (``stadium bench ramp --batch B``, or an arm ``stadium+batchB``). It
speaks docs/PROTOCOL.md, *Batches: many sessions on one connection*: the
connection offers the subprotocol ``stadium.batch`` (JSON frames) and fails as
``protocol`` when the server does not pick it (the floor and OpenEnv have no
batches). Each connection carries B sessions, numbered 0 … B−1:

* connect (TCP and handshake) — every session of the connection gets its time;
* one batch frame of B ``reset`` calls; a session whose entry is an error
  (``CAPACITY_REACHED``: ``capacity``) fails alone, the others go on;
* ``steps`` rounds: think, then one batch frame of a ``step`` call per live
  session; the round's latency (frame sent → reply) is each session's step
  latency, so steps are counted as in one-frame mode (one per session per round);
* close: the WebSocket close frame, which ends every session of the connection.

A batch frame is the core's :class:`~stadium._core.frames.BatchFrame` of
:class:`~stadium._core.frames.BatchCall` calls (what Stadium's own batch client sends), encoded
once per set of live sessions. Each session still gets its own
:class:`~stadium.bench.results.SessionResult`, so a batched point is summarised exactly as a
one-frame point is.
:func:`run_batch_sessions` is :func:`~stadium.bench.sessions.run_sessions` for
batched loads; the worker processes of :mod:`stadium.bench.loadgen` call it.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from stadium._core.frames import BatchCall, BatchFrame
from stadium.bench.loadspec import LoadSpec
from stadium.bench.results import SessionResult
from stadium.bench.sessions import (
    Fail,
    _classify_oserror,
    _observe,
    until_deadline,
    ws_connection_class,
)
from stadium.bench.stats import ErrorKind

SUBPROTOCOL = "stadium.batch"
"""The subprotocol a batched connection offers (JSON frames)."""


class _BatchResult(msgspec.Struct):
    """One entry of a batch reply: its type, and its data left undecoded."""

    type: str
    data: msgspec.Raw = msgspec.Raw()


class _Reply(msgspec.Struct):
    """A frame from the server on a batch connection: a batch reply or an error."""

    type: str
    id: int | str | None = None
    results: list[_BatchResult] = msgspec.field(default_factory=list)
    data: msgspec.Raw = msgspec.Raw()


_REPLY = msgspec.json.Decoder(_Reply)
_DATA = msgspec.json.Decoder()


def batch_body(kind: str, sessions: Sequence[int], data: dict[str, Any]) -> bytes:
    """A batch frame of one ``kind`` call (``reset``, ``step``) with ``data`` per session."""
    calls = [BatchCall(kind, data, session=s) for s in sessions]
    return msgspec.json.encode(BatchFrame("batch", kind, calls))


def _entry_failure(result: _BatchResult) -> Fail | None:
    """``None`` for an observation; else why that session failed."""
    if result.type == "observation":
        return None
    data = _DATA.decode(result.data) if result.data else None
    data = data if isinstance(data, dict) else {}
    if result.type == "error":
        code = str(data.get("code", ""))
        text = f"{code}: {data.get('message', '')}"[:200]
        kind = ErrorKind.CAPACITY if code == "CAPACITY_REACHED" else ErrorKind.PROTOCOL
        return Fail(kind, text)
    if result.type == "closed":
        return Fail(ErrorKind.DISCONNECTED, f"session closed ({data.get('code')}): "
                    f"{data.get('reason', '')}"[:200])  # fmt: skip
    return Fail(ErrorKind.PROTOCOL, f"unexpected entry type {result.type!r}")


def _check_reply(payload: bytes, calls: int) -> list[_BatchResult]:
    """The ``calls`` entries of a batch reply, or raise :class:`Fail` (every session fails)."""
    try:
        reply = _REPLY.decode(payload)
    except msgspec.DecodeError as exc:
        raise Fail(ErrorKind.PROTOCOL, f"batch reply unreadable: {exc}"[:200]) from None
    if reply.type == "error":
        data = _DATA.decode(reply.data) if reply.data else {}
        raise Fail(ErrorKind.PROTOCOL, f"batch refused: {data}"[:200])
    if reply.type != "batch" or len(reply.results) != calls:
        raise Fail(
            ErrorKind.PROTOCOL,
            f"expected a batch of {calls} results, got {reply.type!r} with {len(reply.results)}",
        )
    return reply.results


@functools.cache
def batch_connection_class() -> type[Any]:
    """The batched connection class, ``cls(url, source)``: the load generator's WebSocket
    connection (:func:`~stadium.bench.sessions.ws_connection_class`) offering the batch
    subprotocol, one outstanding batch at a time, the reply resolving its future."""
    import picows

    text = picows.WSMsgType.TEXT

    class BatchConnection(ws_connection_class()):  # type: ignore[misc]
        subprotocol = SUBPROTOCOL

        async def connect(self, limit: float) -> None:
            await super().connect(limit)
            picked = self.transport.response.headers.get("Sec-WebSocket-Protocol")
            if picked != SUBPROTOCOL:
                raise Fail(
                    ErrorKind.PROTOCOL,
                    f"the server did not pick the {SUBPROTOCOL} subprotocol "
                    f"(picked {picked!r}): it has no batches",
                )

        async def request(self, body: bytes, calls: int, limit: float) -> list[_BatchResult]:
            """Send one batch frame of ``calls`` calls; its entries, in call order."""
            if self.disconnected:
                raise self._gone()
            self.transport.send(text, body)
            if self.inbox:
                return _check_reply(self.inbox.popleft(), calls)
            w = self.loop.create_future()
            self.waiter = w
            handle = self.loop.call_later(limit, _expire, w)
            try:
                payload = await w
            finally:
                handle.cancel()
                self.waiter = None
            return _check_reply(payload, calls)

    return BatchConnection


def _expire(waiter: asyncio.Future[bytes]) -> None:
    if not waiter.done():
        waiter.set_exception(Fail(ErrorKind.TIMEOUT, "batch reply timed out"))


def _fail(recs: Sequence[SessionResult], exc: BaseException) -> None:
    """Record ``exc`` as the failure of every session in ``recs``."""
    if isinstance(exc, Fail):
        kind, detail = exc.kind.value, exc.detail
    elif isinstance(exc, OSError):
        f = _classify_oserror(exc)
        kind, detail = f.kind.value, f.detail
    else:
        kind, detail = ErrorKind.PROTOCOL.value, f"{type(exc).__name__}: {exc}"[:200]
    for rec in recs:
        rec.error, rec.detail = kind, detail


async def run_connection(recs: Sequence[SessionResult], spec: LoadSpec, t0: float) -> None:
    """Run the sessions ``recs`` on one batched connection (session *k* is ``recs[k]``);
    record each in its record. Never raises but on cancel."""
    now = time.monotonic
    start = now()
    for rec in recs:
        rec.start = start - t0
    conn = batch_connection_class()(spec.endpoint(recs[0].index), recs[0].source)
    live = list(range(len(recs)))

    def settle(entries: Sequence[_BatchResult], t: float, into: str) -> None:
        """Record each live session's entry; a failed entry fails its session alone."""
        keep = []
        for k, entry in zip(live, entries, strict=True):
            rec = recs[k]
            failure = _entry_failure(entry)
            if failure is not None:
                rec.error, rec.detail = failure.kind.value, failure.detail
                rec.end = t - t0
                continue
            keep.append(k)
            if into == "reset":
                rec.reset_s = t - sent
                data = _DATA.decode(entry.data) if entry.data else None
                if isinstance(data, dict):
                    _observe(rec, data)
            else:
                rec.step_s.append(t - sent)
        live[:] = keep

    try:
        await conn.connect(spec.connect_timeout)
        t = now()
        for rec in recs:
            rec.connect_s = t - start
        reset_data: dict[str, Any] = {"state_kb": spec.state_kb} if spec.state_kb else {}
        sent = now()
        settle(await conn.request(batch_body("reset", live, reset_data), len(live),
                                  spec.request_timeout), now(), "reset")  # fmt: skip
        step_data = {"wait_seconds": spec.wait_s}
        think = spec.think.seconds
        step_timeout = spec.wait_s + spec.request_timeout
        body, calls = batch_body("step", live, step_data), len(live)
        for _ in range(spec.steps):
            if not live:
                break
            if think > 0:
                await asyncio.sleep(think)
            if calls != len(live):  # a session failed: step the others
                body, calls = batch_body("step", live, step_data), len(live)
            sent = now()
            settle(await conn.request(body, calls, step_timeout), now(), "step")
        t = now()
        note = await conn.closed(spec.close_timeout)
        end = now()
        for k in live:
            rec = recs[k]
            rec.ok, rec.detail = True, note
            rec.close_s, rec.total_s, rec.end = end - t, end - start, end - t0
    except Exception as exc:  # a bug in a reply's handling must not kill the point
        _fail([recs[k] for k in live], exc)
    finally:
        end_s = now() - t0
        for rec in recs:
            if rec.end is None:
                rec.end = end_s
        conn.abort()


async def run_batch_sessions(
    spec: LoadSpec,
    indices: Sequence[int],
    t0: float,
    *,
    worker: int = 0,
    on_done: Callable[[], None] | None = None,
) -> list[SessionResult]:
    """Run the sessions ``indices`` of a batched ``spec`` from monotonic time ``t0``:
    ``spec.batch`` of them per connection, in the order given.

    Returns one record per index, in order; sessions still running at
    ``t0 + spec.deadline()`` are cancelled and recorded as ``deadline``.
    ``on_done()`` is called once per session as its connection ends.
    """
    records = [SessionResult(index=i, worker=worker, source=spec.source(i)) for i in indices]
    size = spec.batch
    groups = [records[k : k + size] for k in range(0, len(records), size)]
    delay = t0 - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)

    async def one(group: list[SessionResult]) -> None:
        await run_connection(group, spec, t0)
        if on_done is not None:
            for _ in group:
                on_done()

    return await until_deadline([one(g) for g in groups], records, spec, t0)
