"""One episode as a session accounts for it: how it ended, the pool-thread CPU clock, and
what the recorder is handed (its cost goes into the reply that ended it by the core's
:meth:`~stadium._core.protocol.SessionProtocol.with_cost`).

The per-step accounting lives in :class:`~stadium._server.sessions.runner.Session` itself (a few
additions into its slots, see docs/PROTOCOL.md "Episode cost"); this module holds what
runs once per episode, or inside the env's own pool thread.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import Any

import msgspec

from stadium._env.cost import EpisodeCost

_thread_time = time.thread_time


class EndReason(enum.Enum):
    """How an episode ended (the recording's ``end`` column)."""

    DONE = "done"
    """A step answered ``done`` (not truncated)."""
    TRUNCATED = "truncated"
    """A step answered ``truncated``."""
    RESET = "reset"
    """A new ``reset`` began before the episode was done."""
    CLOSED = "closed"
    """The session ended (closed, lost, reaped, an error) before the episode was done."""


class ThreadTimed:
    """An env method run on the env pool thread, its CPU time added to its session's
    episode (``Session._ep_cpu``): the thread's own CPU clock read before and after, in
    that thread (two ``clock_gettime(CLOCK_THREAD_CPUTIME_ID)``: ~1.5 µs, against the
    pool's hand-off of tens of µs)."""

    __slots__ = ("fn", "session")

    def __init__(self, fn: Callable[..., Any], session: Any) -> None:
        self.fn = fn
        self.session = session

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = _thread_time()
        try:
            return self.fn(*args, **kwargs)
        finally:  # one writer at a time: a session has one call running
            self.session._ep_cpu += _thread_time() - start


_PENDING = EpisodeCost(wall_s=0.0, cpu_s=0.0, steps=0, bytes_in=0, bytes_out=0)


class Episode(msgspec.Struct, gc=False):
    """A recorded episode: made at its reset's reply, completed when it ends and handed
    to the recorder (decoded and written in its thread): the reset, the steps and the
    cost. ``steps`` is flat, three items a step: the step's request frame as it came (its
    ``data``: the action), the reply frame (or the error's text), the step's seconds.

    Nothing of a recorded episode is left for the cyclic collector to walk (measured: its
    full collections, triggered by objects that lived an episode long, stalled the loop of
    a recording worker with 2,000 sessions for ~80 ms): this struct is never tracked (it
    holds no cycle), the steps are gathered in the session's one reused list and handed
    over as a tuple (which untracks itself at the first collection: its items are bytes,
    text and floats; a decoded action, even a struct of plain fields, would keep it
    tracked)."""

    episode_id: str | None
    started_at: float
    """Unix time of the reset's reply."""
    seed: int | None
    options: dict[str, Any] | None
    reset_frame: bytes
    steps: tuple[Any, ...] = ()
    end: EndReason = EndReason.CLOSED
    cost: EpisodeCost = _PENDING
    clipped: bool = False
    """Steps past the recording's per-episode bound were not kept."""
    json: bool = True
    """The frames are JSON (else MessagePack)."""


__all__ = ["EndReason", "Episode", "ThreadTimed"]
