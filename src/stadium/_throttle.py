"""Rate-limited reports: say a repeated thing at most once per interval, and how often it recurred.

For logs an outside party can trigger (crashing workers, descriptor exhaustion,
bad clients): each kind of event gets a :class:`Throttle`, and a line is logged
only when :meth:`Throttle.report` allows it, naming how many were held back::

    held = throttle.report(time.monotonic())
    if held is not None:
        log.warning("worker short of descriptors%s", f" ({held} more since)" if held else "")
"""

from __future__ import annotations

import math


class Throttle:
    """At most one report per ``interval`` seconds; counts the events held back between.

    No clock of its own: callers pass ``now`` (a monotonic time), so it is tested
    without waiting.
    """

    __slots__ = ("_held", "_last", "interval")

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._last = -math.inf
        self._held = 0

    def report(self, now: float) -> int | None:
        """``None``: hold this event back. Else report it, with the number held back before it."""
        if now - self._last < self.interval:
            self._held += 1
            return None
        held, self._held, self._last = self._held, 0, now
        return held
