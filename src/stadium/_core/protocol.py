"""The session protocol core: messages in, calls and reply frames out. No I/O, no clocks.

Wire format (OpenEnv's, see docs/PROTOCOL.md)::

    client → {"type": "reset", "data": {"seed": 1, ...}, "id": 7}
             {"type": "step",  "data": {<action>}}
             {"type": "state"} | {"type": "close"}
             {"type": "mcp", "data": {<JSON-RPC request>}}    (tools: see _mcp)
             {"type": "fork"}                                  (Stadium's: see _resume)
    server → {"type": "observation", "data": {"observation": {...}, "reward": r, "done": d}}
             {"type": "state", "data": {"episode_id": ..., "step_count": ..., ...}}
             {"type": "error", "data": {"message": ..., "code": ...}}
             {"type": "mcp", "data": {<JSON-RPC response>}}
             {"type": "forked", "data": {"session": ..., "token": ..., ...}}

``id`` is Stadium's extension: when a request carries one, the reply echoes it.
A step may carry ``"timeout_s": 30.0`` (OpenEnv's HTTP field): its own time limit.

A transport feeds each complete WebSocket message to :meth:`SessionProtocol.receive`,
which returns either a :class:`Call` to carry out on the environment or the bytes
of an error reply. Once the call is done the transport asks for the reply frame
(:meth:`~SessionProtocol.observation_reply`, :meth:`~SessionProtocol.state_reply`,
:meth:`~SessionProtocol.error_reply`). The protocol tracks the episode id and
step count, and the session lifecycle (:class:`SessionState`).

This is the server's side; the client's is :mod:`stadium._core.client`. Both read and
write the frames of :mod:`stadium._core.frames` (``Request``, ``BatchCall``,
``BatchFrame``, ``Reply``, ``BatchReply``), and resume's payloads of
:mod:`stadium._core.resume`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import msgspec

from stadium._core.frames import (
    BatchCall,
    BatchFrame,
    BatchReply,
    ClosedData,
    Reply,
    Request,
    RequestId,
)
from stadium._core.resume import ForkedData, ResumedData
from stadium._env.codecs import enc_hook_default, unreadable_detail, validation_error
from stadium._env.contract import StepResult
from stadium._env.cost import EpisodeCost
from stadium._env.spec import EnvSpec
from stadium._errors import (
    InvalidMessageError,
    SessionClosedError,
    SessionError,
    StadiumError,
    UnknownTypeError,
)
from stadium._errors import ValidationError as StadiumValidationError

#: WebSocket subprotocol that switches a session to MessagePack frames.
MSGPACK_SUBPROTOCOL = "stadium.msgpack"
#: WebSocket subprotocols of a batch connection (many sessions, batch frames; ``batch``).
BATCH_SUBPROTOCOL = "stadium.batch"
BATCH_MSGPACK_SUBPROTOCOL = "stadium.batch.msgpack"
#: Version of the wire protocol (OpenEnv's frames plus Stadium's extensions).
PROTOCOL_VERSION = "1.0"


class Encoding(enum.Enum):
    """How a session's frames are encoded."""

    JSON = "json"
    MSGPACK = "msgpack"


class Op(enum.IntEnum):
    """The requests a client can make."""

    RESET = 1
    STEP = 2
    STATE = 3
    CLOSE = 4
    MCP = 5
    """A JSON-RPC request for the env's tools (``mcp``), in ``data``."""
    FORK = 6
    """A new session from this one's snapshot (Stadium's; see ``resume``)."""


class SessionState(enum.IntEnum):
    """Lifecycle of one session, as the protocol sees it."""

    NEW = 0
    """Admitted; no episode yet (``step`` is refused until ``reset``)."""
    READY = 1
    """An episode is running."""
    CLOSED = 2
    """``close`` was received or the session was ended; no more requests."""


_OPS = {
    "reset": Op.RESET,
    "step": Op.STEP,
    "state": Op.STATE,
    "close": Op.CLOSE,
    "mcp": Op.MCP,
    "fork": Op.FORK,
}


RawCall = BatchCall[msgspec.Raw]
"""A batch call as the server decodes it: its ``data`` still bytes."""

