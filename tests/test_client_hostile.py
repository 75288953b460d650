"""The clients against hostile or broken servers: small fake servers on loopback that
answer the upgrade, then send what a compromised or buggy server (or a proxy) would.
A client must not hang, grow without bound, or read one request's reply as another's:
it fails with a :class:`~stadium.StadiumError` that says what was wrong."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import math
import random
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import pytest

from stadium import (
    AsyncClient,
    CapacityError,
    ConfigError,
    ConnectError,
    ResumeError,
    SessionClosedError,
    SessionPool,
    ValidationError,
)
from stadium._client.balance import Endpoint, apply_health, plan
from stadium._client.batch import BatchConnection, result_of
from stadium._client.batch import call as batch_call
from tests.conftest import UNIT
from tests.wsfake import read_upgrade

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def _frame(opcode: int, payload: bytes) -> bytes:
    n = len(payload)
    if n < 126:
        return bytes([0x80 | opcode, n]) + payload
    return bytes([0x80 | opcode, 126]) + n.to_bytes(2, "big") + payload


def _json(kind: str, data: Any, **extra: Any) -> bytes:
    return _frame(0x1, json.dumps({"type": kind, "data": data, **extra}).encode())


def _observation(n: int) -> bytes:
    return _json("observation", {"observation": {"n": n}, "reward": 0.0, "done": False})


async def _read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One client frame (masked), unmasked: its opcode and payload."""
    head = await reader.readexactly(2)
    n = head[1] & 0x7F
    if n == 126:
        n = int.from_bytes(await reader.readexactly(2), "big")
    elif n == 127:
        n = int.from_bytes(await reader.readexactly(8), "big")
    mask = await reader.readexactly(4)
    data = await reader.readexactly(n)
    return head[0] & 0x0F, bytes(b ^ mask[i % 4] for i, b in enumerate(data))


