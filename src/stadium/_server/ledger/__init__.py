"""The episode ledger: what each episode cost, every episode recorded (``--record``).

A session accounts for its running episode in a few slots of its own (bytes in and out,
the env's CPU time, the start; see :class:`~stadium._server.sessions.runner.Session` and
docs/PROTOCOL.md "Episode cost"); when the episode ends it hands the figures to the
worker's :class:`Ledger`, which sums them into the worker's metrics row and, when the
episode is recorded, gives it to the :class:`~.record.Recorder` (:mod:`.record`).
:mod:`.episode` holds the per-episode pieces (how it ended, the pool thread's CPU clock;
the cost goes into the last reply by ``SessionProtocol.with_cost``). ``stadium replay``
(``stadium._cli.replay``) reads the shards.
"""

from __future__ import annotations

from typing import Any

from stadium._env.cost import EpisodeCost
from stadium._env.spec import CallMode, EnvSpec
from stadium._server.ledger.episode import EndReason, Episode, ThreadTimed
from stadium._server.ledger.record import RecordConfig, Recorder, RecorderState

# Fields of the episode counts (metrics ``_EPISODES``..): ended, wall s, CPU s, steps, in, out.
_ENDED, _WALL, _CPU, _STEPS, _IN, _OUT = range(6)


class Ledger:
    """One worker's episode accounting.

    Args:
        spec: the env served (its name, version, call modes, ``info_key``).
        counts: the six episode fields of the worker's metrics row (``WorkerCounts.episodes``).
        record: ``--record``'s configuration, or ``None``.
        record_counts: the four recording fields of the row (``WorkerCounts.recording``).
    """

    __slots__ = ("counts", "cpu_source", "episode_bytes", "recorder")

    def __init__(
        self,
        spec: EnvSpec,
        counts: Any,
        record: RecordConfig | None = None,
        record_counts: Any = None,
    ) -> None:
        self.counts = counts
        modes = {spec.reset_mode, spec.step_mode}
        sources = ["loop"] if modes - {CallMode.POOL} else []
        if CallMode.POOL in modes:
            sources.append("thread")
        self.cpu_source = "+".join(sources)
        """How this worker measures ``cpu_s`` (:class:`~stadium._env.cost.EpisodeCost`)."""
        self.recorder = (
            None
            if record is None
            else Recorder(record, (spec.name, spec.version), spec.info_key, record_counts)
        )
        self.episode_bytes = record.episode_bytes if record is not None else 0
        """The most frame bytes one recorded episode keeps."""

    def ended(self, cost: EpisodeCost) -> None:
        """Count an ended episode's cost into the worker's metrics."""
        counts = self.counts
        counts[_ENDED] += 1
        counts[_WALL] += cost.wall_s
        counts[_CPU] += cost.cpu_s
        counts[_STEPS] += cost.steps
        counts[_IN] += cost.bytes_in
        counts[_OUT] += cost.bytes_out

    def close(self) -> None:
        """Write what the recorder holds (the worker is stopping)."""
        if self.recorder is not None:
            self.recorder.close()


__all__ = [
    "EndReason",
    "Episode",
    "Ledger",
    "RecordConfig",
    "Recorder",
    "RecorderState",
    "ThreadTimed",
]
