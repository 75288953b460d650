"""Every message between a worker and its env processes: names, shapes, limits, frames.

The one module both sides use (the worker's :mod:`.worker.isolation`, :mod:`.proc`, :mod:`.proxy`;
the template's and sessions' :mod:`.child`). Each message is a tagged, array-like
:class:`msgspec.Struct` (MessagePack ``[tag, field, ...]``); each side decodes what it
reads into the type it expects, and dispatches on that type.

A session's socket (``SOCK_STREAM``) carries frames of a 4-byte little-endian length and
a MessagePack body: a request from the worker, then its reply, one at a time. The
template's control socket is ``SOCK_SEQPACKET`` (one message per packet; a new session's
socket attached to its ``spawned`` packet), so it needs no length.

Requests (worker → env process; the worker is trusted, so decoded plainly):
:class:`Reset`, :class:`Step`, :class:`GetState`, :class:`ListTools`,
:class:`CallTool`, :class:`Restore`, :class:`Fork` (answered with the new process's
socket attached) and :class:`Close`. ``snap`` (``--durable``) asks for the env's
snapshot with a reset's or step's reply, at most that many bytes (else the reason
as text). Replies (env process → worker): a session's process first sends
:class:`Hello`; then :class:`StepOk` (reset, step), :class:`ValueOk` (state,
``tools/call``), :class:`ToolsOk` (``tools/list``), :class:`Done` (restore, fork, close),
or :class:`Raised` (the env raised). The control socket: the worker sends
:class:`Spawn`; the template sends :class:`Ready` or :class:`Failed` once, then
:class:`Spawned` and :class:`Exit` (the native init writes ``Exit`` itself:
``native/stadium-init``).

Nothing from an env process is trusted (it runs the env's, or a policy's, code): a reply
is read into a buffer no larger than its frame, and only a frame within
:class:`WireLimits` is decoded, into the type its request expects
(:meth:`WireLimits.decode`). A frame of at most :data:`DIRECT_BYTES` is decoded directly
(the worst it can cost, an array of empty maps, is ~72 bytes a byte: under 5 MiB);
a larger one is first scanned (:func:`scan`: element count, depth and the decoded
values' size, estimated from CPython's object sizes, stopping at the first limit
broken; string and binary payloads skipped in O(1), runs of one-byte and float
elements counted at C speed). Anything else is refused with
:class:`~stadium.EnvProtocolError` naming the limit.
"""

from __future__ import annotations

import dataclasses
import socket
import struct
from typing import Annotated, Any, Final

import msgspec

from stadium._errors import ConfigError, EnvProtocolError

HEADER = struct.Struct("<I")
_SIZE = HEADER.unpack_from
MIB = 1024 * 1024
#: A request's largest frame (worker → env process; an action, a snapshot to restore).
MAX_REQUEST = 256 * MIB
#: Bytes an env process reads of the worker's requests at a time (:class:`FrameReader`).
CHUNK_BYTES = 64 * 1024
#: Replies this size or smaller are decoded without a scan (see the module docstring).
DIRECT_BYTES = 64 * 1024
#: The most of an env's exception message the worker keeps (:attr:`Raised.said`).
MESSAGE_CHARS = 8192
#: Bits of a sandboxed process's key holding its pid (pid_max is at most 2**22).
KEY_SHIFT = 22


# -- requests: worker -> env process ---------------------------------------------------


class Reset(msgspec.Struct, array_like=True, tag="reset"):
    kwargs: dict[str, Any]
    snap: int = 0
    """``--durable``: the env's snapshot with the reply, at most this many bytes (0: none)."""


class Step(msgspec.Struct, array_like=True, tag="step"):
    action: bytes
    """The action, MessagePack (the env spec's encoding)."""
    kwargs: dict[str, Any]
    snap: int = 0


class GetState(msgspec.Struct, array_like=True, tag="state"):
    pass


class ListTools(msgspec.Struct, array_like=True, tag="tools"):
    pass