async def _requests(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Any:
    """The client's requests, decoded, until it closes (then the close is answered)."""
    while True:
        opcode, payload = await _read_frame(reader)
        request = None
        if opcode in (0x1, 0x2):
            request = msgspec.msgpack.decode(payload) if opcode == 0x2 else json.loads(payload)
        if opcode == 0x8 or (isinstance(request, dict) and request.get("type") == "close"):
            writer.write(_frame(0x8, (1000).to_bytes(2, "big")))
            await writer.drain()
            return
        if request is not None:
            yield request


class Fake:
    """What a fake server saw: its connections, and how many are open now."""

    def __init__(self) -> None:
        self.connections = 0
        self.open = 0
        self.most_open = 0


async def _fake(
    script: Script, headers: bytes = b"", fake: Fake | None = None
) -> tuple[asyncio.Server, str]:
    """A server that answers the upgrade with 101 (and ``headers``), then runs ``script``
    (``fake``: counts its connections)."""
    seen = fake or Fake()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.connections += 1
        seen.open += 1
        seen.most_open = max(seen.most_open, seen.open)
        try:
            await _upgraded(reader, writer)
        finally:
            seen.open -= 1

    async def _upgraded(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _, accept = await read_upgrade(reader)
        writer.write(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\nSec-WebSocket-Accept: " + accept + b"\r\n" + headers + b"\r\n"
        )
        try:
            await script(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"ws://127.0.0.1:{port}/ws"


# -- replies no request asked for ----------------------------------------------------------


async def _twice(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Sends every reply twice (a buggy proxy's retry, a compromised server)."""
    n = 0
    async for _ in _requests(reader, writer):
        n += 1
        writer.write(_observation(n) * 2)
        await writer.drain()


async def _chatty(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers the first request, then sends frames nobody asked for, without end."""
    async for _ in _requests(reader, writer):
        writer.write(_observation(1))
        for _ in range(10_000):
            writer.write(_observation(0))
            await writer.drain()
        return


@pytest.mark.parametrize("resume", [False, True])
async def test_a_reply_sent_twice_is_never_read_as_the_next_requests(resume: bool) -> None:
    headers = b"X-Stadium-Session: 1-a\r\nX-Stadium-Resume-Token: t\r\n" if resume else b""
    server, url = await _fake(_twice, headers)
    async with server:
        env = AsyncClient(url, max_retries=0, request_timeout=5 * UNIT, resume=resume)
        async with env:
            assert (await env.reset()).observation == {"n": 1}
            # before: the step read the reset's copy ({"n": 1}) without being sent
            with pytest.raises(SessionClosedError, match="no request asked for"):
                await env.step({})


async def test_frames_never_asked_for_are_not_kept_without_bound() -> None:
    server, url = await _fake(_chatty)
    async with server:
        async with AsyncClient(url, max_retries=0, request_timeout=5 * UNIT, resume=False) as env:
            assert (await env.reset()).observation == {"n": 1}
            listener = env._listener
            assert listener is not None
            await asyncio.sleep(0.2 * UNIT)  # before: 10,000 frames kept, each read as a reply
            assert len(listener.early) == 0
            with pytest.raises(SessionClosedError, match="no request asked for"):
                await env.step({})


# -- hostile numbers: Retry-After, grace ---------------------------------------------------


async def _full(retry_after: float) -> Script:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        refusal = {"code": "CAPACITY_REACHED", "message": "full", "retry_after_s": retry_after}
        writer.write(_frame(0x2, msgspec.msgpack.encode({"type": "error", "data": refusal})))
        writer.write(_frame(0x8, (1013).to_bytes(2, "big")))
        await writer.drain()

    return script


@pytest.mark.parametrize("retry_after", [1e300, float("inf"), float("nan"), -5.0])
async def test_a_hostile_retry_after_is_bounded(retry_after: float) -> None:
    server, url = await _fake(
        await _full(retry_after), b"Sec-WebSocket-Protocol: stadium.msgpack\r\n"
    )
    async with server:
        env = AsyncClient(
            url, max_retries=1, msgpack=True, resume=False, connect_timeout=0.5 * UNIT
        )
        # before: slept 1e300 s (or raised ValueError from asyncio.sleep(nan))
        async with asyncio.timeout(5 * UNIT):
            with pytest.raises(CapacityError) as caught:
                await env.reset()
        assert 0.0 <= caught.value.retry_after_s < math.inf  # a number to wait, never NaN


_GRANTED = (
    b"X-Stadium-Session: 1-a\r\nX-Stadium-Resume-Token: t\r\nX-Stadium-Resume-Grace: 1e300\r\n"
)


def _lost_then_mute(fake: Fake) -> Script:
    """The first connection answers one request, then is cut (no close frame); every
    resume after it is upgraded and never answered (no ``resumed``)."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if fake.connections == 1:
            async for _ in _requests(reader, writer):
                writer.write(_observation(1))
                await writer.drain()
                writer.transport.abort()
                return
        await reader.read()  # until the client hangs up

    return script


async def test_a_resume_never_answered_under_a_huge_grace_fails_the_request_in_time() -> None:
    fake = Fake()
    server, url = await _fake(_lost_then_mute(fake), _GRANTED, fake)
    async with server:
        env = AsyncClient(url, max_retries=0, request_timeout=1 * UNIT, connect_timeout=0.2 * UNIT)
        try:
            await env.connect()
            assert (await env.reset()).observation == {"n": 1}
            # before: the step waited for a resume that the grace (1e300 s) never ended
            async with asyncio.timeout(10 * UNIT):
                with pytest.raises(SessionClosedError):
                    await env.step({})
            assert fake.connections >= 3  # it tried to resume, more than once
            assert fake.most_open <= 2  # before: every unanswered resume stayed open
        finally:
            await env.close()


# -- a 101 that opened another WebSocket than the one asked for -------------------------


async def _answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers every request in JSON (whatever the client offered)."""
    n = 0
    async for _ in _requests(reader, writer):
        n += 1
        writer.write(_observation(n))
        await writer.drain()


@pytest.mark.parametrize(
    ("msgpack", "headers", "said"),
    [
        (True, b"", "did not accept the stadium.msgpack subprotocol"),
        (True, b"Sec-WebSocket-Protocol: msgpack\r\n", "picked the subprotocol 'msgpack'"),
        (False, b"Sec-WebSocket-Protocol: stadium.msgpack\r\n", "picked the subprotocol"),
        (False, b"Sec-WebSocket-Extensions: permessage-deflate\r\n", "extensions"),
    ],
)
async def test_a_101_with_a_subprotocol_or_extension_not_offered_is_a_connect_error(
    msgpack: bool, headers: bytes, said: str
) -> None:
    server, url = await _fake(_answers, headers)
    async with server:
        env = AsyncClient(url, max_retries=0, msgpack=msgpack, resume=False)
        # before: the session opened, and its frames were read as the wrong encoding
        with pytest.raises(ConnectError, match=said):
            await env.reset()
        assert not env.connected


async def test_a_101_picking_the_subprotocol_offered_opens_the_session() -> None:
    server, url = await _fake(_answers, b"Sec-WebSocket-Protocol: stadium.msgpack\r\n")
    async with server:
        async with AsyncClient(url, max_retries=0, msgpack=True, resume=False) as env:
            assert env.connected  # the JSON replies are the fake's, not read here


# -- batches answered with fewer or more results than calls --------------------------------


def _batch_server(answer: Callable[[dict[str, Any]], dict[str, Any]]) -> Script:
    """A batch server answering each batch frame with ``answer(frame)``."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for frame in _requests(reader, writer):
            writer.write(_frame(0x1, json.dumps(answer(frame)).encode()))
            await writer.drain()

    return script


def _result(n: int) -> dict[str, Any]:
    return {"type": "observation", "data": {"observation": {"n": n}, "reward": 0.0}}


def _short(frame: dict[str, Any]) -> dict[str, Any]:
    """One result fewer than the calls."""
    return {"type": "batch", "id": frame["id"], "results": [_result(0)] * (len(frame["calls"]) - 1)}


def _long(frame: dict[str, Any]) -> dict[str, Any]:
    """One result more than the calls."""
    return {"type": "batch", "id": frame["id"], "results": [_result(0)] * (len(frame["calls"]) + 1)}


def _twice_indexed(frame: dict[str, Any]) -> dict[str, Any]:
    """Streamed: the first result twice, the last never, and "done"."""
    n = len(frame["calls"])
    return {
        "type": "batch",
        "id": frame["id"],
        "results": [_result(0)] * n,
        "index": [0] * 2 + list(range(1, n - 1)),
        "done": True,
    }


async def _results(conn: BatchConnection, calls: list[Any], first: int | None) -> list[Any]:
    return [result_of(entry) for entry in await conn.batch(calls, first)]


@pytest.mark.parametrize("answer", [_short, _long, _twice_indexed])
async def test_a_batch_answered_with_the_wrong_count_of_results_fails_clearly(
    answer: Callable[[dict[str, Any]], dict[str, Any]],
) -> None:
    server, url = await _fake(_batch_server(answer), b"Sec-WebSocket-Protocol: stadium.batch\r\n")
    async with server:
        conn = await BatchConnection.open(url, max_retries=0, request_timeout=5 * UNIT)
        try:
            assert conn.accepted
            calls = [batch_call(i, "reset") for i in range(3)]
            first = 2 if answer is _twice_indexed else None
            # before: a missing result was None (AttributeError deep in result_of), an
            # extra one dropped silently, a duplicated one counted as the missing one
            with pytest.raises(SessionClosedError, match="of 3 calls"):
                await _results(conn, calls, first)
        finally:
            await conn.close()


# -- an observation reply of the wrong shape -----------------------------------------------


@pytest.mark.parametrize(
    ("data", "said"),
    [
        ({"observation": {}, "reward": "1e9"}, "reward"),
        ({"observation": {}, "reward": [1, 2]}, "reward"),
        ({"observation": {}, "reward": 0.0, "done": "false"}, "done"),
        ({"observation": {}, "reward": 0.0, "truncated": 1}, "truncated"),
        ({"observation": {}, "reward": 0.0, "info": [1]}, "info"),
    ],
)
async def test_an_observation_of_the_wrong_types_is_a_validation_error(
    data: dict[str, Any], said: str
) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for _ in _requests(reader, writer):
            writer.write(_json("observation", data, cost=[1, "x"]))  # a cost of no shape: none
            await writer.drain()

    server, url = await _fake(script)
    async with server:
        async with AsyncClient(url, max_retries=0, request_timeout=5 * UNIT, resume=False) as env:
            # before: {"done": "false"} was done, a string reward reached the trainer
            with pytest.raises(ValidationError, match=said):
                await env.reset()
            assert env.connected  # the session goes on: the next reply may be fine


# -- frames past the client's limits, and odd closes ----------------------------------------


def _once(reply: bytes) -> Script:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for _ in _requests(reader, writer):
            writer.write(reply)
            await writer.drain()
            await reader.read()  # until the client hangs up
            return

    return script


@pytest.mark.parametrize(
    "reply",
    [
        _frame(0x1, b'"' + b"x" * 5000 + b'"'),  # over max_message_bytes
        _frame(0x8, (1000).to_bytes(2, "big") + b"\xff\xfe"),  # a reason not UTF-8
        _frame(0x8, b"\x01"),  # half a close code
    ],
    ids=["too-large", "close-not-utf8", "close-half-code"],
)
async def test_a_frame_breaking_the_websocket_rules_ends_the_session_quietly(reply: bytes) -> None:
    server, url = await _fake(_once(reply))
    async with server:
        env = AsyncClient(url, max_retries=0, request_timeout=5 * UNIT, resume=False)
        env.options = dataclasses.replace(env.options, max_message_bytes=1000)
        try:
            # before: the session failed, and asyncio logged "Future exception was never
            # retrieved" with picows' traceback (conftest fails a test on it)
            with pytest.raises(SessionClosedError):
                await env.reset()
            await asyncio.sleep(0.1 * UNIT)  # picows ends the connection 10 ms after
        finally:
            await env.close()
        del env
        gc.collect()  # an exception never retrieved is logged when its future goes


# -- a node lying in its /health ----------------------------------------------------------


@pytest.mark.parametrize("max_sessions", [-1, -1000])
def test_a_node_reporting_negative_room_does_not_draw_every_session(max_sessions: int) -> None:
    honest, liar = Endpoint("http://a:1"), Endpoint("http://b:1")
    apply_health(honest, 200, {"active_sessions": 1, "max_sessions": 10})
    apply_health(liar, 200, {"active_sessions": 0, "max_sessions": max_sessions})
    chosen = plan([honest, liar], 10, random.Random(1))
    # before: a negative capacity made it the emptiest node, for every session
    assert sum(ep is liar for ep in chosen) <= 6


# -- stadium.gym's GET /schema from a hostile server ---------------------------------------


def _http(body: bytes, trickle_s: float = 0.0) -> Callable[..., Awaitable[None]]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n")
        writer.write(b"Content-Length: %d\r\n\r\n" % len(body))
        try:
            for at in range(0, len(body), 64 if trickle_s else len(body) or 1):
                writer.write(body[at : at + (64 if trickle_s else len(body))])
                await writer.drain()
                await asyncio.sleep(trickle_s)
        except ConnectionError:
            pass
        finally:
            writer.close()

    return handle


def _schema(space: Any) -> bytes:
    box = {"type": "Discrete", "n": 2}
    return json.dumps({"gymnasium": {"observation_space": space, "action_space": box}}).encode()


@pytest.mark.parametrize(
    ("body", "said"),
    [
        (b"\xff\xfe not json", "is not a schema"),
        (b"[" * 100_000, "is not a schema"),
        (_schema({"type": "Box"}), "cannot be rebuilt"),
        (_schema({"type": "Discrete", "n": "two"}), "cannot be rebuilt"),
        (_schema({"type": "Tuple", "spaces": 5}), "cannot be rebuilt"),
        (_schema({"type": "Discrete", "n": 10**30}), "cannot be rebuilt"),
        (
            _schema({"type": "Box", "shape": [10**7] * 2, "dtype": "f8", "low": 0, "high": 1}),
            "cannot",
        ),
    ],
    ids=[
        "not-utf8",
        "too-deep",
        "box-no-shape",
        "n-not-a-number",
        "tuple-of-int",
        "n-huge",
        "box-huge",
    ],
)
async def test_a_schema_that_cannot_be_read_is_a_config_error(body: bytes, said: str) -> None:
    import stadium.gym

    server = await asyncio.start_server(_http(body), "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    async with server:
        # before: msgspec's DecodeError, KeyError, ValueError or TypeError from deep inside
        with pytest.raises(ConfigError, match=said):
            await asyncio.to_thread(stadium.gym.fetch_spaces, url, 5 * UNIT)


async def test_a_schema_trickled_byte_by_byte_is_given_up_within_the_timeout() -> None:
    import stadium.gym

    body = _schema({"type": "Discrete", "n": 2}) + b" " * 4096
    server = await asyncio.start_server(_http(body, trickle_s=0.05), "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    async with server:
        # before: each read under the timeout, so the whole took ~3 s for a 0.3 s timeout
        async with asyncio.timeout(2 * UNIT):
            with pytest.raises(ConnectError, match="within"):
                await asyncio.to_thread(stadium.gym.fetch_spaces, url, 0.3 * UNIT)


async def test_a_malformed_answer_to_close_is_not_raised_by_close() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(10):
            _, payload = await _read_frame(reader)
            if b'"close"' in payload:  # answered with half a close code
                writer.write(_frame(0x8, b"\x01"))
                await writer.drain()
                await reader.read()
                return
            writer.write(_observation(1))
            await writer.drain()

    server, url = await _fake(script)
    async with server:
        env = AsyncClient(url, max_retries=0, request_timeout=5 * UNIT, resume=False)
        await env.connect()
        await env.reset()
        await env.close()  # before: raised picows' WSProtocolError from wait_disconnected
        assert not env.connected


# -- resume: a server that takes the session back and drops it again, without end ---------


def _resumed_then_cut(fake: Fake) -> Script:
    """The first connection answers one request and is cut; every resume is answered
    ``resumed`` (a fresh token), then cut at once: a resume chain that never ends."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if fake.connections == 1:
            async for _ in _requests(reader, writer):
                writer.write(_observation(1))
                await writer.drain()
                break
        else:
            writer.write(_json("resumed", {"session": "1-a", "token": f"t{fake.connections}"}))
            await writer.drain()
        writer.transport.abort()

    return script


async def test_an_endless_chain_of_resumes_ends_within_the_grace_period() -> None:
    fake = Fake()
    granted = (
        b"X-Stadium-Session: 1-a\r\nX-Stadium-Resume-Token: t\r\nX-Stadium-Resume-Grace: 0.5\r\n"
    )
    server, url = await _fake(_resumed_then_cut(fake), granted, fake)
    async with server:
        env = AsyncClient(url, max_retries=0, request_timeout=5 * UNIT, connect_timeout=UNIT)
        try:
            await env.connect()
            assert (await env.reset()).observation == {"n": 1}
            # an idle client: before, it reconnected as fast as the server cut, for ever
            await asyncio.sleep(2.5 * UNIT)  # past the grace (0.5 s) and its slack (1 s)
            seen = fake.connections
            await asyncio.sleep(0.5 * UNIT)
            assert fake.connections == seen  # the chain is over
            assert env._resuming is None
            with pytest.raises(ResumeError):
                await env.step({})
        finally:
            await env.close()


def _batch_resumed_then_cut(fake: Fake) -> Script:
    """The batch version: the first connection opens session 0 and is cut; every resume
    of it is answered ``resumed``, then cut at once."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for frame in _requests(reader, writer):
            if fake.connections == 1:
                results = [_result(1)]
                reply = {"type": "batch", "id": frame["id"], "results": results}
                reply["opened"] = [[0, "1-a", "t"]]
            else:
                resumed = {
                    "type": "resumed",
                    "data": {"session": "1-a", "token": "t", "requests": 1},
                }
                reply = {"type": "batch", "id": frame["id"], "results": [resumed]}
            writer.write(_frame(0x1, json.dumps(reply).encode()))
            await writer.drain()
            break
        writer.transport.abort()

    return script


async def test_an_endless_chain_of_batch_resumes_ends_within_the_grace_period() -> None:
    fake = Fake()
    granted = b"Sec-WebSocket-Protocol: stadium.batch\r\nX-Stadium-Resume-Grace: 0.5\r\n"
    server, url = await _fake(_batch_resumed_then_cut(fake), granted, fake)
    async with server:
        pool = SessionPool(url, 1, max_retries=0, request_timeout=5 * UNIT, connect_timeout=UNIT)
        try:
            await pool.__aenter__()
            assert (await pool.reset())[0].observation == {"n": 1}
            await asyncio.sleep(2.5 * UNIT)  # past the grace (0.5 s) and its slack (1 s)
            seen = fake.connections
            await asyncio.sleep(0.5 * UNIT)
            assert fake.connections == seen  # before: reconnecting as fast as it was cut
        finally:
            await pool.close()


# -- an error frame whose context is not keyword arguments -----------------------------------


@pytest.mark.parametrize("context", [{"self": 1}, {1: "a number as a key"}])
async def test_an_error_frame_with_any_keys_is_its_error(
    context: dict[Any, Any],
) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for _ in _requests(reader, writer):
            data = {"code": "CAPACITY_REACHED", "message": "full", **context}
            writer.write(_frame(0x2, msgspec.msgpack.encode({"type": "error", "data": data})))
            await writer.drain()

    server, url = await _fake(script, b"Sec-WebSocket-Protocol: stadium.msgpack\r\n")
    async with server:
        env = AsyncClient(url, max_retries=0, msgpack=True, resume=False)
        async with env:
            # before: TypeError (multiple values for 'self'; keywords must be strings)
            with pytest.raises(CapacityError, match="full"):
                await env.step({})


# -- a redirect to another host --------------------------------------------------------------


async def test_a_redirect_is_not_followed_with_the_token() -> None:
    reached: list[bytes] = []

    async def elsewhere(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        reached.append(await reader.readuntil(b"\r\n\r\n"))
        writer.close()

    other = await asyncio.start_server(elsewhere, "127.0.0.1", 0)
    target = f"ws://127.0.0.1:{other.sockets[0].getsockname()[1]}/ws".encode()

    async def redirect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 302 Found\r\nLocation: " + target + b"\r\nContent-Length: 0\r\n\r\n"
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(redirect, "127.0.0.1", 0)
    url = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}/ws"
    async with server, other:
        env = AsyncClient(url, max_retries=0, token="secret", connect_timeout=2 * UNIT)
        # before: picows followed it, the bearer token in its headers, to the other host
        with pytest.raises(ConnectError, match="redirect to ws:"):
            await env.reset()
        assert reached == []


async def test_a_reply_over_max_message_bytes_is_never_read() -> None:
    big = _json("observation", {"observation": {"text": "x" * 2000}, "reward": 0.0})
    server, url = await _fake(_answers_with(big))
    async with server:
        env = AsyncClient(
            url, max_retries=0, request_timeout=5 * UNIT, resume=False, max_message_bytes=1000
        )
        try:
            await env.connect()
            # before: picows ended the connection, but the frame, whole in its buffer, was
            # read first: reset returned 2 KB past the 1,000 bytes allowed
            with pytest.raises(SessionClosedError, match="over max_message_bytes"):
                await env.reset()
        finally:
            await env.close()
        del env
        gc.collect()


def _answers_with(reply: bytes) -> Script:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for _ in _requests(reader, writer):
            writer.write(reply)
            await writer.drain()

    return script


async def test_a_batch_reply_over_max_message_bytes_is_never_read() -> None:
    def big(frame: dict[str, Any]) -> dict[str, Any]:
        results = [_result(0) | {"pad": "x" * 2000}]
        return {"type": "batch", "id": frame["id"], "results": results}

    server, url = await _fake(_batch_server(big), b"Sec-WebSocket-Protocol: stadium.batch\r\n")
    async with server:
        conn = await BatchConnection.open(url, max_retries=0, max_message_bytes=1000)
        try:
            # before: read whole (2 KB past the 1,000 bytes allowed) before picows closed
            with pytest.raises(SessionClosedError, match="over max_message_bytes"):
                await conn.batch([batch_call(0, "reset")])
        finally:
            await conn.close()
        del conn
        gc.collect()
