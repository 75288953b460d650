"""The proxy env a session drives when its env is isolated: :class:`ProcessEnv` (and
:class:`ToolProcessEnv` for an env with MCP tools), and :func:`isolated_spec`, which puts
it in the env's :class:`~stadium._env.spec.EnvSpec`.

Each call (``reset``, ``step``, ``state``, ``tools/list``, ``tools/call``) is a request
on the session's socket to its env process (:mod:`.wire`), made by the worker's
:class:`~stadium._server.isolation.worker.isolation.Isolation`. The session runner, the invoker,
the protocol, limits and metrics drive the proxy as they drive any async env, so
nothing else changes and clients see no difference. A reply the worker refuses (over
``--sandbox-reply-mib``, malformed, unexpected) ends its call with
:class:`~stadium.EnvProtocolError` and the process, as a crash does.

**A step, completed by callback** (the usual step of a live process): :meth:`ProcessEnv.step`
is no coroutine function; it sends the request at once and returns a :class:`StepCall`
(an :class:`~stadium._server.invoke.Started` call), whose contract is:

- the :class:`~stadium._server.invoke.Invoker` (or the session's batch path) calls
  :meth:`StepCall.start` with the session's ``on_done``, token and limit before the loop runs
  again; ``on_done`` is then called exactly once, later, from a loop callback;
- the call is the process's waiter (:attr:`EnvProcess.waiter`): the reader callback hands it
  the decoded reply (``set_result``) or why there is none (``set_exception``: ``Gone``,
  :class:`~stadium.EnvProtocolError`), and it reports to ``on_done`` then and there;
- it is the session's pending call: ``cancel()`` (the session closed) kills and releases
  the process and reports :class:`asyncio.CancelledError`;
- its stages (:class:`Stage`): ``SENDING`` (a frame the socket did not take at once: the
  loop sends the rest, a task) → ``WAITING`` → ``DONE``, or ``WAITING`` → ``DYING`` (the
  process died: :meth:`Isolation.death` names why, a task) → ``DONE``;
- the per-call limit of every step of a worker is the same, so one :class:`Clock` (one
  timer, deadlines in the order steps start) stops them all; a request's own shorter
  ``timeout_s`` has a timer of its own.

Every outcome is the coroutine path's (``_step``, ``_request``), which still serves
``--durable`` steps and a step that needs a fresh process first.

``--durable``: a snapshot over :data:`SPILL_BYTES` is not kept in the worker's memory
between replies: it is written (in a thread) to the session's spill file, ``0600`` in a
private directory of the worker's (:meth:`Isolation.spill_path`), replaced by the next
one and removed with the session; it is read back only to write the session's record.
A snapshot may be at most :data:`~stadium._server.durability.records.MAX_RECORD_BYTES` (and under
the reply limit): a larger one ends the session's durability, said once, as an env whose
snapshot fails does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import os
from collections.abc import Generator
from typing import Any

import msgspec

from stadium._env.contract import StepResult
from stadium._env.snapshot import snapshot_env
from stadium._env.spec import CallMode, EnvSpec
from stadium._errors import (
    CallTimeoutError,
    EnvProtocolError,
    SessionError,
    SnapshotError,
    StadiumError,
)
from stadium._server.durability.records import INLINE_BYTES, MAX_RECORD_BYTES
from stadium._server.invoke import Invoker, OnDone, Started
from stadium._server.isolation import wire
from stadium._server.isolation.worker.isolation import Isolation
from stadium._server.isolation.worker.proc import EnvProcess, Gone, foreign_error

#: A durable snapshot larger than this is spilled to a file (see the module docstring).
SPILL_BYTES = INLINE_BYTES


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

    def __init__(self, isolation: Isolation, clock: Clock | None = None) -> None:
        self.isolation = isolation
        self.clock = clock or Clock(isolation.limits.call_timeout)
        """The worker's one timer of its steps in flight (:class:`Clock`)."""
        self.proc: EnvProcess | None = None
        self.session: str | None = None
        """The session's short id (its log tag), once :meth:`bind_session` named it."""
        self.ended: StadiumError | None = None
        self.episode_timer: asyncio.TimerHandle | None = None
        self.durable = isolation.durable
        self.record: bytes | str = b""
        """The env's latest snapshot (``--durable``), or why none could be taken; ``b""``:
        no env process yet (a restore then starts a fresh one), or it is spilled."""
        self.spilled = 0
        """Bytes of the latest snapshot, held in the session's spill file (0: none)."""
        self._restoring: bytes | None = None
        self._durable_next = False
        self._fork_key: int | None = None
        self.spill_id = next(isolation.spill_ids)
        self.image: str | None = isolation.policy.default
        """The task image of the session's episodes (a reset's ``options["image"]``)."""

    def bind_session(self, sid: str) -> None:
        """The session driving this env is ``sid``: its process's output is logged under it."""
        self.session = sid
        proc = self.proc
        reader = self.isolation.outputs.get(proc.pid) if proc is not None else None
        if reader is not None:
            reader.session = sid

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
        proc = self.proc = await iso.acquire(self.session, image=self.image)
        self.ended = None
        blob, self._restoring = self._restoring, None
        if blob:
            body = wire.encode(wire.Restore(blob))
            reply = await self._request(proc, "restore", body, wire.DONE_REPLY)
            if isinstance(reply, wire.Raised):
                raise SnapshotError(
                    f"restoring the session's env in a fresh process failed: "
                    f"{reply.exception}: {reply.message}",
                    reason="restore",
                )
            self._start_episode()  # the restored episode goes on, with a time limit of its own
        return proc

    async def _call(
        self, op: str, body: bytes, fresh: bool, decoder: msgspec.msgpack.Decoder[Any]
    ) -> Any:
        proc = await self._process(op, fresh)
        reply = await self._request(proc, op, body, decoder)
        if isinstance(reply, wire.Raised):
            raise self.isolation.raised(proc, op, reply)
        return reply

    async def _request(
        self,
        proc: EnvProcess,
        op: str,
        body: bytes,
        decoder: msgspec.msgpack.Decoder[Any],
        fork: bool = False,
    ) -> Any:
        iso = self.isolation
        limit = min(iso.limits.call_timeout, iso.fork_s) if fork else iso.limits.call_timeout
        timer = proc.loop.call_later(limit, self._expire, proc)
        try:
            if fork:
                return await iso.adopt_fork(proc)
            return await proc.request(body, decoder)
        except Gone:
            self.proc = None
            err = self.ended = await iso.death(proc, op)
            raise err from None
        except EnvProtocolError as exc:  # it sent what is refused: stopped, as a crash
            raise self._stop(proc, op, exc) from None
        except asyncio.CancelledError:  # abandoned (its session gone, a request's timeout_s)
            self.proc = None
            iso.kill(proc)
            iso.release(proc)
            raise
        finally:
            timer.cancel()

    def _stop(self, proc: EnvProcess, op: str, exc: EnvProtocolError) -> EnvProtocolError:
        """``proc`` sent what is refused during ``op``: killed; the error its call gets."""
        self.proc = None
        self.isolation.kill(proc)
        self.isolation.release(proc)
        err = self.ended = EnvProtocolError(
            f"{op}: the env's process sent {exc.message}; it was stopped: reset to start a "
            "fresh one",
            operation=op, **exc.context,
        )  # fmt: skip
        return err

    def _expire(self, proc: EnvProcess) -> None:
        proc.expired = True
        self.isolation.kill(proc)
        proc.abort()  # its call ends now, whether or not its socket reads as closed

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

    async def _durable(self, reply: wire.StepOk, op: str) -> None:
        """``--durable``: the env's snapshot that came with ``reply``, or why none did."""
        if reply.unsnapshotted is not None:
            self.record = reply.unsnapshotted
            self.durable = False  # said once (by the session); no more asked for
        elif reply.snapshot is not None:
            limit = self._snap_limit()
            if len(reply.snapshot) > limit and self.proc is not None:  # more than asked for
                raise self._stop(self.proc, op, EnvProtocolError(
                    f"a snapshot of {len(reply.snapshot)} bytes, over the {limit} asked for "
                    "(snapshot_bytes)", limit="snapshot_bytes", value=limit,
                ))  # fmt: skip
            await self._keep(reply.snapshot)

    async def _keep(self, snapshot: memoryview) -> None:
        """Hold the env's latest snapshot: as bytes when small, else in the spill file."""
        size = len(snapshot)
        if size <= SPILL_BYTES:
            self.record = bytes(snapshot)
            self._unspill()
            return
        path = self.isolation.spill_path(self.spill_id)
        await asyncio.get_running_loop().run_in_executor(None, _spill, path, snapshot)
        self.record = b""
        self.isolation.spilled += size - self.spilled
        self.spilled = size

    def _unspill(self) -> None:
        if self.spilled:
            self.isolation.spilled -= self.spilled
            self.spilled = 0
            self.isolation.unspill(self.spill_id)

    def _snap_limit(self) -> int:
        """The largest snapshot asked for (``--durable``; 0: none): a record's limit, and
        within a reply's."""
        if not self.durable:
            return 0
        return min(MAX_RECORD_BYTES, self.isolation.replies.frame_bytes - wire.MIB)

    async def reset(self, **kwargs: Any) -> Any:
        self._end_episode()
        policy = self.isolation.policy
        if policy.any:  # an image's episode starts pristine: a fresh process of the image
            options = kwargs.get("options")
            wanted = options.get("image") if isinstance(options, dict) else None
            ref = policy.choose(wanted)  # refused: the session keeps its process
            await self.isolation.images.get(ref)  # so is a REF naming no usable image
            self.image = ref
            proc, self.proc = self.proc, None
            if proc is not None:
                self.isolation.release(proc)
        body = wire.encode(wire.Reset(kwargs, self._snap_limit()))
        reply = await self._call("reset", body, True, wire.STEP_REPLY)
        if self.durable:
            await self._durable(reply, "reset")
        result = _step_result(reply)
        if not (result.done or result.truncated):
            self._start_episode()
        return result

    def step(self, action: Any, **kwargs: Any) -> Any:
        """A step: its request sent now and a :class:`StepCall` returned (the usual), else
        (``--durable``, no live process, a frame option) the coroutine :meth:`_step`."""
        proc = self.proc
        if self.durable or proc is None or proc.episode_over or proc.broken is not None:
            return self._step(action, kwargs)  # (a closed socket: the StepCall's Gone)
        body = _encode(_Step(self.isolation.action_encode(action), kwargs, 0))
        return StepCall(self, proc, body)

    async def _step(self, action: Any, kwargs: dict[str, Any]) -> Any:
        iso = self.isolation
        snap = self._snap_limit() if self.durable else 0
        body = _encode(_Step(iso.action_encode(action), kwargs, snap))
        proc = self.proc
        if proc is None or proc.episode_over:
            proc = await self._process("step", False)
        reply = await self._request(proc, "step", body, _STEP_REPLY)
        if type(reply) is _Raised:
            raise iso.raised(proc, "step", reply)
        if snap:
            await self._durable(reply, "step")
        result = StepResult(reply.observation, reply.reward, reply.done,
                            truncated=reply.truncated, info=reply.info)  # fmt: skip
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
        body = wire.encode(wire.GetState())
        return (await self._call("state", body, False, wire.VALUE_REPLY)).value

    async def close(self) -> None:
        self._end_episode()
        self._unspill()
        proc, self.proc = self.proc, None
        if proc is not None:
            self.isolation.release(proc)

    async def prepare_fork(self) -> None:
        """``fork``, off the event loop: the process forks (the kernel copies the env;
        nothing is pickled); the next :meth:`snapshot` names the copy. A fork that fails,
        or whose reply is refused, or late (``FORK_S``), ends its process (as a crash)."""
        proc = self.proc
        if proc is None:
            raise SnapshotError("fork: the session has no env process yet; reset first")
        try:
            child = await self._request(proc, "fork", b"", wire.DONE_REPLY, fork=True)
        except StadiumError as exc:
            raise SnapshotError(f"fork failed: {exc.message}", reason="fork") from None
        self._fork_key = child.pid

    def snapshot(self) -> bytes:
        """``fork`` (after :meth:`prepare_fork`): the bytes naming the copy for
        :meth:`restore` in this worker. Within :meth:`durable_snapshot`: the env's latest
        snapshot, taken in its process."""
        if self._durable_next:
            record = self.record
            if isinstance(record, str):
                raise SnapshotError(f"the env's snapshot failed in its process: {record}")
            if self.spilled:  # read back for the record only (a file of the worker's own)
                with open(self.isolation.spill_path(self.spill_id), "rb") as spill:
                    return _DURABLE + spill.read(self.spilled)
            return _DURABLE + record
        key, self._fork_key = self._fork_key, None
        if key is None:
            raise SnapshotError("fork: the env's process was not forked first", reason="fork")
        return str(key).encode()

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
        body = wire.encode(wire.ListTools())
        return (await self._mcp_call("tools/list", body, wire.TOOLS_REPLY)).tools  # type: ignore[no-any-return]

    async def mcp_call_tool(self, name: str, arguments: Any) -> Any:
        # A tool call acts on the episode: after it ran out of time or its process died,
        # the error until a reset (as a step). Listing the tools needs no episode.
        body = wire.encode(wire.CallTool(name, arguments))
        return (await self._mcp_call("tools/call", body, wire.VALUE_REPLY, fresh=False)).value

    async def _mcp_call(
        self, op: str, body: bytes, decoder: msgspec.msgpack.Decoder[Any], fresh: bool = True
    ) -> Any:
        proc = await self._process(op, fresh)
        reply = await self._request(proc, op, body, decoder)
        if isinstance(reply, wire.Raised):
            raise foreign_error(reply)
        return reply