class CallTool(msgspec.Struct, array_like=True, tag="call_tool"):
    name: str
    arguments: Any


class Restore(msgspec.Struct, array_like=True, tag="restore"):
    snapshot: bytes


class Fork(msgspec.Struct, array_like=True, tag="fork"):
    pass


class Close(msgspec.Struct, array_like=True, tag="close"):
    pass


class Describe(msgspec.Struct, array_like=True, tag="describe"):
    """``--untrusted-env-code``: the env's description (its module loaded in the sandbox)."""


Request = Reset | Step | GetState | ListTools | CallTool | Restore | Fork | Close | Describe

# -- replies: env process -> worker ------------------------------------------------------

OK: Final = 0
RAISED: Final = 1
HELLO: Final = 2


class Go(msgspec.Struct, frozen=True, array_like=True, tag="go"):
    """``--isolation vm``: a restored guest may build its env and serve; ``seed``: fresh
    entropy for its kernel's pool and Python's ``random`` (clones of one snapshot)."""

    seed: bytes


class Hello(msgspec.Struct, array_like=True, tag=HELLO):
    """A session's process is ready (its env built, or why not in the next reply)."""


class Raised(msgspec.Struct, array_like=True, tag=RAISED):
    """The env raised: the exception's type name and message, and a Stadium error's wire
    form (its code and context)."""

    exception: Annotated[str, msgspec.Meta(max_length=200, pattern=r"^[^\W\d]\w*$")]
    """A class name (an identifier: no text a log line or an error reply would carry
    otherwise); anything else is refused as ``type``."""
    message: str
    data: dict[str, Any] | None = None

    @property
    def said(self) -> str:
        """The message, at most :data:`MESSAGE_CHARS` characters (it goes into an error reply
        and the log; its frame may be as large as any reply), the cut said."""
        text = self.message
        if len(text) <= MESSAGE_CHARS:
            return text
        return f"{text[:MESSAGE_CHARS]}... ({len(text) - MESSAGE_CHARS} characters cut)"


class StepOk(msgspec.Struct, array_like=True, tag=OK):
    """A reset's or step's result; ``--durable``: ``snapshot``, the env's snapshot taken
    after the call, or ``unsnapshotted``, why there is none."""

    observation: Any
    reward: int | float | None
    done: bool
    truncated: bool
    info: Any
    snapshot: memoryview | None = None
    unsnapshotted: str | None = None


class ValueOk(msgspec.Struct, array_like=True, tag=OK):
    value: Any


class ToolsOk(msgspec.Struct, array_like=True, tag=OK):
    tools: list[dict[str, Any]]


class Done(msgspec.Struct, array_like=True, tag=OK):
    pass


class DescribeOk(msgspec.Struct, array_like=True, tag=OK):
    """The env's :class:`~stadium._server.isolation.remote.Description`, MessagePack (decoded
    by the worker with that module's own limits)."""

    description: bytes


# -- the control socket ------------------------------------------------------------------


class Image(msgspec.Struct, array_like=True, frozen=True):
    """A task image, ready: its ``ref``, its layers (absolute folders, bottom first, as
    overlayfs lower layers), the environment and working directory of its config."""

    ref: str
    layers: list[str]
    env: dict[str, str]
    workdir: str = "/"


class Spawn(msgspec.Struct, array_like=True, tag="spawn"):
    """Worker → template: fork a session's process (``hosts``: its ``/etc/hosts``;
    ``image``: the task image that is its root, :mod:`.rootfs`)."""

    cgroups: list[str]
    uid: int
    hosts: str | None = None
    image: Image | None = None


class Ready(msgspec.Struct, array_like=True, tag="ready"):
    pid: int
    seccomp: str | None = None
    """The seccomp filter's description (``None``: no filter)."""
    init: str | None = None
    """The native init it runs, from a sealed memfd copy (``None``: not built, or others may
    write it, or no executable memfd here)."""


