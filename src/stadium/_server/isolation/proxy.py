"""The proxy env a session drives when its env is isolated: :class:`ProcessEnv` (and
:class:`ToolProcessEnv` for an env with MCP tools), and :func:`isolated_spec`, which puts
it in the env's :class:`~stadium._env.spec.EnvSpec`.

Each call (``reset``, ``step``, ``state``, ``tools/list``, ``tools/call``) is a request
on the session's socket to its env process (:mod:`.wire`), made by the worker's
:class:`~stadium._server.isolation.host.Isolation`. The session runner, the invoker,
the protocol, limits and metrics drive the proxy as they drive any async env, so
nothing else changes and clients see no difference.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from stadium._env.snapshot import snapshot_env
from stadium._env.spec import CallMode, EnvSpec
from stadium._errors import SessionError, SnapshotError, StadiumError
from stadium._server.isolation import wire
from stadium._server.isolation.host import Isolation, _foreign
from stadium._server.isolation.proc import EnvProcess, Gone


class ProcessEnv:
    """The proxy a session drives: each call runs in the session's own env process.

    Built with no process: the first ``reset`` (or ``step``) takes one from the warm
    pool. A call that outlives the per-call limit kills the process. A dead process
    gives its call :class:`~stadium.EnvCrashedError` or
    :class:`~stadium.LimitExceededError`; the next ``reset`` takes a fresh one.

    ``--durable``: each ``reset`` and ``step`` asks the env process for its env's
    snapshot with the reply (pickled there, as in-process); :meth:`durable_snapshot`
    hands the latest to the session's record. A restored session's first call takes
    a fresh process and applies the snapshot to its env first.
    """

    def __init__(self, isolation: Isolation) -> None:
        self.isolation = isolation
        self.proc: EnvProcess | None = None
        self.ended: StadiumError | None = None
        self.episode_timer: asyncio.TimerHandle | None = None
        self.durable = isolation.durable
        self.record: bytes | str = b""
        """The env's latest snapshot (``--durable``), or why none could be taken; ``b""``:
        no env process yet (a restore then starts a fresh one)."""
        self._restoring: bytes | None = None
        self._durable_next = False

    async def _process(self, op: str, fresh: bool) -> EnvProcess:
        iso = self.isolation
        proc = self.proc
        if proc is not None and proc.episode_over:  # its episode's time ran out meanwhile
            self.proc = None
            if not fresh:
                err = self.ended = await iso.death(proc, op)
                raise err
            iso.release(proc)
            proc = None
        if proc is not None:
            return proc
        if self.ended is not None and not fresh:
            raise SessionError(
                f"{self.ended.message.split(';')[0]}: send reset to start a fresh "
                f"env process before {_WHAT.get(op, op)}",
                operation=op,
            )
        proc = self.proc = await iso.acquire()
        self.ended = None
        blob, self._restoring = self._restoring, None
        if blob:
            reply = await self._request(proc, "restore", iso.encoder.encode(["restore", blob]))
            if reply[0] != wire.OK:
                raise SnapshotError(
                    f"restoring the session's env in a fresh process failed: {reply[1]}: "
                    f"{reply[2]}",
                    reason="restore",
                )
            self._start_episode()  # the restored episode goes on, with a time limit of its own
        return proc

    async def _call(self, op: str, body: bytes, fresh: bool) -> Any:
        proc = await self._process(op, fresh)
        reply = await self._request(proc, op, body)
        if reply[0] != wire.OK:
            raise self.isolation.raised(proc, op, reply)
        return reply

    async def _request(self, proc: EnvProcess, op: str, body: bytes) -> Any:
        iso = self.isolation
        timer = proc.loop.call_later(iso.limits.call_timeout, self._expire, proc)
        try:
            return await proc.request(body)
        except Gone:
            self.proc = None
            err = self.ended = await iso.death(proc, op)
            raise err from None
        except asyncio.CancelledError:  # abandoned (its session gone, a request's timeout_s)
            self.proc = None
            iso.kill(proc)
            iso.release(proc)
            raise
        finally:
            timer.cancel()

    def _expire(self, proc: EnvProcess) -> None:
        proc.expired = True
        self.isolation.kill(proc)

    def _start_episode(self) -> None:
        """Time the episode that starts now (``--episode-timeout``; none when 0)."""
        self._end_episode()
        limit = self.isolation.limits.episode_timeout
        proc = self.proc
        if limit > 0 and proc is not None:
            self.episode_timer = proc.loop.call_later(limit, self._episode_over, proc)

    def _end_episode(self) -> None:
        if self.episode_timer is not None:
            self.episode_timer.cancel()
            self.episode_timer = None

    def _episode_over(self, proc: EnvProcess) -> None:
        """The episode ran out of time: its process is killed now (a call running gets
        ``LIMIT_EXCEEDED``, ``episode_time``; else the next step does)."""
        self.episode_timer = None
        if self.proc is proc and not proc.episode_over:
            proc.episode_over = True
            self.isolation.limit_kills += 1
            self.isolation.kill(proc)

    def _result(self, reply: list[Any]) -> Any:
        if len(reply) > 2:  # --durable: the env's snapshot, or why there is none
            self.record = reply[2]
            if isinstance(reply[2], str):
                self.durable = False  # said once (by the session); no more asked for
        return _step_result(reply[1])

    async def reset(self, **kwargs: Any) -> Any:
        self._end_episode()
        enc = self.isolation.encoder.encode
        result = self._result(await self._call("reset", enc(["reset", kwargs, self.durable]), True))
        if not (result.done or result.truncated):
            self._start_episode()
        return result

    async def step(self, action: Any, **kwargs: Any) -> Any:
        iso = self.isolation
        body = iso.encoder.encode(["step", iso.action_encode(action), kwargs, self.durable])
        result = self._result(await self._call("step", body, False))
        if result.done or result.truncated:  # the episode ended in time
            self._end_episode()
        return result

    @property
    def state(self) -> Any:
        """The env's state, read in its process without blocking the worker (an awaitable
        the session awaits). Before any ``reset`` that is a fresh env's state, its own
        ``State`` class and all, as in-process (the session's process starts for it, and
        its ``reset`` then runs there; ``GET /state`` releases it again). After its episode
        ran out of time or its process died, the error (as a ``step`` gets), until a
        ``reset``: not a fresh process's state."""
        return self._state()

    async def _state(self) -> Any:
        return (await self._call("state", self.isolation.encoder.encode(["state"]), False))[1]

    async def close(self) -> None:
        self._end_episode()
        proc, self.proc = self.proc, None
        if proc is not None:
            self.isolation.release(proc)

    def snapshot(self) -> bytes:
        """``fork``: the process forks (the kernel copies the env; nothing is pickled);
        the bytes name the copy for :meth:`restore` in this worker. Within
        :meth:`durable_snapshot`: the env's latest snapshot, taken in its process."""
        if self._durable_next:
            record = self.record
            if isinstance(record, str):
                raise SnapshotError(f"the env's snapshot failed in its process: {record}")
            return _DURABLE + record
        proc = self.proc
        if proc is None:
            raise SnapshotError("fork: the session has no env process yet; reset first")
        try:
            child = self.isolation.adopt_fork(proc)
        except Gone:
            raise SnapshotError("fork: the env's process did not answer", reason="fork") from None
        return str(child.pid).encode()

    def durable_snapshot(self) -> bytes:
        """The bytes of the session's durable record (``--durable``): the env's snapshot
        from its last reply, in the envelope :func:`~stadium._env.snapshot.restore_env`
        reads back into a :class:`ProcessEnv` (no round trip to the env process)."""
        self._durable_next = True
        try:
            return snapshot_env(self)
        finally:
            self._durable_next = False

    def restore(self, data: bytes) -> None:
        if data.startswith(_DURABLE):  # a durable record: applied in the first call's process
            self._restoring = data[len(_DURABLE) :]
            return
        proc = self.isolation.live.get(int(data))
        if proc is None:
            raise SnapshotError("the forked env process is gone", reason="fork")
        self.proc = proc
        self._start_episode()  # the copy's episode goes on, with a time limit of its own


