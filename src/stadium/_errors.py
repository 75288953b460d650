"""Stadium's exception tree.

Every error Stadium raises derives from :class:`StadiumError` and carries a
machine-readable ``code`` and a ``context`` dict, so that a server can put it
on the wire and a client can rebuild it on the other side::

    StadiumError                      base; .code, .context, .to_wire()
    ├── ProtocolError                 a frame the protocol cannot accept
    │   ├── InvalidMessageError       INVALID_JSON: not JSON / MessagePack
    │   └── UnknownTypeError          UNKNOWN_TYPE: "type" not reset/step/state/close/mcp
    ├── ValidationError               VALIDATION_ERROR: an action or reset argument
    │   │                             does not match the environment's schema
    │   └── ToolCallError             an unknown tool, or arguments that do not fit it
    ├── ExecutionError                EXECUTION_ERROR: the environment raised
    │   ├── CallTimeoutError          TIMEOUT: an env call ran past its time limit
    │   ├── EnvCrashedError           ENV_CRASHED: an isolated env's process died
    │   │                             (a signal such as SIGSEGV, or an exit)
    │   ├── LimitExceededError        LIMIT_EXCEEDED: an isolated env went past a limit
    │   │                             (memory, processes, wall time) and was stopped
    │   └── EnvProtocolError          ENV_PROTOCOL: an isolated env's process sent what
    │                                 the worker does not accept (a reply too large,
    │                                 too deep, malformed or unexpected) and was stopped
    ├── CapacityError                 CAPACITY_REACHED: no free session slot
    ├── RateLimitError                RATE_LIMITED: a client sent requests too fast
    ├── SnapshotError                 SNAPSHOT_FAILED: an env cannot be snapshotted or
    │                                 restored (``--durable``, fork)
    ├── SessionError                  SESSION_ERROR: misuse of the session lifecycle
    │   └── SessionClosedError        the session or its connection is gone
    ├── ConnectError                  a client could not open a session
    ├── ConfigError                   a bad argument, target or configuration
    │   └── TargetError               TARGET cannot be imported or is not an env
    └── EnvCheckError                 check_env() found a contract violation

Protocol errors (the peer sent something wrong) are kept apart from closed
session errors (the peer is gone): the first leaves the session usable, the
second does not.
"""

from __future__ import annotations

import enum
import math
import re
from typing import Any, ClassVar


class ErrorCode(enum.StrEnum):
    """Error codes carried in ``{"type": "error", "data": {"code": ...}}`` frames.

    The first seven are OpenEnv's (``WSErrorCode``); the rest are Stadium's own
    (an OpenEnv client shows them as they come).
    """

    INVALID_JSON = "INVALID_JSON"
    UNKNOWN_TYPE = "UNKNOWN_TYPE"
    VALIDATION_ERROR = "VALIDATION_ERROR"
    EXECUTION_ERROR = "EXECUTION_ERROR"
    CAPACITY_REACHED = "CAPACITY_REACHED"
    FACTORY_ERROR = "FACTORY_ERROR"
    SESSION_ERROR = "SESSION_ERROR"
    # Stadium's own codes sent on the wire.
    TIMEOUT = "TIMEOUT"
    RATE_LIMITED = "RATE_LIMITED"
    SNAPSHOT_FAILED = "SNAPSHOT_FAILED"
    RESUME_FAILED = "RESUME_FAILED"
    ENV_CRASHED = "ENV_CRASHED"
    LIMIT_EXCEEDED = "LIMIT_EXCEEDED"
    ENV_PROTOCOL = "ENV_PROTOCOL"
    # Stadium-only codes: never sent on the wire by the server.
    CONNECT_ERROR = "CONNECT_ERROR"
    CONFIG_ERROR = "CONFIG_ERROR"
    CHECK_ERROR = "CHECK_ERROR"


class StadiumError(Exception):
    """Base of every Stadium error.

    Args:
        message: one sentence saying what was wrong and, where possible, what to do.
        **context: structured details (field names, limits, ids) kept for the wire
            and for logs.
    """

    code: ClassVar[ErrorCode] = ErrorCode.SESSION_ERROR
    exit_code: ClassVar[int] = 1

    def __init__(self, message: str, **context: Any) -> None:
        super().__init__(message)
        self.message = message
        self.context: dict[str, Any] = context

    def to_wire(self) -> dict[str, Any]:
        """The ``data`` of an error frame: message, code and context."""
        data: dict[str, Any] = {"message": self.message, "code": str(self.code)}
        for key, value in self.context.items():
            data.setdefault(key, value)
        return data

    def __repr__(self) -> str:
        ctx = "".join(f", {k}={v!r}" for k, v in self.context.items())
        return f"{type(self).__name__}({self.message!r}{ctx})"


