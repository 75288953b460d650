"""Env exceptions: one traceback per distinct error, repeats counted and summarised, bounded."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import pytest

from stadium import Environment, State, StepResult
from stadium._util.throttle import DistinctErrorLog, error_key
from stadium.testing import memory_runtime, open_session

LOG = logging.getLogger("stadium.test.distinct")


def _raise(kind: type[Exception], n: int) -> Exception:
    try:
        if n == 0:
            raise kind("first place")
        raise kind(f"second place {n}")
    except Exception as exc:
        return exc


def _records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOG.name]


def test_the_key_is_type_and_innermost_frame_not_the_message() -> None:
    a, b, c = _raise(ValueError, 1), _raise(ValueError, 2), _raise(ValueError, 0)
    assert error_key(a) == error_key(b)  # messages differ, same place
    assert error_key(a) != error_key(c)  # another line
    assert error_key(a) != error_key(_raise(KeyError, 1))
    assert error_key(a)[0] == "builtins.ValueError"
    assert error_key(ValueError("never raised"))[1] == "?"


def test_each_distinct_error_is_logged_once_with_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, LOG.name)
    now = [0.0]
    report = DistinctErrorLog(LOG, interval=10.0, clock=lambda: now[0])
    assert report("step raised: %r", "x", exc=_raise(ValueError, 1))
    assert report("step raised: %r", "x", exc=_raise(KeyError, 1))  # another: logged at once
    assert report("step raised: %r", "x", exc=_raise(ValueError, 0))  # another line: too
    for i in range(500):  # a flood of the first
        assert not report("step raised: %r", "x", exc=_raise(ValueError, i + 1))
    records = _records(caplog)
    assert len(records) == 3
    assert all(r.exc_info is not None and r.levelno == logging.WARNING for r in records)
    now[0] = 10.0
    assert report("step raised: %r", "x", exc=_raise(ValueError, 7))
    summary = _records(caplog)[-1]
    assert summary.exc_info is None  # the traceback is not repeated
    assert "again: 501 times since the last report" in summary.getMessage()
    assert "test_distinct_errors.py:" in summary.getMessage()  # where it comes from
    assert not report("step raised: %r", "x", exc=_raise(ValueError, 8))
    assert len(_records(caplog)) == 4


def test_past_max_keys_new_errors_share_one_throttle(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, LOG.name)
    now = [0.0]
    report = DistinctErrorLog(LOG, interval=10.0, max_keys=2, clock=lambda: now[0])
    kinds = [ValueError, KeyError, TypeError, OSError, LookupError]
    logged = [report("raised", exc=_raise(kind, 1)) for kind in kinds]
    assert logged == [True, True, True, False, False]
    assert "more than 2 distinct errors" in _records(caplog)[-1].getMessage()
    assert len(report._seen) == 2  # memory stays bounded


class Act(msgspec.Struct):
    value: int


class Obs(msgspec.Struct):
    value: int


class TwoBugs(Environment[Act, Obs, State]):
    blocking = False

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Obs:
        return Obs(0)

    def step(self, action: Act) -> StepResult[Obs]:
        if action.value % 2:
            raise ValueError(f"odd {action.value}")
        return StepResult(Obs({}[action.value]))  # KeyError


async def test_the_server_logs_each_env_bug_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "stadium")
    async with memory_runtime(TwoBugs) as rt:
        session, ch = open_session(rt)
        await ch.request(session, b'{"type":"reset"}')
        for i in range(40):
            await ch.request(session, b'{"type":"step","data":{"value":%d}}' % i)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, [r.getMessage() for r in warnings]
    assert all(r.exc_info is not None for r in warnings)
    kinds = {r.exc_info[0] for r in warnings if r.exc_info}
    assert kinds == {ValueError, KeyError}
