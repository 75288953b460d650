"""The client's protocol on the core (:mod:`stadium._core.client`), no sockets.

Every message type round-trips through both sides: each request the client protocol
encodes is decoded by the server's (:class:`SessionProtocol`, the batch connection's
frame decoder), each reply the server's protocol encodes is read by the client's, in
both encodings; a test fails when a reply kind is added to the server without a
round trip here. The client reads anything without raising (a bad frame becomes an
error result). And structural checks: the client side (``_client/``) builds no wire
message by hand (no dict display or ``dict()`` call with a ``"type"`` key, no call of
msgspec's encoders): every frame's bytes come from ``_core``; and nowhere in
``src/stadium`` outside ``_core/`` (the server, the integrations, the bench's load
generators) is a frame built from a dict or written out as a literal: they encode the
core's Structs (:mod:`stadium._core.frames`).
"""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import stadium
from stadium._core.client import (
    BatchProtocol,
    ClientProtocol,
    call,
    outcome,
    reset_data,
    resume_call,
    resumed_data,
    state_result,
    step_result,
)
from stadium._core.frames import Reply
from stadium._core.protocol import (
    _OPS,
    JSON_BATCH_FRAME,
    MSGPACK_BATCH_FRAME,
    Call,
    Encoding,
    Op,
    SessionProtocol,
)
from stadium._core.resume import (
    SESSION_HEADER,
    TOKEN_HEADER,
    ForkedData,
    ResumeAsk,
    ResumeBook,
    ResumeCall,
    ResumedData,
)
from stadium._env.contract import State, StepResult
from stadium._env.cost import EpisodeCost
from stadium._env.spec import EnvSpec
from stadium._errors import CapacityError, SessionError
from stadium.envs.echo import EchoAction, EchoEnv, EchoObservation

SPEC = EnvSpec.of(EchoEnv)
ENCODINGS = pytest.mark.parametrize("encoding", list(Encoding), ids=lambda e: e.value)
SRC = Path(stadium.__file__).parent
CLIENT = SRC / "_client"


def _sides(encoding: Encoding) -> tuple[ClientProtocol, SessionProtocol]:
    ids = (f"ep{i}" for i in itertools.count())
    client = ClientProtocol(msgpack=encoding is Encoding.MSGPACK)
    return client, SessionProtocol(SPEC, encoding, lambda: next(ids))


def _resumable(client: ClientProtocol) -> ResumeBook[bytes]:
    book = client.granted({SESSION_HEADER: "1a-abc", TOKEN_HEADER: "t1"}.get)
    assert book is not None
    return book


# -- client → server ----------------------------------------------------------------