class ProtocolError(StadiumError):
    """The peer sent a frame that the protocol cannot accept."""

    code = ErrorCode.INVALID_JSON


class InvalidMessageError(ProtocolError):
    """The frame is not valid JSON (or MessagePack), or not a JSON object."""

    code = ErrorCode.INVALID_JSON


class UnknownTypeError(ProtocolError):
    """The frame's ``type`` is not one of reset, step, state, close, mcp."""

    code = ErrorCode.UNKNOWN_TYPE


class ValidationError(StadiumError):
    """An action or reset argument does not match the environment's schema.

    ``context["field"]`` names the offending field as a JSON path (``$.x``).
    """

    code = ErrorCode.VALIDATION_ERROR


class ToolCallError(ValidationError):
    """A tool call that cannot be made: no tool of that name, or arguments that do not
    fit its input schema (JSON-RPC ``-32602`` on ``/mcp``). ``context["tool"]`` names it."""


class ExecutionError(StadiumError):
    """The environment raised while handling a request.

    ``context`` holds ``exception`` (the type name) and ``operation``.
    """

    code = ErrorCode.EXECUTION_ERROR


class CallTimeoutError(ExecutionError):
    """An environment call ran longer than its limit (``--step-timeout`` or ``timeout_s``).

    ``context`` holds ``operation`` and ``timeout_s``. The session stays usable
    unless the env cannot be trusted any more (then it is closed after the reply).
    """

    code = ErrorCode.TIMEOUT


class EnvCrashedError(ExecutionError):
    """An isolated session's env process died (``--isolation process|sandbox``).

    ``context`` holds ``operation``, ``reason`` (``signal`` or ``exit``), ``signal``
    (its name, e.g. ``SIGSEGV``) or ``exit_code``. No other session is affected;
    the session stays open and its next ``reset`` starts a fresh process.
    """

    code = ErrorCode.ENV_CRASHED


class LimitExceededError(ExecutionError):
    """An isolated session's env went past one of its limits and was stopped.

    ``context`` holds ``operation``, ``limit`` (``memory``, ``pids`` or ``wall_time``)
    and ``value`` (the limit). The session stays open; its next ``reset`` starts a
    fresh process.
    """

    code = ErrorCode.LIMIT_EXCEEDED


class EnvProtocolError(ExecutionError):
    """An isolated session's env process sent its worker something it does not accept: a
    reply over a limit of the worker's (``--sandbox-reply-mib``), nested too deep,
    malformed, of the wrong type, or not asked for. The process was stopped.

    ``context`` holds ``operation``, ``limit`` (``frame_bytes``, ``decoded_bytes``,
    ``elements``, ``depth``, ``malformed``, ``type``, ``unexpected``, ``fork``) and
    ``value`` (the limit; 0 when none applies). The session stays open; its next
    ``reset`` starts a fresh process.
    """

    code = ErrorCode.ENV_PROTOCOL


#: The longest wait a server's ``retry_after_s`` may ask for (a larger one is this).
MAX_RETRY_AFTER_S = 300.0


def retry_after(value: Any) -> float:
    """A server's ``retry_after_s`` as seconds to wait: a number from 0 to
    :data:`MAX_RETRY_AFTER_S`; anything else (a string, NaN, infinity) is 1 s."""
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        return 1.0
    return min(max(0.0, float(value)), MAX_RETRY_AFTER_S)


class RateLimitError(StadiumError):
    """A client sent requests faster than the server's ``--rate-limit``.

    ``context`` holds ``retry_after_s``; the request was not carried out.
    """

    code = ErrorCode.RATE_LIMITED

    @property
    def retry_after_s(self) -> float:
        return retry_after(self.context.get("retry_after_s", 1.0))


class CapacityError(StadiumError):
    """No session slot was free within the admission timeout.

    ``context`` holds ``active_sessions``, ``max_sessions`` and ``retry_after_s``.
    """

    code = ErrorCode.CAPACITY_REACHED

    @property
    def retry_after_s(self) -> float:
        return retry_after(self.context.get("retry_after_s", 1.0))


class SnapshotError(StadiumError):
    """An environment cannot be snapshotted, or a snapshot cannot be restored into it.

    ``context`` holds ``env`` (the class) and ``reason`` (one sentence: what does
    not pickle and where, or why the snapshot does not fit). See ``stadium._env.snapshot``.
    """

    code = ErrorCode.SNAPSHOT_FAILED