class Stage(enum.Enum):
    """Where a :class:`StepCall` is."""

    SENDING = "sending"
    """The request's frame did not fit the socket at once: its rest is being sent (a task)."""
    WAITING = "waiting"
    """Sent: the reply is awaited (the process's reader callback hands it over)."""
    DYING = "dying"
    """The process ended during the step: why is being found out (a task)."""
    DONE = "done"
    """Reported (or abandoned: cancelled, timed out)."""


class StepCall(Started):
    """One step of a live env process, completed from the reply's reader callback.

    :meth:`ProcessEnv.step` sends the request and returns this; the invoker (or the
    session's batch path) calls :meth:`start` with the session's ``on_done`` before control
    returns to the loop. It is, at once, the process's :attr:`EnvProcess.waiter` (``done``,
    ``set_result``, ``set_exception``, called by the reader callback), the session's pending
    call (``done``, ``cancel``), and an entry of the worker's :class:`Clock` (``expire``).
    Every way out is the coroutine path's (:meth:`ProcessEnv._step`, ``_request``), in the
    same order:

    - a reply: ``Raised`` → the env's error; else the :class:`StepResult` (an episode that
      ended stops its timer);
    - ``Gone`` (the socket closed, or the call's kill): ``DYING``, then the error
      :meth:`Isolation.death` names (``env.ended``);
    - ``EnvProtocolError`` (a refused reply): the process stopped (:meth:`ProcessEnv._stop`);
    - ``cancel()`` (the session closed): the process killed and released,
      ``CancelledError`` reported;
    - past the per-call limit (``--step-timeout``, or 300 s): the process killed; with the
      invoker's limit the same (the usual), ``CallTimeoutError`` (one timer for both), else
      ``Gone`` as above; a request's own shorter ``timeout_s`` has a timer of its own.
    """

    __slots__ = ("early", "env", "invoker", "limit", "on_done", "proc", "stage", "task", "timer",
                 "token")  # fmt: skip

    def __init__(self, env: ProcessEnv, proc: EnvProcess, body: bytes) -> None:
        self.env = env
        self.proc = proc
        self.stage = _WAITING
        self.on_done: OnDone | None = None
        self.token: Any = None
        self.timer: asyncio.TimerHandle | None = None
        """The invoker's own limit, when not the per-call one (a request's ``timeout_s``)."""
        self.task: asyncio.Task[Any] | None = None
        """Sending the rest of the frame (``SENDING``), or finding out why it died (``DYING``)."""
        self.early: tuple[Any, BaseException | None] | None = None
        """What came while ``SENDING`` (reported once the frame is sent)."""
        loop, clock = proc.loop, env.clock
        clock.calls[self] = loop.time() + clock.limit
        if clock.timer is None:
            clock.arm(loop)
        try:
            rest = proc.send(body, _STEP_REPLY, self)
        except Gone:  # (reported once started: the task that finds out why runs later)
            self.set_exception(Gone())
            return
        if rest is not None:  # the rest of the frame first (the loop's send), then the reply
            self.stage = _SENDING
            self.task = task = loop.create_task(proc.send_rest(rest))
            task.add_done_callback(self._sent)

    def start(self, invoker: Invoker, on_done: OnDone, token: Any, limit: float) -> StepCall:
        self.invoker, self.on_done, self.token, self.limit = invoker, on_done, token, limit
        if limit > 0 and limit != self.env.clock.limit and self.stage is not _DONE:
            self.timer = self.proc.loop.call_later(limit, self._timeout)
        return self

    def __await__(self) -> Generator[Any, None, Any]:
        """Awaited directly (not through the invoker): no limit but the per-call one."""
        fut: asyncio.Future[Any] = self.proc.loop.create_future()
        self.start(None, _resolve, fut, 0.0)  # type: ignore[arg-type]
        fut.add_done_callback(lambda f: f.cancelled() and self.cancel())
        return fut.__await__()

    # -- as the process's waiter (called only while SENDING or WAITING) ----------------

    def done(self) -> bool:
        return self.stage is _DONE

    def set_result(self, reply: Any, /) -> None:
        stage = self.stage
        if stage is not _WAITING:
            if stage is _SENDING:
                self.early = (reply, None)
            # DYING: its request was never sent (the send failed: the process's waiter was
            # set first); a frame read now is no reply to it: its death is reported.
            return
        self.stage = _DONE  # _settle, inlined: every step's path
        env = self.env
        env.clock.calls.pop(self, None)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if type(reply) is _Raised:
            self._report(None, env.isolation.raised(self.proc, "step", reply))
            return
        try:
            result = StepResult(reply.observation, reply.reward, reply.done,
                                truncated=reply.truncated, info=reply.info)  # fmt: skip
            if result.done or result.truncated:  # the episode ended in time
                env._end_episode()
        except Exception as exc:
            self._report(None, exc)
            return
        if (on_done := self.on_done) is not None:
            on_done(self.token, result, None)

    def set_exception(self, exc: BaseException, /) -> None:
        stage = self.stage
        if stage is _SENDING:
            self.early = (None, exc)
        elif stage is not _WAITING:
            pass
        elif isinstance(exc, Gone):  # the process died: why, found out off this callback
            self.stage = _DYING
            self.env.proc = None
            self.task = task = self.proc.loop.create_task(self._dying())
            task.add_done_callback(self._died)
        else:
            self._settle()
            if isinstance(exc, EnvProtocolError):  # it sent what is refused: stopped
                exc = self.env._stop(self.proc, "step", exc)
            self._report(None, exc)

    # -- as the session's pending call -------------------------------------------------

    def cancel(self) -> bool:
        """Abandon the step (its session is gone): the process killed and released."""
        stage = self.stage
        if stage is _DONE:
            return False
        if stage is _DYING:  # the task's end reports the cancellation
            assert self.task is not None
            self.task.cancel()
            return True
        self._abandon()
        self._report(None, asyncio.CancelledError())
        return True

    # -- time limits -------------------------------------------------------------------

    def expire(self) -> None:
        """The per-call limit passed (the :class:`Clock`): the process is killed."""
        proc, iso = self.proc, self.env.isolation
        proc.expired = True
        iso.kill(proc)
        if self.stage is _DYING:  # finding out why it died: now it ran out of time too
            return
        if self.on_done is None or self.limit != self.env.clock.limit:
            if self.stage is _SENDING:  # its call ends now, as a death (``wall_time``)
                self.early = (None, Gone())
            else:
                proc.abort()
            return
        # The invoker's limit is the per-call one: the same instant, CallTimeoutError.
        self.stage = _DONE
        proc.abort()
        self._timed_out(_WAITING)

    def _timeout(self) -> None:
        """The invoker's own limit (a request's shorter ``timeout_s``) passed."""
        self.timer = None
        if self.stage is not _DONE:
            stage, self.stage = self.stage, _DONE
            self._timed_out(stage)

    def _timed_out(self, stage: Stage) -> None:
        if stage is _DYING:
            assert self.task is not None
            self.task.cancel()
            self.env.clock.calls.pop(self, None)
        else:
            self._abandon()
        self.invoker.timeouts += 1
        limit = self.limit
        self._report(None, CallTimeoutError(
            f"the call ran longer than its {limit:g} s limit", timeout_s=limit
        ))  # fmt: skip

    # -- the rest ----------------------------------------------------------------------

    def _settle(self) -> None:
        self.stage = _DONE
        self.env.clock.calls.pop(self, None)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _abandon(self) -> None:
        """Stop waiting: the process is killed and released (a cancelled ``_request``)."""
        self._settle()
        task, self.task = self.task, None
        if task is not None:
            task.cancel()
        env, proc = self.env, self.proc
        env.proc = None
        env.isolation.kill(proc)
        env.isolation.release(proc)

    def _report(self, result: Any, error: BaseException | None) -> None:
        on_done = self.on_done
        if on_done is not None:
            on_done(self.token, result, error)

    def _sent(self, task: asyncio.Task[None]) -> None:
        if self.task is task:
            self.task = None
        if self.stage is not _SENDING or task.cancelled():
            return
        self.stage = _WAITING
        exc = task.exception()
        early, self.early = self.early, None
        if exc is not None:
            self.set_exception(exc)
        elif early is not None:
            if early[1] is None:
                self.set_result(early[0])
            else:
                self.set_exception(early[1])

    async def _dying(self) -> StadiumError:
        err = self.env.ended = await self.env.isolation.death(self.proc, "step")
        return err

    def _died(self, task: asyncio.Task[StadiumError]) -> None:
        if self.stage is _DONE:  # timed out meanwhile: reported
            return
        self._settle()
        self.task = None
        if task.cancelled():
            self._report(None, asyncio.CancelledError())
            return
        exc = task.exception()
        self._report(None, exc if exc is not None else task.result())


