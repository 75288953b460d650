"""The episode ledger's part of a session: :class:`EpisodeAccounts`, a base of
:class:`~stadium._server.sessions.runner.Session` (over its resume half, ``resumable``).

The per-step accounting stays inline in the session's step path (a few additions into
its slots: the request's and the reply's bytes, the env call's time); what runs once per
episode is here: a reset begins an episode (ending the running one), its reply starts the
recording when ``--record`` keeps it, each step's request frame as it came, reply frame
and time are copied into the recorder's buffer (bytes for its writer process: nothing
kept per step; ``Session._reply`` does it inline, through the ``_ep_rec`` and ``_ep_bound``
the reset's reply set), and the end counts the cost into the worker's
:class:`~stadium._server.ledger.Ledger`, tells the recorder and splices the cost into the
reply that ended it. docs/PROTOCOL.md
("Episode cost") defines each figure.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from stadium._core.access import Tenant
from stadium._core.protocol import Call, Encoding, Op, RawCall
from stadium._env.cost import EpisodeCost
from stadium._env.spec import CallMode
from stadium._errors import StadiumError
from stadium._server.invoke import Pending
from stadium._server.ledger import EndReason, ThreadTimed, usage
from stadium._server.sessions.resumable import ResumableSession

_clock = time.perf_counter
_POOL = CallMode.POOL


class EpisodeAccounts(ResumableSession):
    """The running episode's ledger of one session (module doc); the session's resume half
    (:class:`~stadium._server.sessions.resumable.ResumableSession`) below it."""

    # The session's state this part writes (see _no_episode).
    __slots__ = (
        "_ep_bound",
        "_ep_clipped",
        "_ep_cpu",
        "_ep_in",
        "_ep_log",
        "_ep_out",
        "_ep_proc",
        "_ep_rec",
        "_ep_req",
        "_ep_start",
        "_ep_steps0",
        "_t0",
    )

    _ep_start: float
    _ep_steps0: int
    _ep_cpu: float
    _ep_in: int
    _ep_out: int
    _t0: float
    _ep_log: int | None
    _ep_proc: usage.Started | None
    _ep_req: bytes | str
    _ep_clipped: bool
    _ep_rec: Callable[[int, bytes | str, bytes, float], None]
    _ep_bound: int
    tenant: Tenant | None

    def _on_done(self, call: Call, result: Any, error: BaseException | None) -> None:
        raise NotImplementedError  # Session's

    def _no_episode(self) -> None:
        """No episode yet: the ledger's slots at rest."""
        self._ep_start = 0.0  # on the loop's clock; 0: no episode running
        self._ep_steps0 = 0  # the episode's steps before its accounting began (a fork's)
        self._ep_cpu = 0.0  # the env's CPU seconds in this episode
        self._ep_in = 0  # request bytes
        self._ep_out = 0  # reply bytes
        self._t0 = 0.0  # the clock read before an env call on the loop (0: none running)
        self._ep_log = None  # the episode's recording id (``--record`` keeps this episode)
        self._ep_proc = None  # an isolated env process's pid or cgroup, CPU s at the reset
        self._ep_req = b""  # a recorded episode's last step request (its frame, as it came)
        self._ep_clipped = False
        self._ep_rec = _unrecorded  # a recorded episode's: its recorder's ``step``
        self._ep_bound = 0  # a recorded episode's: the ledger's per-episode bytes

    def _reset(self, call: Call, size: int) -> Pending | None:
        """Run a reset (its request ``size`` bytes): the running episode, if any, ends; the
        new one is accounted from the reset's arrival, the reset's env time included."""
        if self._ep_start:
            self._episode_over(EndReason.RESET, self.last_active, None)
        self._ep_start = self.last_active
        self._ep_steps0 = 0
        self._ep_cpu = 0.0
        self._ep_in = size
        self._ep_out = 0
        if self._ep_log is not None:  # (a recorded reset that never began its episode)
            recorder = self.runtime.ledger.recorder
            if recorder is not None:
                recorder.end(self._ep_log, EndReason.CLOSED, None, False)
        self._ep_log = None
        self._ep_clipped = False
        rt = self.runtime
        reset: Callable[[], Any] = functools.partial(self.env.reset, **call.reset_kwargs)
        mode = rt.spec.reset_mode
        t0 = 0.0
        if mode is _POOL:
            reset = ThreadTimed(reset, self)
        else:
            self._t0 = t0 = _clock()
        pending = rt.invoke.run(self.loop, mode, reset, (), self._on_done, call)
        if pending is not None and self._t0:  # it suspended: its part so far
            self._ep_cpu += _clock() - t0
            self._t0 = 0.0
        return pending

    def _episode_reset(self, call: Call, frame: bytes) -> None:
        """The reset's reply: an isolated env process's CPU and peak memory are read from
        here (its pid's ``/proc`` files, or its sandbox's cgroups); the episode's recording
        starts, if ``--record`` keeps it."""
        if self.runtime.isolation is not None:
            self._ep_proc = usage.episode_start(self.env, self._ep_proc)
        recorder = self.runtime.ledger.recorder
        if recorder is not None and self._ep_start and recorder.wants():
            self._ep_log = recorder.begin(
                call.episode_id, call.seed, call.options, frame,
                self.protocol.encoding is Encoding.JSON,
            )  # fmt: skip
            # What each step of it reads (Session._reply's recorded case): no attribute chain
            self._ep_rec = recorder.step  # (a partial with the id bound: fewer bytecodes, slower)
            self._ep_bound = self.runtime.ledger.episode_bytes

    def _episode_forked(self, steps: int) -> None:
        """This session is a fork made now of a session ``steps`` steps into a running
        episode: the copy's part of it is accounted from here (its cost: the fork's own
        time, CPU, bytes and steps; its process's usage, under isolation, from now). It is
        not recorded: a recording replays from its reset, which the copy never had."""
        self._ep_start = self.loop.time()
        self._ep_steps0 = steps
        if self.runtime.isolation is not None:
            self._ep_proc = usage.episode_start(self.env, None, shared=True)

    def _batch_request(self, call: RawCall) -> bytes:
        """A batch's step request as a frame of its own (``{"data": ...}``), to record:
        its action's bytes copied (a batch frame is not kept for one of its calls)."""
        data = bytes(call.data)
        if self.protocol.encoding is Encoding.JSON:
            return b'{"data":' + data + b"}"
        return b"\x81\xa4data" + data  # MessagePack: a map of one, "data"

    def _step_pooled(self, call: Call) -> Pending | None:
        """A step of an env whose ``step`` blocks: on the pool, timed by the pool thread's
        own CPU clock (:class:`~stadium._server.ledger.ThreadTimed`)."""
        rt = self.runtime
        step = ThreadTimed(self.env.step, self)
        if call.timeout_s is None:
            return rt.invoke.run(self.loop, _POOL, step, (call.action,), self._on_done, call)
        return self._step_limited(call, step)

    def _step_limited(self, call: Call, step: Callable[..., Any]) -> Pending | None:
        raise NotImplementedError  # Session's

    def _episode_step(
        self, call: Call, frame: bytes, took: float, end: float, result: Any
    ) -> bytes:
        """A step's reply (``frame``, ``took`` seconds after its request, at ``end``) in a
        recorded episode or ending one: kept, and the cost added when it ended."""
        rid = self._ep_log
        if rid is not None:  # copied to the recorder, while within the per-episode bound
            if self._ep_in + self._ep_out <= self._ep_bound:
                self._ep_rec(rid, self._ep_req, frame, took)
            else:
                self._ep_clipped = True
        if self.protocol.ended and self._ep_start:
            return self._episode_over(ended_by(result), end, frame)
        return frame

    def _episode_error(self, call: Call, frame: bytes, err: StadiumError) -> None:
        """An error reply (``frame``) to ``call`` in the running episode."""
        self._ep_out += len(frame)
        rid = self._ep_log
        if rid is not None and call.op is Op.STEP:
            ledger = self.runtime.ledger
            if self._ep_in + self._ep_out <= ledger.episode_bytes:
                took = self.loop.time() - self.last_active
                ledger.recorder.step_failed(rid, self._ep_req, f"{err.code}: {err}", took)  # type: ignore[union-attr]
            else:
                self._ep_clipped = True

    def _cost(self, now: float) -> EpisodeCost:
        """The running episode's cost up to ``now`` (the loop's clock)."""
        cpu, source, peak = self._ep_cpu, self.runtime.ledger.cpu_source, None
        if self.runtime.isolation is not None:  # the env process's, not the proxy's
            cpu, source = 0.0, "unmeasured"
            started = self._ep_proc
            if started is not None and (used := usage.episode_usage(self.env, started)):
                cpu, peak, source = used
        return EpisodeCost(
            wall_s=max(0.0, now - self._ep_start),
            cpu_s=cpu,
            steps=self.protocol.step_count - self._ep_steps0,
            bytes_in=self._ep_in,
            bytes_out=self._ep_out,
            peak_rss_bytes=peak,
            cpu_source=source,
        )

    def _state_cost(self, frame: bytes) -> bytes:
        """A ``state`` reply with the running episode's cost so far as its ``cost`` (none
        when no episode runs)."""
        if not self._ep_start:
            return frame
        return self.protocol.with_cost(frame, self._cost(self.loop.time()))

    def _episode_closed(self) -> None:
        """The session ends: so does its running episode, if any."""
        if self._ep_start:
            self._episode_over(EndReason.CLOSED, self.loop.time(), None)

    def _episode_over(self, end: EndReason, now: float, frame: bytes | None) -> bytes:
        """The running episode ended (``now``, on the loop's clock): counted, recorded if
        kept; returns ``frame`` (the reply that ended it) with its cost (``b""`` if none)."""
        ledger = self.runtime.ledger
        protocol = self.protocol
        cost = self._cost(now)
        self._ep_start = 0.0
        ledger.ended(cost)
        if self.tenant is not None:  # --tenants: the tenant's episode cost too
            self.runtime.doors.episode(self.tenant, cost)
        rid = self._ep_log
        self._ep_log = None
        if rid is not None and ledger.recorder is not None:
            ledger.recorder.end(rid, end, cost, self._ep_clipped)
        if frame is None:
            return b""
        return protocol.with_cost(frame, cost)


def _unrecorded(rid: int, request: bytes | str, reply: bytes, took: float) -> None:
    """No recorded episode: ``EpisodeAccounts._ep_rec`` at rest (never called)."""


def ended_by(result: Any) -> EndReason:
    """How a step's result ended its episode (it is ``done``)."""
    return EndReason.TRUNCATED if getattr(result, "truncated", False) else EndReason.DONE


__all__ = ["EpisodeAccounts", "ended_by"]
