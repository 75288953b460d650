"""What one episode cost, as the server measured it: :class:`EpisodeCost`.

The server sends it with the step that ends an episode (``done`` or ``truncated``), as
the frame's top-level ``cost`` object (OpenEnv's clients read only ``type`` and
``data``, so they ignore it); Stadium's clients expose it as ``StepResult.cost``. Each
figure is defined in docs/PROTOCOL.md ("Episode cost").
"""

from __future__ import annotations

from typing import Any

import msgspec


class EpisodeCost(msgspec.Struct, frozen=True, kw_only=True):
    """One episode's cost (docs/PROTOCOL.md, "Episode cost").

    Attributes:
        wall_s: seconds from the reset's arrival at the server to the reply of the
            step that ended the episode (the server's monotonic clock).
        cpu_s: CPU seconds the env spent in ``reset`` and ``step`` (see
            ``cpu_source``); not the server's protocol work (decoding, encoding, I/O).
        steps: steps answered with an observation in the episode.
        bytes_in: bytes of the episode's request frames (reset and steps) as received.
        bytes_out: bytes of its reply frames as sent, this ``cost`` object excluded.
        peak_rss_bytes: the env process's peak resident memory since the reset's reply
            (``--isolation process``), or the sandboxed session's memory cgroup's peak
            charge (``sandbox``, cgroup v1); ``None`` in process.
        cpu_source: how ``cpu_s`` was measured: ``thread`` (the env pool thread's own
            CPU clock around each call), ``loop`` (the time of each call on the event
            loop thread: its CPU unless the OS took the core away meanwhile; an async
            call's part before its first suspension), ``loop+thread``, ``process`` (the
            env process's CPU since the reset's reply, its waited-for children
            included), ``cgroup`` (a sandboxed session's cgroup's CPU since the reset's
            reply), or ``unmeasured`` (``cpu_s`` is 0).
    """

    wall_s: float = 0.0
    cpu_s: float = 0.0
    steps: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    peak_rss_bytes: int | None = None
    cpu_source: str = "loop"


def cost_from(value: Any) -> EpisodeCost | None:
    """The :class:`EpisodeCost` in a reply frame's ``cost`` value, ``None`` if absent or
    not one (an older or foreign server)."""
    if not isinstance(value, dict):
        return None
    try:
        return msgspec.convert(value, EpisodeCost, strict=False)
    except msgspec.ValidationError:
        return None


__all__ = ["EpisodeCost", "cost_from"]