_RESET_KEYS = frozenset({"seed", "episode_id", "options"})


class _NoKwargs(Mapping[str, Any]):
    """An empty, immutable, hashable mapping: a dataclass default Python 3.11 accepts
    (it refuses an unhashable one such as ``MappingProxyType``)."""

    def __getitem__(self, key: str) -> Any:
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0

    def __hash__(self) -> int:
        return 0


_NO_KWARGS: Mapping[str, Any] = _NoKwargs()


class Call(msgspec.Struct):
    """One request the session must carry out on its environment (a struct: built in C,
    once per request — measured, a dataclass's ``__init__`` was a Python call per step)."""

    op: Op
    id: RequestId = None
    action: Any = None
    seed: int | None = None
    options: dict[str, Any] | None = None
    episode_id: str | None = None
    client_episode_id: bool = False
    """Whether ``episode_id`` came from the client (else the server made it)."""
    timeout_s: float | None = None
    """A step's own time limit (OpenEnv's ``timeout_s``; the smaller of it and
    ``--step-timeout`` applies)."""
    reset_kwargs: Mapping[str, Any] = _NO_KWARGS
    """A reset's keyword arguments for ``env.reset``: ``seed``, ``options`` and, when
    the client chose it and the env's ``reset`` accepts it, ``episode_id``."""


