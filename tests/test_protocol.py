"""The protocol core, frame by frame: no sockets, no clocks."""

from __future__ import annotations

import contextlib
import itertools
import os

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stadium._core.protocol import Call, Encoding, Op, SessionProtocol, SessionState
from stadium._env.contract import StepResult
from stadium._env.spec import EnvSpec
from stadium.envs.echo import EchoEnv, EchoObservation

SPEC = EnvSpec.of(EchoEnv)


def make(encoding: Encoding = Encoding.JSON) -> SessionProtocol:
    ids = (f"ep{i}" for i in itertools.count())
    return SessionProtocol(SPEC, encoding, lambda: next(ids))


def error(reply: object) -> dict[str, object]:
    assert isinstance(reply, bytes), reply
    frame = msgspec.json.decode(reply)
    assert frame["type"] == "error"
    return frame["data"]


def test_reset_then_step_produces_calls_and_replies() -> None:
    p = make()
    call = p.receive(b'{"type":"reset","data":{"seed":3}}')
    assert isinstance(call, Call)
    assert (call.op, call.seed, call.options, call.episode_id) == (Op.RESET, 3, None, "ep0")
    reply = p.observation_reply(call, EchoObservation("ready"))
    assert reply == (
        b'{"type":"observation","data":{"observation":{"echoed_message":"ready",'
        b'"message_length":0},"reward":null,"done":false}}'
    )
    assert p.state is SessionState.READY
    step = p.receive('{"type":"step","data":{"message":"hi"}}')
    assert isinstance(step, Call)
    assert step.op is Op.STEP
    assert step.action.message == "hi"
    out = msgspec.json.decode(p.observation_reply(step, StepResult(EchoObservation("hi", 2), 0.2)))
    assert out == {
        "type": "observation",
        "data": {
            "observation": {"echoed_message": "hi", "message_length": 2},
            "reward": 0.2,
            "done": False,
        },
    }
    assert p.step_count == 1


def test_state_reply_fills_episode_id_and_step_count() -> None:
    p = make()
    reset = p.receive(b'{"type":"reset","data":{"episode_id":"mine"}}')
    assert isinstance(reset, Call)
    p.observation_reply(reset, EchoObservation("x"))
    call = p.receive(b'{"type":"state"}')
    assert isinstance(call, Call)
    assert call.op is Op.STATE
    data = msgspec.json.decode(p.state_reply(call, {"extra": 1}))["data"]
    assert data == {"extra": 1, "episode_id": "mine", "step_count": 0}


def test_request_id_is_echoed_on_replies_and_errors() -> None:
    p = make()
    call = p.receive(b'{"type":"reset","id":41}')
    assert isinstance(call, Call)
    assert msgspec.json.decode(p.observation_reply(call, EchoObservation("x")))["id"] == 41
    err = p.receive(b'{"type":"jump","id":"abc"}')
    assert msgspec.json.decode(err)["id"] == "abc"


def test_truncated_and_info_are_carried_only_when_set() -> None:
    p = make()
    reset = p.receive(b'{"type":"reset"}')
    assert isinstance(reset, Call)
    p.observation_reply(reset, EchoObservation("x"))
    step = p.receive(b'{"type":"step","data":{"message":"a"}}')
    assert isinstance(step, Call)
    res = StepResult(EchoObservation("a"), 1.0, truncated=True, info={"k": 1})
    data = msgspec.json.decode(p.observation_reply(step, res))["data"]
    assert data["done"] is True
    assert data["truncated"] is True
    assert data["info"] == {"k": 1}


@pytest.mark.parametrize(
    ("frame", "code", "needle"),
    [
        (b"not json", "INVALID_JSON", "Invalid JSON"),
        (b"\x00\xff\xfe garbage", "INVALID_JSON", "Invalid JSON"),
        (b"[1, 2]", "INVALID_JSON", "must be an object"),
        (b'{"type":"jump"}', "UNKNOWN_TYPE", "jump"),
        (b'{"data":{}}', "UNKNOWN_TYPE", "expected one of"),
        (b'{"type":7}', "UNKNOWN_TYPE", "$.type"),
        (b'{"type":"reset","data":{"seed":"x"}}', "VALIDATION_ERROR", "seed"),
        (b'{"type":"reset","data":[1]}', "VALIDATION_ERROR", "object"),
        (b'{"type":"reset","id":[1]}', "VALIDATION_ERROR", "$.id"),
    ],
)
def test_bad_frames_get_error_replies(frame: bytes, code: str, needle: str) -> None:
    p = make()
    data = error(p.receive(frame))
    assert data["code"] == code
    assert needle in str(data["message"])
    assert p.state is SessionState.NEW  # still usable
    assert isinstance(p.receive(b'{"type":"reset"}'), Call)


