"""The ``fork`` of a session: :class:`ForkingSession`, a base of
:class:`~stadium._server.sessions.runner.Session`.

A fork is a new session holding a copy of this one's env (an in-process env's snapshot
restored into a fresh one; an isolated env's process forked by the kernel, off the loop,
``ProcessEnv.prepare_fork``), charged to the forking session's client, detached until a
client resumes it with the ``forked`` reply's id and token. Its methods run on a
:class:`~stadium._server.sessions.runner.Session` (their ``self``), whose attributes they use as
the session's own methods do.
"""

from __future__ import annotations

import asyncio
from typing import Any

from stadium._core.protocol import Call, SessionProtocol, SessionState
from stadium._core.resume import NOWHERE, ForkedData, ResumeChannel
from stadium._env.snapshot import restore_env, snapshot_env
from stadium._env.spec import CallMode
from stadium._errors import CapacityError, SessionError
from stadium._server.admission.doorway import Door, Pass
from stadium._server.invoke import Pending
from stadium._server.runtime import NODE_NAME, Phase


class ForkingSession:
    """The fork methods of a session (a mixin; ``self`` is the session)."""

    __slots__ = ()
    _pass: Pass | None  # the session's charge (its slot), set by _adopt on a fork

    def _fork(self: Any, call: Call) -> Pending | None:
        """``fork``: a new session from this one's snapshot, its env restored from it, held
        detached (as a lost session is) until a client resumes it with the id and token of
        the ``forked`` reply. Charged to this session's client (its quota and its bucket)
        and takes a slot of its own at once (``CAPACITY_REACHED`` if either is full). An
        isolated env's process forks first, off the loop (``prepare_fork``; a step's wait)."""
        rt = self.runtime
        if self.resume_id is None or rt.resume_grace <= 0:
            self._send_error(
                call,
                SessionError(
                    "fork needs a resumable session: open it with ?stadium_resume=1 (Stadium's "
                    "clients do) on a server whose --resume-grace is above 0"
                ),
            )
            return None
        doors = rt.doors
        try:
            charged = doors.admit_now(Door.FORK, self.client, self.loop.time(), self.tenant)
        except CapacityError as err:
            self._send_error(call, err)
            return None
        run, on_done = rt.invoke.run, self._on_done
        prepare = getattr(self.env, "prepare_fork", None)
        if prepare is None:  # in-process: the copy made now
            now: asyncio.Future[Any] | None = run(
                self.loop, CallMode.INLINE, self._forked, (charged,), on_done, call
            )
            return now
        later: asyncio.Future[Any] | None = run(
            self.loop, CallMode.TASK, self._fork_later, (prepare, charged), on_done, call
        )
        return later

    async def _fork_later(self: Any, prepare: Any, charged: Pass) -> ForkedData:
        try:  # the env's process forks, off the loop
            await prepare()
        except BaseException:
            self.runtime.doors.release(charged, self.loop.time())
            raise
        reply: ForkedData = self._forked(charged)
        return reply

    def _forked(self: Any, charged: Pass) -> ForkedData:
        """The fork: a new session holding a copy of this one's env; the reply's data."""
        rt = self.runtime
        try:
            env = restore_env(rt.new_env, snapshot_env(self.env))
        except BaseException:
            rt.doors.release(charged, self.loop.time())
            raise
        sid, token = rt.doors.mint()
        child = type(self)(
            rt,
            NOWHERE,
            self.protocol.encoding,
            self.loop,
            client=self.client,
            resume=(sid, token),
            tenant=self.tenant,
        )
        child._adopt(env, self.protocol, charged)
        return ForkedData(sid, token, NODE_NAME, rt.resume_grace)

    def _adopt(self: Any, env: Any, parent: SessionProtocol, charged: Pass) -> None:
        """Become a fork holding ``env`` (its slot and charge: ``charged``), with
        ``parent``'s episode; detached, waiting for its client."""
        rt = self.runtime
        self._pass = charged
        self._bucket = charged.bucket
        rt.sessions.add(self)
        rt.doors.open(Door.FORK)
        rt.outcomes["forked"] += 1
        self.env = env
        bind = getattr(env, "bind_session", None)  # an isolated env: its output's log tag
        if bind is not None:
            bind(self.sid)
        protocol = self.protocol
        protocol.state = parent.state
        protocol.episode_id = parent.episode_id
        protocol.step_count = parent.step_count
        charged.inherited = parent.step_count  # counted to the tenant by the parent
        if parent.state is SessionState.READY and not parent.ended:  # mid-episode
            self._episode_forked(parent.step_count)
        self.phase = Phase.OPEN
        channel = self.channel
        assert isinstance(channel, ResumeChannel)
        if rt.durable is not None:
            channel.persist = self._persist
            self._persist(None)
        self._detach(channel)