@ENCODINGS
def test_every_request_the_client_encodes_the_server_decodes(encoding: Encoding) -> None:
    client, server = _sides(encoding)
    book = _resumable(client)
    requests: dict[str, Any] = {
        "reset": reset_data(7, "mine", {"level": 2}),
        "step": {"message": "hi"},
        "state": None,
        "mcp": {"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
        "fork": None,
        "close": None,
    }
    assert set(requests) == set(_OPS)  # every request the server knows
    calls: dict[str, Call] = {}
    for kind, data in requests.items():
        payload, rid = client.request(kind) if data is None else client.request(kind, data)
        got = server.receive(payload)
        assert isinstance(got, Call), msgspec.json.decode(got) if encoding is Encoding.JSON else got
        assert (got.op, got.id) == (_OPS[kind], rid)
        calls[kind] = got
        if kind == "reset":  # the episode starts: a step is taken next
            server.observation_reply(got, EchoObservation("ready"))
    assert [rid for rid, _ in book.unanswered] == [1, 2, 3, 4, 5, 6]  # numbered, kept
    reset = calls["reset"]
    assert (reset.seed, reset.episode_id, reset.options) == (7, "mine", {"level": 2})
    assert calls["step"].action == EchoAction("hi")
    assert calls["mcp"].action == requests["mcp"]


@ENCODINGS
def test_every_batch_call_the_client_encodes_the_server_decodes(encoding: Encoding) -> None:
    msgpack = encoding is Encoding.MSGPACK
    book: ResumeBook[Any] = ResumeBook("1a-abc", "t1")
    book.replied()
    calls = [
        call(0, "reset", {"seed": 3}),
        call(1, "step", {"message": "hi"}, timeout_s=2.0),
        call(2, "state"),
        call(3, "close"),
        resume_call(4, book),
    ]
    frame = BatchProtocol(msgpack).frame(9, calls, first=99)
    decoded = (MSGPACK_BATCH_FRAME if msgpack else JSON_BATCH_FRAME).decode(frame)
    assert (decoded.type, decoded.id, decoded.first) == ("batch", 9, 5)  # first: bounded
    assert [(c.session, c.type) for c in decoded.calls] == [
        (0, "reset"),
        (1, "step"),
        (2, "state"),
        (3, "close"),
        (4, "resume"),
    ]
    _, server = _sides(encoding)
    reset = server.receive(decoded.calls[0])
    assert isinstance(reset, Call)
    assert (reset.op, reset.seed) == (Op.RESET, 3)
    server.observation_reply(reset, EchoObservation("ready"))
    step = server.receive(decoded.calls[1])
    assert isinstance(step, Call)
    assert (step.op, step.action, step.timeout_s) == (Op.STEP, EchoAction("hi"), 2.0)
    assert server.step_call(decoded.calls[1]) is None  # a timeout: not the short way
    state = server.receive(decoded.calls[2])
    assert isinstance(state, Call)
    assert state.op is Op.STATE
    resume = decoded.calls[4]
    data = (msgspec.msgpack if msgpack else msgspec.json).decode(resume.data, type=ResumeCall)
    ask = ResumeAsk.from_call(data)
    assert (ask.sid, ask.token, ask.received, ask.batched) == ("1a-abc", "t1", 1, True)


# -- server → client ----------------------------------------------------------------


@ENCODINGS
def test_every_reply_the_server_encodes_the_client_reads(encoding: Encoding) -> None:
    client, server = _sides(encoding)
    book = _resumable(client)
    read: set[str] = set()

    def answer(kind: str, frame: bytes, rid: int | None) -> Reply:
        reply = client.reply(frame, rid)
        assert isinstance(reply, Reply), reply
        assert reply.type == kind
        book.replied()  # counted, as the connection's listener counts it
        read.add(kind)
        return reply

    payload, rid = client.request("reset", reset_data(1, None, {}))
    reset = server.receive(payload)
    assert isinstance(reset, Call)
    first = answer("observation", server.observation_reply(reset, EchoObservation("ready")), rid)
    assert step_result(first) == StepResult({"echoed_message": "ready", "message_length": 0})

    payload, rid = client.request("step", {"message": "hi"})
    step = server.receive(payload)
    assert isinstance(step, Call)
    result = StepResult(EchoObservation("hi", 2), 0.2, True, truncated=True, info={"k": 1})
    cost = EpisodeCost(wall_s=0.5, cpu_s=0.25, steps=1, bytes_in=10, bytes_out=20)
    ended = server.with_cost(server.observation_reply(step, result), cost)
    reply = answer("observation", ended, rid)
    typed = step_result(reply, EchoObservation)
    obs = EchoObservation("hi", 2)
    assert typed == StepResult(obs, 0.2, True, truncated=True, info={"k": 1}, cost=cost)
    assert reply.id == rid

    payload, rid = client.request("state")
    state = server.receive(payload)
    assert isinstance(state, Call)
    reply = answer("state", server.state_reply(state, State(step_count=1)), rid)
    assert state_result(reply, State) == State(episode_id="ep0", step_count=1)

    payload, rid = client.request("mcp", {"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
    mcp = server.receive(payload)
    assert isinstance(mcp, Call)
    response = {"jsonrpc": "2.0", "id": 1, "result": {"tools": []}}
    assert answer("mcp", server.mcp_reply(mcp, response), rid).data == response

    payload, rid = client.request("fork")
    fork = server.receive(payload)
    assert isinstance(fork, Call)
    sent = ForkedData("1a-def", "t9", "node-a", 30.0)
    assert client.forked(answer("forked", server.forked_reply(fork, sent), rid)) == sent

    err = client.reply(server.error_reply(rid, CapacityError("full", retry_after_s=2.0)), rid)
    assert isinstance(err, CapacityError)
    assert err.retry_after_s == 2.0
    read.add("error")

    closed = client.read(server.closed_reply(1001, "draining"))
    assert isinstance(closed, Reply)
    err = outcome(closed)
    assert isinstance(err, stadium.SessionClosedError)
    assert err.context["close_code"] == 1001
    read.add("closed")

    # A resumed connection's first frame: the book takes the new token and resends
    # the request the server never got.
    lost, _ = client.request("step", {"message": "lost"})  # request 6: never got there
    hello = server.resumed_reply(ResumedData(book.session_id or "", "t2", 5, 0, "n2", "a:1"))
    back = client.resumed(hello)
    assert not isinstance(back, stadium.StadiumError), back
    assert (book.token, book.node, book.address) == ("t2", "n2", "a:1")
    assert back.resend == [lost]
    assert book.ask().query()["stadium_received"] == "5"
    read.add("resumed")

    kinds = {name.removesuffix("_reply") for name in dir(server) if name.endswith("_reply")}
    assert kinds - {"batch"} == read  # every reply kind the server writes, read here
    # (``batch``: the next test)


@ENCODINGS
def test_batch_replies_the_server_encodes_the_client_reads(encoding: Encoding) -> None:
    msgpack = encoding is Encoding.MSGPACK
    _, server = _sides(encoding)
    batches = BatchProtocol(msgpack)
    reset = server.receive(_request(encoding, "reset"))
    assert isinstance(reset, Call)
    observation = server.observation_reply(reset, EchoObservation("ready"))
    refused = server.error_reply(None, SessionError("session 2 is not open"))
    frame = batches.read(server.batch_reply(4, [observation, refused], [(0, "1a-s", "tok")]))
    assert not isinstance(frame, stadium.StadiumError), frame
    assert (frame.type, frame.id, frame.opened, frame.index, frame.done) == (
        "batch",
        4,
        [(0, "1a-s", "tok")],
        None,
        None,
    )
    assert frame.results is not None
    ok, bad = frame.results
    assert isinstance(step_result(ok), StepResult)
    assert isinstance(step_result(bad), SessionError)
    ready = batches.read(server.batch_reply(5, [observation], None, [3], False))
    assert not isinstance(ready, stadium.StadiumError)
    assert (ready.index, ready.done, ready.opened) == ([3], False, None)
    # A batch session's resume result carries the replies it missed.
    book: ResumeBook[str] = ResumeBook("1a-s", "tok")
    book.keep_next("reset")
    book.keep_next("step")
    data = ResumedData[msgspec.Raw]("1a-s", "t2", 2, 1, "n", "a")
    data.replies = [msgspec.Raw(observation)]
    result = batches.read(server.batch_reply(6, [server.resumed_reply(data)], None))
    assert not isinstance(result, stadium.StadiumError)
    assert result.results is not None
    taken = resumed_data(result.results[0])
    assert not isinstance(taken, stadium.StadiumError), taken
    back = book.resumed(taken)
    assert [request for request, _ in back.answered] == ["reset"]
    assert back.owed == [(2, "step")]


def _request(encoding: Encoding, kind: str) -> bytes:
    client = ClientProtocol(msgpack=encoding is Encoding.MSGPACK)
    return client.request(kind, {})[0]


# -- never raises on input ----------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64) | st.sampled_from([b"", b"[]", b"{}", b'{"type":1}', b"null"]))
def test_the_client_reads_any_bytes_without_raising(raw: bytes) -> None:
    for msgpack in (False, True):
        client = ClientProtocol(msgpack)
        _resumable(client)
        for got in (client.reply(raw, 1), client.resumed(raw), BatchProtocol(msgpack).read(raw)):
            assert not isinstance(got, BaseException) or isinstance(got, stadium.StadiumError)
        reply = client.read(raw)
        if isinstance(reply, Reply):
            for got in (step_result(reply), state_result(reply), client.forked(reply)):
                assert got is not None


def test_odd_replies_are_errors_that_say_what_came() -> None:
    client = ClientProtocol()
    wrong = step_result(Reply("state", {"step_count": 1}))
    assert isinstance(wrong, SessionError)
    assert "'state' where 'observation'" in str(wrong)
    unfit = step_result(Reply("observation", {"observation": {"x": 1}}), EchoObservation)
    assert isinstance(unfit, stadium.ValidationError)
    unreadable = client.reply(b"{not json", None)
    assert isinstance(unreadable, stadium.SessionClosedError)
    assert "cannot be read" in str(unreadable)
    assert isinstance(client.resumed(b'{"type":"state","data":{}}'), stadium.ResumeError)


# -- structure: no wire message built by hand outside _core --------------------------

_ENCODERS = {
    "msgspec.json.encode",
    "msgspec.msgpack.encode",
    "msgspec.json.Encoder",
    "msgspec.msgpack.Encoder",
}


def _dotted(node: ast.AST) -> str:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def hand_built(source: str) -> list[str]:
    """Where ``source`` builds a wire message by hand: a dict display or ``dict()`` call
    with a ``"type"`` key (an envelope), or a call of msgspec's encoders (frame bytes
    made outside the core's protocol)."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict):
            keys = [k.value for k in node.keys if isinstance(k, ast.Constant)]
            if "type" in keys:
                found.append(f"line {node.lineno}: a dict with a 'type' key")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name == "dict" and any(k.arg == "type" for k in node.keywords):
                found.append(f"line {node.lineno}: dict(type=...)")
        if isinstance(node, ast.Attribute | ast.Name) and _dotted(node) in _ENCODERS:
            found.append(f"line {node.lineno}: {_dotted(node)}")
    return found


def test_the_check_catches_a_hand_built_message() -> None:
    assert hand_built('payload = encode({"type": "step", "data": action, "id": rid})')
    assert hand_built('entry = {"session": 1, "type": "reset"}')
    assert hand_built("frame = dict(type='batch', calls=calls)")
    assert hand_built("send(msgspec.json.encode(frame))")
    assert hand_built("enc = msgspec.msgpack.Encoder()")
    assert not hand_built("payload, rid = self._protocol.request('step', data)")
    assert not hand_built('headers = {"Authorization": token}')


def test_the_client_builds_no_wire_message_by_hand() -> None:
    modules = sorted(CLIENT.glob("**/*.py"))
    assert len(modules) >= 5
    found = {
        str(path.relative_to(CLIENT)): where
        for path in modules
        if (where := hand_built(path.read_text()))
    }
    assert found == {}, f"build frames with stadium._core.client, not by hand: {found}"


#: The ``type`` of every frame: the session protocol's requests (``_OPS``, checked below)
#: and replies, the batch connection's, and OpenEnv's ``/harness`` socket's.
_FRAME_TYPES = frozenset({
    "reset", "step", "state", "close", "mcp", "fork", "resume", "batch",
    "observation", "error", "forked", "resumed", "closed",
    "message", "session_started", "protocol_error",
})  # fmt: skip
#: A frame written out as a literal (``b'{"type":"close"}'``), or its beginning.
_FRAME_TEXT = re.compile(r'^\s*\{\s*"type"\s*:')

#: Modules outside ``_core/`` that write frames without it, and why.
_BY_HAND = {
    # The floor arm is a bare server the bench runs as a plain script, with no Stadium on
    # its path (contract ``arms-standalone``): it cannot import the core.
    "bench/floor.py",
}


def dict_built_frames(source: str) -> list[str]:
    """Where ``source`` builds a frame by hand: a dict display or ``dict()`` call whose
    ``"type"`` is a frame's (:data:`_FRAME_TYPES`) or that has a ``"data"`` beside its
    ``"type"`` (the envelope), or a string or bytes literal that reads as a frame; or the
    body of OpenEnv's HTTP ``/reset`` and ``/step`` answers (``ObservationBody``) as a
    dict. Dicts with a ``"type"`` of another kind (an ASGI event, a JSON schema, a
    manifest) pass."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        fields: dict[str, ast.expr] = {}
        if isinstance(node, ast.Dict):
            fields = {
                k.value: v
                for k, v in zip(node.keys, node.values, strict=True)
                if isinstance(k, ast.Constant) and isinstance(k.value, str)
            }
        elif isinstance(node, ast.Call) and _dotted(node.func) == "dict":
            fields = {k.arg: k.value for k in node.keywords if k.arg is not None}
        kind = fields.get("type")
        if kind is not None and (
            "data" in fields or (isinstance(kind, ast.Constant) and kind.value in _FRAME_TYPES)
        ):
            found.append(f"line {node.lineno}: a dict-built frame")
        if set(fields) == {"observation", "reward", "done"}:
            found.append(f"line {node.lineno}: a dict-built ObservationBody")
        if isinstance(node, ast.Constant) and isinstance(node.value, str | bytes):
            text = node.value if isinstance(node.value, str) else node.value.decode("latin-1")
            if _FRAME_TEXT.match(text):
                found.append(f"line {node.lineno}: a frame written out ({node.value!r:.40})")
    return found


def test_the_frame_check_catches_a_frame_and_passes_other_dicts() -> None:
    assert set(_OPS) <= _FRAME_TYPES
    assert dict_built_frames('frame = msgspec.json.encode({"type": "step", "data": action})')
    assert dict_built_frames('calls = [{"session": s, "type": "reset"} for s in sessions]')
    assert dict_built_frames('frame = {"type": kind, "data": data}')
    assert dict_built_frames("frame = dict(type='close')")
    assert dict_built_frames('send(b\'{"type":"close"}\')')
    assert dict_built_frames('_PREFIX = b\'{"type":"mcp","data":\'')
    assert dict_built_frames('return json.dumps({"type": "session_started", "data": d})')
    assert dict_built_frames('body = {"observation": obs, "reward": None, "done": False}')
    assert not dict_built_frames('send({"type": "websocket.send", "bytes": payload})')
    assert not dict_built_frames('schema = {"type": "object", "properties": {}}')
    assert not dict_built_frames('split = {"name": name, "type": kind}')
    assert not dict_built_frames('content = [{"type": "text", "text": text}]')
    assert not dict_built_frames('"""Sends ``{"type": "reset"}`` first."""')
    assert not dict_built_frames('frame = msgspec.json.encode(Request("step", action))')


def test_nothing_outside_the_core_builds_a_frame_by_hand() -> None:
    modules = sorted(p for p in SRC.rglob("*.py") if p.relative_to(SRC).parts[0] != "_core")
    assert len(modules) > 100
    found = {
        name: where
        for path in modules
        if (name := path.relative_to(SRC).as_posix()) not in _BY_HAND
        and (where := dict_built_frames(path.read_text()))
    }
    assert found == {}, f"encode stadium._core.frames' Structs, not dicts: {found}"
    assert all((SRC / name).exists() for name in _BY_HAND), "a stale exception"


def test_the_http_observation_body_is_openenvs_shape_byte_for_byte() -> None:
    """OpenEnv's HTTP ``/reset`` and ``/step`` body, as the endpoints wrote it as a dict."""
    from stadium._core.frames import ObservationBody

    for obs, reward, done in [({"x": 1}, None, False), ({"y": [1.5]}, 0.25, True), ("s", 1, False)]:
        old = {"observation": obs, "reward": reward, "done": done}
        assert msgspec.json.encode(ObservationBody(obs, reward, done)) == msgspec.json.encode(old)
    empty = b'{"observation":{},"reward":null,"done":false}'
    assert msgspec.json.encode(ObservationBody({})) == empty