def test_step_before_reset_is_a_session_error() -> None:
    data = error(make().receive(b'{"type":"step","data":{"message":"x"}}'))
    assert data["code"] == "SESSION_ERROR"
    assert "reset" in str(data["message"])


def test_validation_error_names_the_field() -> None:
    p = make()
    reset = p.receive(b'{"type":"reset"}')
    assert isinstance(reset, Call)
    p.observation_reply(reset, EchoObservation("x"))
    data = error(p.receive(b'{"type":"step","data":{"message":5}}'))
    assert data["code"] == "VALIDATION_ERROR"
    assert data["field"] == "$.message"
    assert "$.message" in str(data["message"])
    missing = error(p.receive(b'{"type":"step"}'))
    assert missing["field"] == "$.data"


def test_unknown_reset_keys_become_options() -> None:
    call = make().receive(b'{"type":"reset","data":{"state_kb":4,"options":{"a":1}}}')
    assert isinstance(call, Call)
    assert call.options == {"state_kb": 4, "a": 1}


def test_close_ends_the_session() -> None:
    p = make()
    call = p.receive(b'{"type":"close"}')
    assert isinstance(call, Call)
    assert call.op is Op.CLOSE
    assert p.state is SessionState.CLOSED
    assert error(p.receive(b'{"type":"reset"}'))["code"] == "SESSION_ERROR"


def test_msgpack_encoding_round_trips() -> None:
    p = make(Encoding.MSGPACK)
    call = p.receive(msgspec.msgpack.encode({"type": "reset", "data": {"seed": 1}, "id": 2}))
    assert isinstance(call, Call)
    out = msgspec.msgpack.decode(p.observation_reply(call, EchoObservation("x")))
    assert out == {
        "type": "observation",
        "data": {
            "observation": {"echoed_message": "x", "message_length": 0},
            "reward": None,
            "done": False,
        },
        "id": 2,
    }
    assert error(msgspec.json.encode(msgspec.msgpack.decode(p.receive(b"\xc1"))))["code"] == (
        "INVALID_JSON"
    )


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256) | st.text(max_size=256).map(str.encode))
def test_receive_never_raises_on_arbitrary_bytes(frame: bytes) -> None:
    """Fuzz: whatever arrives, the core answers a Call or an error frame."""
    for encoding in Encoding:
        out = make(encoding).receive(frame)
        assert isinstance(out, Call | bytes)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["type", "data", "id", "x"]),
        st.none()
        | st.integers()
        | st.text(max_size=8)
        | st.lists(st.integers(), max_size=3)
        | st.sampled_from(["reset", "step", "state", "close"]),
    )
)
def test_receive_never_raises_on_arbitrary_objects(obj: dict[str, object]) -> None:
    p = make()
    out = p.receive(msgspec.json.encode(obj))
    assert isinstance(out, Call | bytes)


# -- hostile frames: each is answered with an error reply, and the session lives on ----------

#: Longer fuzzing by hand: STADIUM_FUZZ_EXAMPLES=200000 pytest tests/test_protocol.py -k fuzz
FUZZ_EXAMPLES = int(os.environ.get("STADIUM_FUZZ_EXAMPLES", "400"))

_DEEP_JSON = b"[" * 5000 + b"]" * 5000
_DEEP_MSGPACK = b"\x91" * 5000 + b"\x01"
_MP_RESET_HEAD = b"\x83\xa4type\xa5reset\xa2id\x07\xa4data"
_MP_STEP_HEAD = b"\x83\xa4type\xa4step\xa2id\x07\xa4data"

