"""Rate-limited reports (stadium._util.throttle)."""

from __future__ import annotations

from stadium._util.throttle import Throttle


def test_one_report_per_interval_counting_those_held_back() -> None:
    t = Throttle(10.0)
    assert t.report(100.0) == 0  # the first is reported, nothing held before it
    assert t.report(101.0) is None
    assert t.report(109.9) is None
    assert t.report(110.0) == 2  # the two held back are counted
    assert t.report(115.0) is None
    assert t.report(200.0) == 1
    assert t.report(300.0) == 0