class Clock:
    """One timer for every :class:`StepCall` of a worker in flight: they all have the same
    per-call limit, so their deadlines come in the order they start (a dict keeps it);
    the timer waits for the first, and a step that ends leaves the dict (no timer a step)."""

    __slots__ = ("calls", "limit", "loop", "timer")

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.calls: dict[StepCall, float] = {}
        """The calls in flight (``WAITING``, ``SENDING``, ``DYING``) and their deadlines."""
        self.loop: asyncio.AbstractEventLoop | None = None
        self.timer: asyncio.TimerHandle | None = None

    def arm(self, loop: asyncio.AbstractEventLoop) -> None:
        """Time the first call (there is one, and no timer)."""
        self.loop = loop
        self.timer = loop.call_at(next(iter(self.calls.values())), self._fire)

    def _fire(self) -> None:
        self.timer = None
        loop, calls = self.loop, self.calls
        assert loop is not None
        now = loop.time() + CLOCK_SLACK_S
        try:
            for _ in range(len(calls)):  # each pass ends one call (started meanwhile: wait)
                call, deadline = next(iter(calls.items()))
                if deadline > now:
                    break
                del calls[call]
                call.expire()
        finally:  # one session's callback that raised does not stop the others' limits
            if calls and self.timer is None:
                self.arm(loop)