HOSTILE = [
    (Encoding.JSON, b'{"type":"step","id":7,"data":' + _DEEP_JSON + b"}", "INVALID_JSON"),
    (
        Encoding.JSON,
        b'{"type":"reset","id":7,"data":{"options":' + _DEEP_JSON + b"}}",
        "INVALID_JSON",
    ),
    (Encoding.JSON, b'{"type":"reset","id":7,"data":{"seed":1e999}}', "VALIDATION_ERROR"),
    (Encoding.JSON, b'{"type":"reset","id":7,"data":{"x":"\xff\xfe"}}', "INVALID_JSON"),
    (Encoding.JSON, b'{"type":"step","id":7,"data":{"message":"\xff"}}', "INVALID_JSON"),
    (Encoding.MSGPACK, _MP_RESET_HEAD + _DEEP_MSGPACK, "INVALID_JSON"),
    (Encoding.MSGPACK, _MP_STEP_HEAD + _DEEP_MSGPACK, "INVALID_JSON"),
    # a map whose key is a map (unhashable in Python) as reset data and as an action
    (Encoding.MSGPACK, _MP_RESET_HEAD + b"\x81\x81\x01\x01\x01", "INVALID_JSON"),
    (Encoding.MSGPACK, _MP_STEP_HEAD + b"\x81\x81\x01\x01\x01", "VALIDATION_ERROR"),
]


def _decode(encoding: Encoding, reply: bytes) -> dict[str, object]:
    if encoding is Encoding.JSON:
        frame: dict[str, object] = msgspec.json.decode(reply)
    else:
        frame = msgspec.msgpack.decode(reply)
    return frame


@pytest.mark.parametrize(("encoding", "frame", "code"), HOSTILE)
def test_hostile_frames_get_error_replies_and_the_session_lives_on(
    encoding: Encoding, frame: bytes, code: str
) -> None:
    p = make(encoding)
    enc = msgspec.json.encode if encoding is Encoding.JSON else msgspec.msgpack.encode
    assert isinstance(p.receive(enc({"type": "reset"})), Call)
    p.observation_reply(Call(Op.RESET, episode_id="e"), EchoObservation("hi"))
    out = p.receive(frame)
    assert isinstance(out, bytes), out
    reply = _decode(encoding, out)
    assert reply["type"] == "error"
    data = reply["data"]
    assert isinstance(data, dict)
    assert data["code"] == code
    assert "Traceback" not in str(data["message"])
    if code == "VALIDATION_ERROR":
        assert reply.get("id") == 7  # the id was readable: it is echoed
    again = p.receive(enc({"type": "step", "data": {"message": "still here"}}))
    assert isinstance(again, Call)
    assert again.action == EchoEnv.action_type("still here")


_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=20,
)


@st.composite
def _frames(draw: st.DrawFn) -> bytes:
    """A frame close to valid, then perhaps damaged: the inputs that reach deep code paths."""
    obj: dict[str, object] = {
        "type": draw(st.sampled_from(["reset", "step", "state", "close", "x"]))
    }
    if draw(st.booleans()):
        obj["id"] = draw(st.integers(min_value=-(2**63), max_value=2**63 - 1) | st.text(max_size=4))
    if draw(st.booleans()):
        obj["data"] = draw(
            _json_values
            | st.fixed_dictionaries({"message": _json_values})
            | st.fixed_dictionaries({"seed": _json_values, "options": _json_values})
        )
    raw = bytearray(msgspec.json.encode(obj))
    for _ in range(draw(st.integers(0, 3))):  # damage: insert, overwrite or cut bytes
        pos = draw(st.integers(0, len(raw)))
        what = draw(st.sampled_from(["insert", "overwrite", "cut"]))
        junk = draw(st.binary(min_size=1, max_size=4))
        if what == "insert":
            raw[pos:pos] = junk
        elif what == "overwrite":
            raw[pos : pos + len(junk)] = junk
        else:
            del raw[pos : pos + len(junk)]
    return bytes(raw)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(_frames(), st.sampled_from(list(Encoding)))
def test_fuzz_near_valid_frames_always_get_a_call_or_an_error_frame(
    frame: bytes, encoding: Encoding
) -> None:
    """Coverage-guided by hypothesis: frames near the valid ones, damaged; the allowed outcomes
    are a Call or an error frame, whatever the encoding, and the session answers afterwards."""
    p = make(encoding)
    p.state = SessionState.READY
    if encoding is Encoding.MSGPACK:  # the same value, re-encoded when it is still JSON
        with contextlib.suppress(msgspec.DecodeError, RecursionError, ValueError, OverflowError):
            frame = msgspec.msgpack.encode(msgspec.json.decode(frame))
    out = p.receive(frame)
    if isinstance(out, bytes):
        assert _decode(encoding, out)["type"] == "error"
    else:
        assert isinstance(out, Call)
    p.state = SessionState.READY
    enc = msgspec.json.encode if encoding is Encoding.JSON else msgspec.msgpack.encode
    assert isinstance(p.receive(enc({"type": "state"})), Call)