class Failed(msgspec.Struct, array_like=True, tag="failed"):
    reason: str


class Spawned(msgspec.Struct, array_like=True, tag="spawned"):
    key: int


class Exit(msgspec.Struct, array_like=True, tag="exit"):
    key: int
    status: int


Control = Ready | Failed | Spawned | Exit

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_spawn_decoder = msgspec.msgpack.Decoder(Spawn)
_control_decoder = msgspec.msgpack.Decoder(Control)

# What the worker expects back, by request (each a decoder of that type only).
HELLO_REPLY: msgspec.msgpack.Decoder[Hello | Raised] = msgspec.msgpack.Decoder(Hello | Raised)
STEP_REPLY: msgspec.msgpack.Decoder[StepOk | Raised] = msgspec.msgpack.Decoder(StepOk | Raised)
VALUE_REPLY: msgspec.msgpack.Decoder[ValueOk | Raised] = msgspec.msgpack.Decoder(ValueOk | Raised)
TOOLS_REPLY: msgspec.msgpack.Decoder[ToolsOk | Raised] = msgspec.msgpack.Decoder(ToolsOk | Raised)
DONE_REPLY: msgspec.msgpack.Decoder[Done | Raised] = msgspec.msgpack.Decoder(Done | Raised)
DESCRIBE_REPLY: msgspec.msgpack.Decoder[DescribeOk | Raised] = msgspec.msgpack.Decoder(
    DescribeOk | Raised
)


def encode(msg: msgspec.Struct) -> bytes:
    """A message's MessagePack body."""
    return _encoder.encode(msg)


decode_request = _request_decoder.decode
"""A request (the env process's side; a bound method, no frame of its own); raises
:class:`msgspec.DecodeError` for anything else (only a worker bug sends that)."""


def decode_spawn(packet: bytes) -> Spawn:
    """A ``spawn`` packet (the template's side)."""
    return _spawn_decoder.decode(packet)


def decode_control(packet: bytes) -> Ready | Failed | Spawned | Exit:
    """A packet of the template's control socket, typed.

    Raises:
        EnvProtocolError: it is no control message (``limit``: ``type``).
    """
    try:
        return _control_decoder.decode(packet)  # type: ignore[no-any-return]
    except Exception as exc:  # a packet is at most 64 KiB: decoded directly
        raise _refused("type", 0, f"not a control message ({_describe(exc)})") from None


def frame(body: bytes) -> bytes:
    """``body`` with its length in front."""
    return HEADER.pack(len(body)) + body


def recv_frame(sock: socket.socket) -> bytes | None:
    """The next frame's body from a blocking socket (the env process's side, reading
    the worker's requests); ``None`` at end of stream."""
    head = _recv_exact(sock, HEADER.size)
    if head is None:
        return None
    (size,) = HEADER.unpack(head)
    if size > MAX_REQUEST:
        raise ValueError(f"frame of {size} bytes is over the {MAX_REQUEST} byte limit")
    return _recv_exact(sock, size) if size else b""


