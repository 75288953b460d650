"""The env side of isolated sessions: each session's process, and what it shares with its
template (:class:`_Ctx`).

A session's process (:func:`session_main`; forked by the template of :mod:`.child`, or run by
a VM guest's :mod:`.vmchild`) builds the env (construction happens
before the session asks: a warm process has paid it), then serves the requests
of :mod:`~stadium._server.isolation.wire` one at a time, read with blocking calls, in
one task of an event loop that runs for the process's life: an async env method is
awaited in that task (one that never suspends costs no turn of the loop; a loop run per
call cost ~14 µs a step), a sync one runs with no running loop, as in-process. A step, the
usual request, is answered in the serve loop itself: no coroutine nor Python frame of
Stadium's own per step (the env's ``step`` is the only call; its reply encoded in place
after its header, in one buffer kept across steps). It never
returns: it ends with ``os._exit``. Single-threaded on purpose: forking it (``fork``) is
safe; the copy serves on from the fork, on the same loop, on its own socket.

What it trusts: :class:`_Ctx`, set by the template (or the VM guest) before any env code
runs; the worker's requests only as :func:`~stadium._server.isolation.wire.decode_request`
decodes them (an action as the env's codec decodes it: with ``--untrusted-env-code``,
:func:`~.remote.action_decoder`). The env's code is the code it runs, never trusts: what
the env raises goes back as a ``Raised`` reply (:func:`_raised`), bounded by the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import socket
import types
from typing import Any

import msgspec

from stadium._env import workspace
from stadium._env.codecs import enc_hook_default
from stadium._env.contract import StepResult
from stadium._env.snapshot import restore_env, snapshot_env
from stadium._env.spec import EnvSpec
from stadium._errors import StadiumError, ToolCallError
from stadium._server.isolation import remote, wire
from stadium._server.isolation.template.seccomp import Filter
from stadium._util.throttle import DistinctErrorLog

_ENV_ERRORS = DistinctErrorLog(logging.getLogger("stadium.env.process"))
"""The env's exceptions, to this process's stderr (:mod:`..worker.output` reads it)."""
_ENV_ERRORS.logger.addHandler(logging.StreamHandler())  # sys.stderr: the family's pipe
_ENV_ERRORS.logger.propagate = False


class _Ctx:
    """What every session process of a template shares (set once, inherited by fork)."""

    spec: EnvSpec | None = None
    untrusted: dict[str, Any] | None = None
    """``--untrusted-env-code``: the template's settings; each session's process imports
    the target (:func:`~.remote.load_spec`) once in its sandbox, the template never."""
    env_kwargs: dict[str, Any]
    sandbox: bool
    disk_mib: int
    ptys = 16
    host_roots: list[str] = []
    image_target = ""
    """``--untrusted-env-code``: the target as an image-backed session's process sees it."""
    """Sandboxed: the host folders an image-backed session sees under ``/.stadium/host``."""
    seccomp: Filter | None = None
    key_base = 0
    """Added to a pid to make its key (sandboxed: the family's number << KEY_SHIFT)."""
    libc: Any = None
    pid_ns = -1
    """The template's own pid namespace (sandboxed: it ``setns`` back after each spawn)."""
    report: socket.socket | None = None
    """Sandboxed: the families' inits report their processes' exits on it (the template's end)."""
    families: Any = None
    init: int | None = None
    """Sandboxed: the native init a family's init executes once it has forked the session's
    process (:func:`native_init`: a sealed memfd); ``None``: it stays a forked interpreter
    (~0.8 MiB more)."""
    inits: dict[int, int] = {}
    """Sandboxed: a family's init pid -> the key of its session's process."""
    unreported: set[int] = set()
    """Keys of sessions' processes whose exit their init has not reported yet."""
    encoder = msgspec.msgpack.Encoder(enc_hook=enc_hook_default)
    output = "log"
    """``log``: each spawn's first descriptor is its family's stdout and stderr (a pipe the
    worker reads, :mod:`.output`); ``drop``: they are ``/dev/null``."""


def _send(sock: socket.socket, msg: msgspec.Struct) -> None:
    sock.sendall(wire.frame(_Ctx.encoder.encode(msg)))


_HEAD_INTO = wire.HEADER.pack_into