def _resolve(fut: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(result)
    else:
        fut.set_exception(error)


#: A timer may fire this early (the loop's clock counts milliseconds).
CLOCK_SLACK_S = 0.001


# Module constants of the step's path (a global and an attribute: one lookup, not two).
_encode = wire.encode
_Step = wire.Step
_Raised = wire.Raised
_STEP_REPLY = wire.STEP_REPLY
_SENDING = Stage.SENDING
_WAITING = Stage.WAITING
_DYING = Stage.DYING
_DONE = Stage.DONE

#: What a call that needs a live episode is, in an error's words.
_WHAT = {"step": "stepping", "state": "reading its state", "tools/call": "calling a tool"}

#: The first bytes of a durable record's payload (a fork's is the new process's pid).
_DURABLE = b"D:"


def _step_result(out: wire.StepOk) -> Any:
    return StepResult(out.observation, out.reward, out.done, truncated=out.truncated, info=out.info)


def _spill(path: str, snapshot: memoryview) -> None:
    """Write ``snapshot`` to ``path`` (``0600``; in a thread), replacing what it held."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    with open(fd, "wb") as file:
        file.write(snapshot)


def isolated_spec(spec: EnvSpec, isolation: Isolation) -> EnvSpec:
    """``spec`` with a factory of :class:`ProcessEnv` proxies (:class:`ToolProcessEnv` for an
    env with MCP tools) and async calls throughout."""
    encoder = spec.msgpack_encoder
    isolation.action_encode = encoder.encode
    tools = callable(getattr(spec.env_cls, "mcp_call_tool", None)) and callable(
        getattr(spec.env_cls, "mcp_list_tools", None)
    )
    proxy = ToolProcessEnv if tools else ProcessEnv
    clock = Clock(isolation.limits.call_timeout)
    return dataclasses.replace(
        spec,
        factory=lambda **_kwargs: proxy(isolation, clock),  # type: ignore[arg-type]
        async_reset=True,
        async_step=True,
        async_close=True,
        has_close=True,
        create_mode=CallMode.INLINE,
        reset_mode=CallMode.TASK,
        step_mode=CallMode.STARTED,
        close_mode=CallMode.TASK,
    )