class FrameReader:
    """The frames of a blocking socket (the env process's side, reading the worker's
    requests), read up to :data:`CHUNK_BYTES` at a time: a small request's header and body
    take one ``recv``, not two; a larger one's rest goes straight into a buffer of its size."""

    __slots__ = ("rest", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.rest = b""
        """Bytes read past the last frame returned (the start of the next one)."""

    def next(self, first: bytes | None = None) -> bytes | bytearray | memoryview | None:
        """The next frame's body; ``None`` at end of stream. ``first``: what the caller
        read from the socket itself (``b""``: end of stream), when :attr:`rest` was empty."""
        buf = self.rest
        if first is not None:
            if not first:
                return None
            buf += first
        elif not buf:
            buf = self.sock.recv(CHUNK_BYTES)
            size = len(buf) - 4
            if size >= 0 and _SIZE(buf)[0] == size:  # the usual: one whole frame, one recv
                return memoryview(buf)[4:]
            if not buf:
                return None
        while len(buf) < HEADER.size:
            chunk = self.sock.recv(CHUNK_BYTES)
            if not chunk:
                return None
            buf += chunk
        (size,) = HEADER.unpack_from(buf)
        if size > MAX_REQUEST:
            raise ValueError(f"frame of {size} bytes is over the {MAX_REQUEST} byte limit")
        end = HEADER.size + size
        if len(buf) >= end:
            self.rest = buf[end:]
            return buf[HEADER.size : end]
        self.rest = b""
        body = bytearray(size)
        have = len(buf) - HEADER.size
        body[:have] = buf[HEADER.size :]
        view = memoryview(body)
        while have < size:
            n = self.sock.recv_into(view[have:])
            if n == 0:
                return None
            have += n
        return body


def _recv_exact(sock: socket.socket, size: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < size:
        chunk = sock.recv(size - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


# -- limits on what an env process sends --------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class WireLimits:
    """What one reply from an env process may cost its worker.

    Attributes:
        frame_bytes: the largest reply frame (read into a buffer of its size).
        decoded_bytes: the largest estimated size of a reply's decoded values.
        elements: the most MessagePack values in one reply.
        depth: the deepest nesting of arrays and maps in one reply.

    A session's replies then hold at most ``frame_bytes + decoded_bytes`` of its
    worker's memory at a time (one reply is read at a time; a frame of at most
    :data:`DIRECT_BYTES` costs under 5 MiB decoded).
    """

    frame_bytes: int = 64 * MIB
    decoded_bytes: int = 64 * MIB
    elements: int = 8 * MIB
    depth: int = 100

    def __post_init__(self) -> None:
        if self.frame_bytes < MIB or self.decoded_bytes < 8 * MIB:
            raise ConfigError(
                "--sandbox-reply-mib must be at least 8 (MiB a reply may take)",
                value=self.frame_bytes // MIB,
            )

    @classmethod
    def of_mib(cls, mib: int) -> WireLimits:
        """The limits of ``--sandbox-reply-mib``: frames and decoded values of ``mib`` MiB."""
        return cls(frame_bytes=mib * MIB, decoded_bytes=mib * MIB, elements=mib * MIB // 8)

    def decode(
        self, decoder: msgspec.msgpack.Decoder[Any], body: bytes | bytearray | memoryview
    ) -> Any:
        """``body`` decoded by ``decoder`` if it keeps within the limits.

        Raises:
            EnvProtocolError: only this; ``context["limit"]`` names what was broken
                (``frame_bytes``, ``decoded_bytes``, ``elements``, ``depth``;
                ``malformed``: not MessagePack; ``type``: not the expected message).
        """
        if len(body) > self.frame_bytes:
            raise frame_over(len(body), self.frame_bytes)
        if len(body) > DIRECT_BYTES:
            scan(body if not isinstance(body, memoryview) else body.tobytes(), self)
        try:
            return decoder.decode(body)
        except msgspec.ValidationError as exc:
            raise _refused("type", 0, f"not the reply expected ({exc})") from None
        except Exception as exc:  # DecodeError, RecursionError, ...: never anything else
            raise _refused("malformed", 0, f"not MessagePack ({_describe(exc)})") from None


def frame_over(size: int, limit: int) -> EnvProtocolError:
    """A reply frame of ``size`` bytes, over ``limit`` (refused by its header alone)."""
    return EnvProtocolError(
        f"a reply frame of {size} bytes, over the {limit} byte limit (frame_bytes, "
        "--sandbox-reply-mib)",
        limit="frame_bytes",
        value=limit,
    )


def _describe(exc: BaseException) -> str:
    text = str(exc)[:200]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _refused(limit: str, value: int, what: str) -> EnvProtocolError:
    """The error naming what was refused; :mod:`.proxy` says which call and what now."""
    return EnvProtocolError(f"{what} ({limit})", limit=limit, value=value)


def _over(limit: str, value: int) -> EnvProtocolError:
    what = _OVER[limit].format(value)
    return EnvProtocolError(f"{what} ({limit}, --sandbox-reply-mib)", limit=limit, value=value)


_OVER = {
    "decoded_bytes": "a reply whose values would take over {} bytes decoded",
    "elements": "a reply of over {} values",
    "depth": "a reply nested over {} deep",
}


# -- the scanner ---------------------------------------------------------------------------

# Estimated bytes of worker memory per decoded value (CPython 3.11+, 64-bit), its slot in
# its container included: a list is 56 + 8 a slot, a dict 64, and ~48 an item when not
# empty (at least 3: a small dict's table is 120 bytes); small ints,
# None and bools are shared; an int is 32, a float 24, a str 49 + its bytes (ASCII; else up
# to 4 a character), bytes 33 + its length; an extension type (msgspec's Ext) 64 + length.
_SLOT = 8
_LIST = 56
_DICT = 64
_PAIR = 48
_INT = 32
_FLOAT = 24
_STR = 49
_BIN = 33
_EXT = 64

# One-byte values: positive and negative fixints, nil, false, true, and the empty
# fixmap, fixarray and fixstr. Deleting them from a run leaves nothing when a run is
# made only of them (bytes.translate: C speed).
_ONE_BYTE = bytes([*range(0x00, 0x80), *range(0xE0, 0x100), 0xC0, 0xC2, 0xC3, 0x80, 0x90, 0xA0])

# (size of the length field, extra cost) of the bin/str/ext headers with a length field.
_SIZED: dict[int, tuple[int, int, int]] = {
    # byte: (length bytes, fixed cost, kind: 0 bin, 1 str, 2 ext needing a type byte)
    0xC4: (1, _BIN, 0), 0xC5: (2, _BIN, 0), 0xC6: (4, _BIN, 0),
    0xD9: (1, _STR, 1), 0xDA: (2, _STR, 1), 0xDB: (4, _STR, 1),
    0xC7: (1, _EXT, 2), 0xC8: (2, _EXT, 2), 0xC9: (4, _EXT, 2),
}  # fmt: skip
# Fixed-size scalars: byte -> (bytes after the type byte, cost).
_FIXED: dict[int, tuple[int, int]] = {
    0xCA: (4, _FLOAT), 0xCB: (8, _FLOAT),
    0xCC: (1, 0), 0xCD: (2, _INT), 0xCE: (4, _INT), 0xCF: (8, _INT),
    0xD0: (1, 0), 0xD1: (2, _INT), 0xD2: (4, _INT), 0xD3: (8, _INT),
    0xD4: (2, _EXT), 0xD5: (3, _EXT), 0xD6: (5, _EXT), 0xD7: (9, _EXT), 0xD8: (17, _EXT),
}  # fmt: skip
_UNPACK = {1: struct.Struct(">B"), 2: struct.Struct(">H"), 4: struct.Struct(">I")}


def scan(buf: bytes | bytearray, limits: WireLimits) -> int:
    """Check one MessagePack value in ``buf`` against ``limits`` without decoding it; the
    estimated bytes its decoded values take. Linear in the number of values (strings and
    binaries skipped whole), and stops at the first limit broken.

    Raises:
        EnvProtocolError: a limit is broken, or ``buf`` is not exactly one value.
    """
    end = len(buf)
    most_cost = limits.decoded_bytes
    most_elements = limits.elements
    most_depth = limits.depth
    stack: list[int] = []
    left = 1  # values still to read in the innermost open container
    i = elements = cost = 0
    while True:
        if left == 0:
            if not stack:
                break
            left = stack.pop()
            continue
        if cost > most_cost:
            raise _over("decoded_bytes", most_cost)
        if elements > most_elements:
            raise _over("elements", most_elements)
        if i >= end:
            raise _refused("malformed", 0, "a truncated MessagePack value")
        left -= 1
        elements += 1
        b = buf[i]
        if b < 0x80 or b >= 0xE0 or b in (0xC0, 0xC2, 0xC3):
            i += 1
            cost += _SLOT
            continue
        if 0x90 <= b <= 0x9F or b in (0xDC, 0xDD):  # array
            if b <= 0x9F:
                n, i = b & 0x0F, i + 1
            else:
                w = 2 if b == 0xDC else 4
                if i + 1 + w > end:
                    raise _refused("malformed", 0, "a truncated array header")
                (n,) = _UNPACK[w].unpack_from(buf, i + 1)
                i += 1 + w
            cost += _SLOT + _LIST + _SLOT * n
            if n == 0:
                continue
            run = _run(buf, i, n, end)
            if run is not None:  # n one-byte or float values: counted at C speed
                i, extra = run
                elements += n
                cost += extra
                continue
            if len(stack) >= most_depth:
                raise _over("depth", most_depth)
            stack.append(left)
            left = n
            continue
        if 0x80 <= b <= 0x8F or b in (0xDE, 0xDF):  # map
            if b <= 0x8F:
                n, i = b & 0x0F, i + 1
            else:
                w = 2 if b == 0xDE else 4
                if i + 1 + w > end:
                    raise _refused("malformed", 0, "a truncated map header")
                (n,) = _UNPACK[w].unpack_from(buf, i + 1)
                i += 1 + w
            cost += _SLOT + _DICT + _PAIR * max(n, 3) if n else _SLOT + _DICT
            if n == 0:
                continue
            if len(stack) >= most_depth:
                raise _over("depth", most_depth)
            stack.append(left)
            left = 2 * n
            continue
        if 0xA0 <= b <= 0xBF:  # fixstr: at most 31 bytes, counted as 4 a byte
            n = b & 0x1F
            cost += _SLOT + _STR + 4 * n
            i += 1 + n
            continue
        sized = _SIZED.get(b)
        if sized is not None:
            w, base, kind = sized
            if i + 1 + w > end:
                raise _refused("malformed", 0, "a truncated length")
            (n,) = _UNPACK[w].unpack_from(buf, i + 1)
            i += 1 + w + (kind == 2)  # an extension's type byte follows its length
            # A str's characters take 1 byte each when ASCII, up to 4 else (checked at C
            # speed); a binary's or an extension's bytes take their length.
            cost += _SLOT + base + (4 * n if kind == 1 and not buf[i : i + n].isascii() else n)
            i += n
            continue
        fixed = _FIXED.get(b)
        if fixed is None:  # 0xC1: never used
            raise _refused("malformed", 0, f"the reserved byte 0x{b:02x}")
        i += 1 + fixed[0]
        cost += _SLOT + fixed[1]
    if i != end:
        raise _refused(
            "malformed", 0, "bytes after the reply's value" if i < end else "a cut value"
        )
    if cost > most_cost:
        raise _over("decoded_bytes", most_cost)
    return cost


def _run(buf: bytes | bytearray, i: int, n: int, end: int) -> tuple[int, int] | None:
    """An array's ``n`` values starting at ``i``, when they are all one-byte values or
    all floats of one width: ``(the index after them, their estimated cost)``."""
    if n < 8 or i >= end:
        return None
    first = buf[i]
    if first in (0xCA, 0xCB):
        width = 5 if first == 0xCA else 9
        stop = i + width * n
        if stop <= end and buf[i:stop:width] == bytes([first]) * n:
            return stop, n * (_SLOT + _FLOAT)
        return None
    stop = i + n
    if stop > end:
        return None
    chunk = buf[i:stop]
    if chunk.translate(None, _ONE_BYTE):
        return None
    empties = chunk.count(0x90) * _LIST + chunk.count(0x80) * _DICT + chunk.count(0xA0) * _STR
    return stop, n * _SLOT + empties