class _Session:
    """One session's env, in its own process."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.env: Any = None
        self.create_error: str | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.decode_action: Any = None
        try:
            if _Ctx.untrusted is not None and _Ctx.spec is None:  # in its sandbox by now
                settings = _Ctx.untrusted
                if workspace.current_image() is not None:  # the target, seen from the image
                    settings = {**settings, "target": _Ctx.image_target}
                _Ctx.spec = remote.load_spec(settings)
            assert _Ctx.spec is not None
            self.decode_action = (
                _Ctx.spec.action.msgpack_decoder.decode
                if _Ctx.untrusted is None
                else remote.action_decoder(_Ctx.spec)  # the worker passes actions undecoded
            )
            self.env = _Ctx.spec.factory(**_Ctx.env_kwargs)
        except Exception as exc:
            self.create_error = f"creating the environment failed: {type(exc).__name__}: {exc}"

    async def call(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        """``method(*args, **kwargs)``, awaited when it gives an awaitable. A sync method runs
        with no running loop (as a sync env's code does in-process, on a thread); an async
        one is awaited in the serving task itself: a call that never suspends costs no
        turn of the loop, and one that does runs on it as in a task of its own."""
        loop = self.loop
        asyncio._set_running_loop(None)
        try:
            value = method(*args, **kwargs)
        finally:
            asyncio._set_running_loop(loop)
        if type(value) is types.CoroutineType or inspect.isawaitable(value):  # the usual first
            return await value
        return value

    def serve(self) -> None:
        """Answer the worker's requests (:mod:`.wire`), each by its type's handler, on an
        event loop made here (once: paid ahead in a warm process) that runs for the
        process's life. Requests are read with blocking calls: the loop has nothing else
        to do while the worker has not asked anything (an env's own tasks run while a
        call of its awaits, as they did on a loop run per call)."""
        loop = self.loop = asyncio.new_event_loop()
        _send(self.sock, wire.Hello())
        loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        handlers: dict[type[Any], Any] = {
            wire.Reset: self._reset,
            wire.GetState: self._state,
            wire.ListTools: self._tools,
            wire.CallTool: self._call_tool,
            wire.Restore: self._restore,
            wire.Describe: self._describe,
        }
        encode = _Ctx.encoder.encode
        reader = wire.FrameReader(self.sock)
        decode, step, step_result, step_ok = wire.decode_request, wire.Step, StepResult, wire.StepOk
        recv, size_of, chunk = self.sock.recv, wire.HEADER.unpack_from, wire.CHUNK_BYTES
        encode_into, head_into, sendall = _Ctx.encoder.encode_into, _HEAD_INTO, self.sock.sendall
        loop, set_loop, is_async = self.loop, asyncio._set_running_loop, inspect.isawaitable
        decode_action, built = self.decode_action, self.create_error is None
        async_env: Any = None
        async_step = False  # whether ``async_env.step`` is a coroutine function
        buf = bytearray(4)  # the step reply's frame, encoded in place after its header
        while True:
            body: bytes | bytearray | memoryview | None
            if reader.rest:
                body = reader.next()
            else:  # the usual: one recv reads one whole request (the reader's path, inlined)
                data = recv(chunk)
                n = len(data) - 4
                whole = n >= 0 and size_of(data)[0] == n
                body = memoryview(data)[4:] if whole else reader.next(data)
            if body is None:
                await self.close()
                os._exit(0)
            msg = decode(body)
            kind = type(msg)
            if kind is step and built:
                # The usual request, answered here with no frame of Stadium's own: an
                # async ``step`` is called with the loop running (making its coroutine runs
                # none of its code); a sync one with no running loop, as in-process.
                out: Any
                result = self._result  # before the call: what the step patches, from the next
                try:
                    env = self.env
                    if env is not async_env:  # (the env changes on restore)
                        async_env, async_step = env, inspect.iscoroutinefunction(env.step)
                    if async_step:
                        value = await env.step(decode_action(msg.action), **msg.kwargs)
                    else:
                        action = decode_action(msg.action)
                        set_loop(None)
                        try:
                            value = env.step(action, **msg.kwargs)
                        finally:
                            set_loop(loop)
                        if type(value) is not step_result and is_async(value):
                            value = await value
                    if msg.snap or type(value) is not step_result:  # --durable, or odd
                        out = result(value, msg.snap)
                    else:
                        out = step_ok(value.observation, value.reward, value.done,
                                      value.truncated, value.info)  # fmt: skip
                except Exception as exc:
                    out = _raised(exc)
                try:
                    encode_into(out, buf, 4)
                except Exception as exc:
                    encode_into(_raised(exc), buf, 4)
                head_into(buf, 0, len(buf) - 4)
                sendall(buf)
                if len(buf) > chunk:  # a large reply's buffer is not kept
                    buf = bytearray(4)
                continue
            # a describe is answered whenever the env's module loaded (the env may not build)
            described = kind is wire.Describe and _Ctx.spec is not None
            if self.create_error is not None and kind is not wire.Close and not described:
                _send(self.sock, wire.Raised("FactoryError", self.create_error))
                continue
            if kind is wire.Close:
                await self.close()
                _send(self.sock, wire.Done())
                os._exit(0)
            if kind is wire.Fork:
                try:
                    copy = self.fork()
                except Exception as exc:
                    _send(self.sock, _raised(exc))
                    continue
                if copy:  # this is the copy now, on its own socket: it says hello there
                    reader = wire.FrameReader(self.sock)
                    recv, sendall = self.sock.recv, self.sock.sendall
                    _send(self.sock, wire.Hello())
                continue
            try:
                out = encode(await handlers[kind](msg))
            except Exception as exc:
                out = encode(_raised(exc))
            self.sock.sendall(wire.frame(out))

    async def _reset(self, msg: wire.Reset) -> wire.StepOk:
        return self._result(await self.call(self.env.reset, **msg.kwargs), msg.snap)

    def _result(self, value: Any, snap: int) -> wire.StepOk:
        if isinstance(value, StepResult):
            out = wire.StepOk(value.observation, value.reward, value.done, value.truncated,
                              value.info)  # fmt: skip
        else:  # a reset giving its observation only
            out = wire.StepOk(value, None, False, False, None)
        if snap:  # --durable: the env's snapshot, taken after the call
            snapshot = self.snapshot()
            if isinstance(snapshot, str):
                out.unsnapshotted = snapshot
            elif len(snapshot) > snap:
                out.unsnapshotted = (
                    f"its snapshot is {len(snapshot)} bytes, over the {snap} a durable record "
                    "may hold (a smaller state, or serve it without --durable)"
                )
            else:
                out.snapshot = memoryview(snapshot)
        return out

    async def _state(self, _msg: wire.GetState) -> wire.ValueOk:
        # a property, or one giving an awaitable
        value = await self.call(getattr, self.env, "state")
        return wire.ValueOk(msgspec.to_builtins(value, enc_hook=enc_hook_default))

    async def _tools(self, _msg: wire.ListTools) -> wire.ToolsOk:
        return wire.ToolsOk(await self.call(self.env.mcp_list_tools) if self.has_tools() else [])

    async def _call_tool(self, msg: wire.CallTool) -> wire.ValueOk:
        if not self.has_tools():
            raise ToolCallError(f"unknown tool {msg.name!r}: this environment has no tools")
        return wire.ValueOk(await self.call(self.env.mcp_call_tool, msg.name, msg.arguments))

    async def _restore(self, msg: wire.Restore) -> wire.Done:
        await self.restore(msg.snapshot)
        return wire.Done()

    async def _describe(self, _msg: wire.Describe) -> wire.DescribeOk:
        assert _Ctx.spec is not None
        return wire.DescribeOk(remote.describe(_Ctx.spec))

    def has_tools(self) -> bool:
        return callable(getattr(self.env, "mcp_call_tool", None)) and callable(
            getattr(self.env, "mcp_list_tools", None)
        )

    def snapshot(self) -> bytes | str:
        """``--durable``: the env's snapshot (as in-process), taken here after the call; the
        reason as text when it cannot be taken (the worker ends the session's durability)."""
        try:
            return snapshot_env(self.env)
        except Exception as exc:
            return str(exc) or type(exc).__name__

    async def restore(self, blob: bytes) -> None:
        """A durable session restored: the snapshot applied to this process's fresh env."""
        env = self.env
        restored = restore_env(lambda: env, blob)  # in place (a whole-object pickle: a new one)
        if restored is not env:
            with contextlib.suppress(Exception):
                await self.call(env.close)
        self.env = restored

    def fork(self) -> bool:
        """A copy of this process (the kernel copies the env), on a new socket sent back
        attached to the reply. Forked twice, so that the copy is the template's (a
        subreaper's) to reap, not this env's. The copy makes its socket itself: the
        socket's peer credentials then name the copy, which is how the worker knows its
        key (never from what a process says). ``True`` in the copy (it serves on from
        here, on its own socket), ``False`` here once the reply is sent."""
        ours, handoff = socket.socketpair()
        first = os.fork()
        if first == 0:
            copy = False
            try:
                copy = os.fork() == 0
                if copy:
                    self.sock.close()
                    ours.close()
                    mine, theirs = socket.socketpair()
                    socket.send_fds(handoff, [b"s"], [mine.fileno()])
                    mine.close()
                    handoff.close()
                    os.setsid()
                    self.sock = theirs
            except BaseException:
                os._exit(0)
            if not copy:  # the first child ends either way
                os._exit(0)
            # A forked child has no running loop (asyncio resets it): still this one's.
            asyncio._set_running_loop(self.loop)
            return True
        handoff.close()
        os.waitpid(first, 0)
        _data, fds, _flags, _addr = socket.recv_fds(ours, 1, 1)
        ours.close()
        if not fds:
            raise OSError("the forked copy sent no socket")
        try:
            socket.send_fds(self.sock, [wire.frame(_Ctx.encoder.encode(wire.Done()))], fds)
        finally:
            os.close(fds[0])
        return False

    async def close(self) -> None:
        if self.env is not None:
            with contextlib.suppress(Exception):
                await self.call(self.env.close)


def _raised(exc: Exception) -> wire.Raised:
    """A ``Raised`` reply: the exception's type and message, and a Stadium error's wire
    form (code and context), so the worker raises the same error. The env's own exception
    is also told to this process's output with its traceback, each distinct one once (then
    counted: :class:`DistinctErrorLog`), which the worker logs tagged with the session."""
    if not isinstance(exc, StadiumError):
        _ENV_ERRORS("the environment raised %r", exc, exc=exc)
    data = exc.to_wire() if isinstance(exc, StadiumError) else None
    name = type(exc).__name__
    if not name.isidentifier() or len(name) > 200:  # what the worker takes (wire.Raised)
        name = "Exception"
    return wire.Raised(name, str(exc), data)


def session_main(sock: socket.socket) -> None:
    """Serve one session's env on ``sock`` until the worker closes it; never returns."""
    code = 0
    try:
        _Session(sock).serve()
    except BaseException:
        code = 5
    os._exit(code)