class SessionError(StadiumError):
    """The session lifecycle was misused (e.g. ``step`` before ``reset``)."""

    code = ErrorCode.SESSION_ERROR


class SessionClosedError(SessionError):
    """The session, or the connection under it, is closed."""


class ResumeError(SessionClosedError):
    """A session could not be resumed: it ended, its grace period passed, the token
    is wrong, or no server holds it any more."""

    code = ErrorCode.RESUME_FAILED


class ConnectError(StadiumError):
    """A client could not open a session (refused, timed out, bad handshake)."""

    code = ErrorCode.CONNECT_ERROR


class ConfigError(StadiumError):
    """A bad command-line argument, environment variable or configuration value."""

    code = ErrorCode.CONFIG_ERROR
    exit_code = 2


class TargetError(ConfigError):
    """``stadium serve TARGET`` names something that cannot be loaded as an environment."""


class EnvCheckError(StadiumError):
    """:func:`stadium.check_env` found a violation of the environment contract."""

    code = ErrorCode.CHECK_ERROR


_BY_CODE: dict[str, type[StadiumError]] = {
    ErrorCode.INVALID_JSON: InvalidMessageError,
    ErrorCode.UNKNOWN_TYPE: UnknownTypeError,
    ErrorCode.VALIDATION_ERROR: ValidationError,
    ErrorCode.EXECUTION_ERROR: ExecutionError,
    ErrorCode.CAPACITY_REACHED: CapacityError,
    ErrorCode.FACTORY_ERROR: ExecutionError,
    ErrorCode.SESSION_ERROR: SessionError,
    ErrorCode.TIMEOUT: CallTimeoutError,
    ErrorCode.RATE_LIMITED: RateLimitError,
    ErrorCode.SNAPSHOT_FAILED: SnapshotError,
    ErrorCode.RESUME_FAILED: ResumeError,
    ErrorCode.ENV_CRASHED: EnvCrashedError,
    ErrorCode.LIMIT_EXCEEDED: LimitExceededError,
    ErrorCode.ENV_PROTOCOL: EnvProtocolError,
}


def error_from_wire(data: Any) -> StadiumError:
    """Rebuild the error a server sent in an error frame's ``data``."""
    if not isinstance(data, dict):
        return SessionError(f"server sent a malformed error frame: {data!r}")
    message = str(data.get("message", "unknown error"))
    code = str(data.get("code", ErrorCode.SESSION_ERROR))
    cls = _BY_CODE.get(code, SessionError)
    err = cls(message)  # the context set, not passed: any key ("self", a number) is data
    err.context.update((str(k), v) for k, v in data.items() if k not in ("message", "code"))
    if code not in _BY_CODE:
        err.context.setdefault("server_code", code)
    return err


#: The longest exception message put in an error reply (the rest is cut, marked "...").
MAX_EXCEPTION_TEXT = 1000

# An absolute path: POSIX (/a/b, ~/a) or Windows (C:\a, \\host\share), starting a
# word or a quoted string (so "http://host/x" and "a/b" are left alone).
_ABSOLUTE_PATH = re.compile(r"""(?<![^\s'"(\[=,])(?:~?/|[A-Za-z]:[\\/]|\\\\)[^\s'"),\]]*""")


def _path_tail(match: re.Match[str]) -> str:
    tail = re.split(r"[\\/]", match.group(0).rstrip("/\\"))[-1]
    return f"<path>/{tail}" if tail and tail != "~" else "<path>"


def describe_exception(exc: BaseException, *, debug: bool = False) -> str:
    """``"TypeName: message"`` of an exception raised by server-side code, fit for a client.

    The one rule for what an error reply says about an exception (an environment
    that raised, a failing endpoint): its type name and its message, never a
    traceback; absolute file paths in the message are cut to their last part
    (``/home/alice/data/x.csv`` → ``<path>/x.csv``), so that replies do not show
    the server's directories, home or user name; the message is cut at
    :data:`MAX_EXCEPTION_TEXT` characters. With ``debug`` (``--debug-errors``)
    the message is kept whole.
    """
    text = str(exc)
    if not debug:
        if len(text) > MAX_EXCEPTION_TEXT:
            text = text[:MAX_EXCEPTION_TEXT] + "..."
        text = _ABSOLUTE_PATH.sub(_path_tail, text)
    name = type(exc).__name__
    return f"{name}: {text}" if text else name
