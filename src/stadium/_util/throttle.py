"""Rate-limited reports: say a repeated thing at most once per interval, and how often it recurred.

For logs an outside party can trigger (crashing workers, descriptor exhaustion,
bad clients): each kind of event gets a :class:`Throttle`, and a line is logged
only when :meth:`Throttle.report` allows it, naming how many were held back::

    held = throttle.report(time.monotonic())
    if held is not None:
        log.warning("worker short of descriptors%s", f" ({held} more since)" if held else "")
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable


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


class ThrottledLog:
    """One kind of log line that outside parties can cause: at most one per ``interval`` s.

    The line logged names how many were held back since the last one, and carries
    the traceback of the exception it is about (held-back ones carry nothing: they
    are counted only). For errors a client can trigger at will (an env that raises
    on some input, a failing endpoint), so that a flood of them cannot fill the disk.
    ``clock`` is injectable for tests.
    """

    __slots__ = ("_clock", "_throttle", "level", "logger")

    def __init__(
        self,
        logger: logging.Logger,
        level: int = logging.WARNING,
        interval: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.level = level
        self._throttle = Throttle(interval)
        self._clock = clock

    def __call__(self, msg: str, *args: object, exc: BaseException | None = None) -> bool:
        """Log ``msg % args`` (with ``exc``'s traceback) unless held back; whether it was logged."""
        held = self._throttle.report(self._clock())
        if held is None:
            return False
        if held:
            msg += f" ({held} more since the last report, not logged)"
        self.logger.log(self.level, msg, *args, exc_info=exc)
        return True


def error_key(exc: BaseException) -> tuple[str, str]:
    """What makes two exceptions "the same error": their type and where they were raised.

    The place is the innermost traceback frame's ``file:line`` (the message is left
    out: it often carries the input, e.g. ``invalid value 37``).
    """
    tb = exc.__traceback__
    where = "?"
    if tb is not None:
        while tb.tb_next is not None:
            tb = tb.tb_next
        where = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}"
    kind = type(exc)
    return f"{kind.__module__}.{kind.__qualname__}", where


class DistinctErrorLog:
    """Each distinct error's traceback once; its repeats counted and summarised.

    For exceptions outside parties can trigger (an env that raises on some input).
    Errors are told apart by :func:`error_key` (type and innermost frame). The
    first of each is logged with its traceback; later ones are counted, and at most
    one line per ``interval`` seconds *per error* says how many recurred (no
    traceback). At most ``max_keys`` distinct errors are remembered: past that,
    new ones share one :class:`ThrottledLog` (one traceback per ``interval``), so a
    flood of distinct errors cannot fill the disk or memory either. ``clock`` is
    injectable for tests.
    """

    __slots__ = ("_clock", "_overflow", "_seen", "interval", "level", "logger", "max_keys")

    def __init__(
        self,
        logger: logging.Logger,
        level: int = logging.WARNING,
        interval: float = 10.0,
        max_keys: int = 256,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.level = level
        self.interval = interval
        self.max_keys = max_keys
        self._clock = clock
        self._seen: dict[tuple[str, str], Throttle] = {}
        self._overflow = ThrottledLog(logger, level, interval, clock)

    def __call__(self, msg: str, *args: object, exc: BaseException) -> bool:
        """Log ``msg % args`` for ``exc`` (see the class); whether a line was logged."""
        key = error_key(exc)
        throttle = self._seen.get(key)
        now = self._clock()
        if throttle is None:
            if len(self._seen) >= self.max_keys:
                return self._overflow(
                    msg + " (more than %d distinct errors seen: throttled together)",
                    *args,
                    self.max_keys,
                    exc=exc,
                )
            throttle = self._seen[key] = Throttle(self.interval)
            throttle.report(now)
            self.logger.log(self.level, msg, *args, exc_info=exc)
            return True
        held = throttle.report(now)
        if held is None:
            return False
        self.logger.log(
            self.level,
            msg + " (again: %d times since the last report; traceback logged the first time, "
            "from %s)",
            *args,
            held + 1,
            key[1],
        )
        return True