class ToolProcessEnv(ProcessEnv):
    """A :class:`ProcessEnv` of an env with MCP tools: ``tools/list`` and ``tools/call``
    (the ``"mcp"`` message, ``POST /mcp``, ``WS /mcp``) run in the env's process."""

    async def mcp_list_tools(self) -> list[dict[str, Any]]:
        body = self.isolation.encoder.encode(["tools"])
        return await self._mcp_call("tools/list", body)  # type: ignore[no-any-return]

    async def mcp_call_tool(self, name: str, arguments: Any) -> Any:
        # A tool call acts on the episode: after it ran out of time or its process died,
        # the error until a reset (as a step). Listing the tools needs no episode.
        body = self.isolation.encoder.encode(["call_tool", name, arguments])
        return await self._mcp_call("tools/call", body, fresh=False)

    async def _mcp_call(self, op: str, body: bytes, fresh: bool = True) -> Any:
        proc = await self._process(op, fresh)
        reply = await self._request(proc, op, body)
        if reply[0] != wire.OK:
            raise _foreign(reply)
        return reply[1]


#: What a call that needs a live episode is, in an error's words.
_WHAT = {"step": "stepping", "state": "reading its state", "tools/call": "calling a tool"}

#: The first bytes of a durable record's payload (a fork's is the new process's pid).
_DURABLE = b"D:"


def _step_result(out: list[Any]) -> Any:
    from stadium._env.contract import StepResult

    obs, reward, done, truncated, info = out
    return StepResult(obs, reward, done, truncated=truncated, info=info)


def isolated_spec(spec: EnvSpec, isolation: Isolation) -> EnvSpec:
    """``spec`` with a factory of :class:`ProcessEnv` proxies (:class:`ToolProcessEnv` for an
    env with MCP tools) and async calls throughout."""
    encoder = spec.msgpack_encoder
    isolation.action_encode = encoder.encode
    tools = callable(getattr(spec.env_cls, "mcp_call_tool", None)) and callable(
        getattr(spec.env_cls, "mcp_list_tools", None)
    )
    proxy = ToolProcessEnv if tools else ProcessEnv
    return dataclasses.replace(
        spec,
        factory=lambda **_kwargs: proxy(isolation),  # type: ignore[arg-type]
        async_reset=True,
        async_step=True,
        async_close=True,
        has_close=True,
        create_mode=CallMode.INLINE,
        reset_mode=CallMode.TASK,
        step_mode=CallMode.TASK,
        close_mode=CallMode.TASK,
    )