def reset_call(
    rid: RequestId,
    data: Any,
    new_episode_id: Callable[[], str],
    *,
    takes_episode_id: bool,
    where: str = "$.data",
) -> Call:
    """The :class:`Call` of a reset whose arguments are ``data`` (decoded JSON/MessagePack).

    The one reading of reset arguments, for WebSocket and HTTP alike: ``seed``
    (an integer or null), ``episode_id`` (a string) and ``options`` (an object);
    any other key is an option too, merged under the explicit ``options`` (which
    win on a clash), so ``{"seed": 1, "level": 2}`` and ``{"seed": 1, "options":
    {"level": 2}}`` mean the same. ``where`` is the JSON path of ``data`` in the
    request, for error messages; ``takes_episode_id`` says whether the env's
    ``reset`` accepts ``episode_id`` (OpenEnv's signature filtering).

    Raises:
        ValidationError: naming the offending field.
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise StadiumValidationError(
            'reset data must be an object such as {"seed": 1}', field=where
        )
    seed = data.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise StadiumValidationError(
            f"seed must be an integer or null, got {seed!r}", field=f"{where}.seed"
        )
    episode_id = data.get("episode_id")
    if episode_id is not None and not isinstance(episode_id, str):
        raise StadiumValidationError(
            f"episode_id must be a string, got {episode_id!r}", field=f"{where}.episode_id"
        )
    options = data.get("options")
    if options is not None and not isinstance(options, dict):
        raise StadiumValidationError(
            f"options must be an object, got {options!r}", field=f"{where}.options"
        )
    extra = {k: v for k, v in data.items() if k not in _RESET_KEYS}
    if extra:
        options = {**extra, **(options or {})}
    kwargs: dict[str, Any] = {"seed": seed, "options": options}
    if episode_id and takes_episode_id:
        kwargs["episode_id"] = episode_id
    return Call(
        Op.RESET,
        rid,
        seed=seed,
        options=options,
        episode_id=episode_id or new_episode_id(),
        client_episode_id=bool(episode_id),
        reset_kwargs=kwargs,
    )


class SessionProtocol:
    """The protocol state of one session (one WebSocket connection).

    Args:
        spec: the environment's compiled spec (decoders, encoders).
        encoding: JSON (OpenEnv's) or MessagePack (negotiated subprotocol).
        new_episode_id: makes an episode id when ``reset`` does not bring one.
    """

    __slots__ = (
        "_action_decoder",
        "_encode",
        "_envelope_decoder",
        "_info_prefix",
        "_new_episode_id",
        "_raw_decode",
        "encoding",
        "ended",
        "episode_id",
        "last_error",
        "spec",
        "state",
        "step_count",
    )

    def __init__(
        self,
        spec: EnvSpec,
        encoding: Encoding,
        new_episode_id: Callable[[], str],
    ) -> None:
        self.spec = spec
        self.encoding = encoding
        self.state = SessionState.NEW
        self.episode_id: str | None = None
        self.step_count = 0
        self.last_error: str | None = None
        """Code of the last error reply made (for counters)."""
        self.ended: Any = False
        """Whether the last observation reply made ended its episode (``done``, which
        ``truncated`` implies): the session then adds the episode's cost to it."""
        self._new_episode_id = new_episode_id
        self._info_prefix = b',"' + spec.info_key.encode() + b'":'
        if encoding is Encoding.JSON:
            self._envelope_decoder: Any = _JSON_ENVELOPE
            self._action_decoder: Any = spec.action.json_decoder
            self._raw_decode: Callable[[Any], Any] = msgspec.json.decode
            self._encode: Callable[[Any], bytes] = spec.json_encoder.encode
        else:
            self._envelope_decoder = _MSGPACK_ENVELOPE
            self._action_decoder = spec.action.msgpack_decoder
            self._raw_decode = msgspec.msgpack.decode
            self._encode = spec.msgpack_encoder.encode

    # -- input ---------------------------------------------------------------

    def receive(self, message: bytes | str | RawCall) -> Call | bytes:
        """Decode one message: a :class:`Call` to carry out, or an error reply's bytes.

        Never raises for what the peer sent: any message that cannot be read
        (bad encoding, invalid UTF-8, nesting deeper than the decoder allows,
        numbers out of range, values a validator rejects) gets an error reply
        that says what was wrong, echoing the request id when it could be read,
        and the session stays usable.
        """
        if self.state is SessionState.CLOSED:
            return self.error_reply(None, SessionClosedError("the session is closed"))
        if message.__class__ is BatchCall:  # decoded already, with its batch frame
            envelope: Request[msgspec.Raw] = message
        else:
            try:
                envelope = self._envelope_decoder.decode(message)
            except msgspec.ValidationError as exc:
                return self.error_reply(None, self._envelope_error(exc))
            except Exception as exc:
                return self.error_reply(None, self._unreadable(exc))
        op = _OPS.get(envelope.type)
        rid = envelope.id
        if op is None:
            return self.error_reply(
                rid,
                UnknownTypeError(
                    f"Unknown message type: {envelope.type!r}; expected one of "
                    "reset, step, state, close, mcp, fork",
                    type=envelope.type,
                ),
            )
        try:
            if op is Op.STEP:
                if self.state is not SessionState.READY and not self.spec.step_before_reset:
                    raise SessionError("no episode is running: send reset before step")
                return Call(
                    op, rid, action=self._decode_action(envelope.data), timeout_s=envelope.timeout_s
                )
            if op is Op.RESET:
                raw = envelope.data
                return reset_call(
                    rid,
                    self._raw_decode(raw) if raw else None,
                    self._new_episode_id,
                    takes_episode_id=self.spec.reset_takes_episode_id,
                )
            if op is Op.CLOSE:
                self.state = SessionState.CLOSED
            elif op is Op.MCP:  # the JSON-RPC request, decoded; _mcp validates it
                raw = envelope.data
                return Call(op, rid, action=self._raw_decode(raw) if raw else None)
            return Call(op, rid)
        except StadiumError as exc:
            return self.error_reply(rid, exc)
        except msgspec.ValidationError as exc:  # e.g. a number out of range in reset data
            return self.error_reply(rid, validation_error(exc, f"{envelope.type} data"))
        except Exception as exc:
            return self.error_reply(rid, self._unreadable(exc))

    def request_id(self, message: bytes | str | RawCall) -> RequestId:
        """The ``id`` of a request not carried out (e.g. refused by a rate limit), if readable."""
        if message.__class__ is BatchCall:
            return message.id
        try:
            rid: RequestId = self._envelope_decoder.decode(message).id
        except Exception:
            return None
        return rid

    def is_close(self, message: bytes | str | RawCall) -> bool:
        """Whether ``message`` asks to close the session (read only when it matters: a
        request over the rate limit; a close is let through so a client held back by
        ``--rate-limit`` can still end its session)."""
        if message.__class__ is BatchCall:
            return _OPS.get(message.type) is Op.CLOSE
        try:
            kind = self._envelope_decoder.decode(message).type
        except Exception:
            return False
        return _OPS.get(kind) is Op.CLOSE

    def _unreadable(self, exc: Exception) -> StadiumError:
        """The error for a message the decoders (or a validator) could not read."""
        kind = "JSON" if self.encoding is Encoding.JSON else "MessagePack"
        detail = unreadable_detail(exc)
        return InvalidMessageError(f"Invalid {kind}: {detail}", encoding=self.encoding.value)

    def _envelope_error(self, exc: msgspec.ValidationError) -> StadiumError:
        text = str(exc)
        if text.endswith("`$.type`"):
            return UnknownTypeError(f"Invalid message type: {text}", field="$.type")
        if text.endswith("`$.id`"):
            return validation_error(exc, "request id")
        if text.endswith("`$.timeout_s`"):
            return validation_error(exc, "timeout_s")
        return InvalidMessageError(f"Invalid message: a frame must be an object ({text})")

    def step_call(self, envelope: RawCall) -> Call | None:
        """The step :class:`Call` of a batch's call, the short way (``batch``): ``None``
        unless an episode runs and the call is a plain step with a valid action (then
        :meth:`receive` answers it, errors included)."""
        if self.state is not SessionState.READY or envelope.type != "step":
            return None
        if envelope.timeout_s is not None or not envelope.data:
            return None
        try:
            return Call(Op.STEP, envelope.id, self._action_decoder.decode(envelope.data))
        except Exception:
            return None

    def _decode_action(self, raw: msgspec.Raw) -> Any:
        if not raw:
            raise StadiumValidationError(
                'step needs an action in "data"; see GET /schema for its shape', field="$.data"
            )
        try:
            return self._action_decoder.decode(raw)
        except msgspec.ValidationError as exc:
            raise validation_error(exc, "action") from None

    # -- output --------------------------------------------------------------

    def observation_reply(self, call: Call, result: Any) -> bytes:
        """The reply to a successful reset or step; advances the episode counters."""
        if call.op is Op.RESET:
            self.state = SessionState.READY
            self.episode_id = call.episode_id
            self.step_count = 0
        else:
            self.step_count += 1
        if isinstance(result, StepResult):
            obs, reward, done = result.observation, result.reward, result.done
            truncated, info = result.truncated, result.info
        else:
            obs, reward, done, truncated, info = result, None, False, False, None
        self.ended = done
        if self.encoding is Encoding.JSON:
            enc = self._encode
            parts = [
                b'{"type":"observation","data":{"observation":',
                enc(obs),
                b',"reward":',
                enc(reward),
                b',"done":true' if done else b',"done":false',
            ]
            if truncated:
                parts.append(b',"truncated":true')
            if info:
                parts.append(self._info_prefix)
                parts.append(enc(info))
            parts.append(b"}")
            rid = call.id
            if rid is None:
                parts.append(b"}")
            elif type(rid) is int:  # a Stadium client's call number: no encoder call
                parts.append(b',"id":%d}' % rid)
            else:
                parts.append(b',"id":' + enc(rid) + b"}")
            return b"".join(parts)
        data: dict[str, Any] = {"observation": obs, "reward": reward, "done": done}
        if truncated:
            data["truncated"] = True
        if info:
            data[self.spec.info_key] = info
        return self._frame("observation", data, call.id)

    def state_reply(self, call: Call, state: Any) -> bytes:
        """The reply to ``state``: the env's state with episode id and step count filled in."""
        data = msgspec.to_builtins(state, enc_hook=enc_hook_default)
        if not isinstance(data, dict):
            data = {"value": data}
        if data.get("episode_id") is None:
            data["episode_id"] = self.episode_id
        if not data.get("step_count"):
            data["step_count"] = self.step_count
        return self._frame("state", data, call.id)

    def mcp_reply(self, call: Call, response: Any) -> bytes:
        """The reply to an ``mcp`` request: ``{"type": "mcp", "data": <JSON-RPC response>}``."""
        return self._frame("mcp", response, call.id)

    def forked_reply(self, call: Call, data: ForkedData) -> bytes:
        """The reply to ``fork``: the new session's id and resume token (``resume``)."""
        return self._frame("forked", data, call.id)

    def closed_reply(self, code: int, reason: str) -> bytes:
        """A batch's result for a call on a session that is closed (``batch``)."""
        return self._frame("closed", ClosedData(code, reason), None)

    def resumed_reply(self, data: ResumedData[msgspec.Raw]) -> bytes:
        """The first frame on a resumed session's new connection (``resume``), or a batch
        session's ``resume`` result (its ``replies``: the encoded replies it missed)."""
        return self._frame("resumed", data, None)

    def batch_reply(
        self,
        rid: RequestId,
        results: list[bytes],
        opened: list[tuple[int, str, str]] | None,
        index: list[int] | None = None,
        done: bool | None = None,
    ) -> bytes:
        """A batch's reply frame (``batch``): ``results``, each an encoded reply, in call
        order; with ``first``, the ``index`` of each in the batch and whether it is
        ``done``; ``opened``: the resumable sessions the batch opened."""
        if self.encoding is Encoding.JSON:  # the results spliced in as they are
            enc = msgspec.json.encode
            parts = [b'{"type":"batch","id":', enc(rid), b',"results":[', b",".join(results)]
            parts.append(b"]" if index is None else b'],"index":' + enc(index))
            if opened:
                parts.append(b',"opened":' + enc(opened))
            if done is not None:
                parts.append(b',"done":true' if done else b',"done":false')
            parts.append(b"}")
            return b"".join(parts)
        return _MSGPACK.encode(
            BatchReply("batch", rid, results=[msgspec.Raw(r) for r in results], index=index,
                       opened=opened or None, done=done)
        )  # fmt: skip

    def error_reply(self, rid: RequestId | Call, error: StadiumError) -> bytes:
        """An error frame carrying ``error``'s code, message and context."""
        if isinstance(rid, Call):
            rid = rid.id
        self.last_error = str(error.code)
        return self._frame("error", error.to_wire(), rid)

    def with_cost(self, frame: bytes, cost: EpisodeCost) -> bytes:
        """``frame`` (a reply this protocol encoded) with ``cost`` as its top-level ``cost``
        (docs/PROTOCOL.md, "Episode cost"): spliced before the JSON object's closing brace,
        or the MessagePack map re-encoded (once per episode)."""
        if self.encoding is Encoding.JSON:
            return frame[:-1] + b',"cost":' + _COST_JSON.encode(cost) + b"}"
        data = msgspec.msgpack.decode(frame)
        data["cost"] = msgspec.to_builtins(cost)
        return _MSGPACK.encode(data)

    def close(self) -> None:
        """Mark the session closed (the connection is gone or the server ended it)."""
        self.state = SessionState.CLOSED

    def _frame(self, kind: str, data: Any, rid: RequestId) -> bytes:
        return self._encode(Reply(kind, data, rid))


_MSGPACK = msgspec.msgpack.Encoder()
_COST_JSON = msgspec.json.Encoder()
_JSON_ENVELOPE = msgspec.json.Decoder(Request[msgspec.Raw])
_MSGPACK_ENVELOPE = msgspec.msgpack.Decoder(Request[msgspec.Raw])
#: The server's decoders of batch frames (``batch``).
JSON_BATCH_FRAME = msgspec.json.Decoder(BatchFrame[msgspec.Raw])
MSGPACK_BATCH_FRAME = msgspec.msgpack.Decoder(BatchFrame[msgspec.Raw])

__all__ = [
    "BATCH_MSGPACK_SUBPROTOCOL",
    "BATCH_SUBPROTOCOL",
    "JSON_BATCH_FRAME",
    "MSGPACK_BATCH_FRAME",
    "MSGPACK_SUBPROTOCOL",
    "PROTOCOL_VERSION",
    "BatchCall",
    "BatchFrame",
    "Call",
    "Encoding",
    "Op",
    "RawCall",
    "RequestId",
    "SessionProtocol",
    "SessionState",
    "reset_call",
]
