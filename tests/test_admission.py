"""SharedSlots across forked processes: never over the limit, never wedged by a dead process."""

from __future__ import annotations

import contextlib
import functools
import multiprocessing.sharedctypes
import os
import signal
import time
from collections.abc import Callable, Iterator

import pytest

from stadium._server.admission.slots import LocalSlots, SharedSlots
from tests.conftest import UNIT

# The suite's process has threads (other tests' client loop, thread pools); the
# children forked here only touch shared counters and os._exit, as workers do.
pytestmark = pytest.mark.filterwarnings(
    "ignore:This process .* is multi-threaded:DeprecationWarning"
)


def _fork(body: Callable[[], int]) -> int:
    """Run ``body`` in a forked child that exits with its return value (1 on an exception)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            code = body()
        finally:
            os._exit(code)
    return pid


def _wait(pid: int, limit_s: float) -> int:
    """The exit code of child ``pid``; SIGKILL it (and fail) if it runs past ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"child {pid} still running after {limit_s:.1f} s")


@contextlib.contextmanager
def _reaped(pids: list[int]) -> Iterator[None]:
    """Kill and reap, by pid, any of our children still running after the block."""
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ChildProcessError, ProcessLookupError):
                if os.waitpid(pid, os.WNOHANG)[0] == 0:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)


def test_local_slots_count_to_the_limit() -> None:
    slots = LocalSlots(2)
    assert [slots.try_acquire() for _ in range(3)] == [True, True, False]
    slots.release()
    assert slots.active() == 1
    assert slots.try_acquire()


def test_shared_slots_in_one_process() -> None:
    slots = SharedSlots(2, 3)
    assert slots.counters == 3
    assert [slots.try_acquire() for _ in range(3)] == [True, True, False]
    assert slots.active() == 2
    slots.release()
    assert slots.active() == 1
    slots.bind(2)
    assert slots.try_acquire()
    assert not slots.try_acquire()
    slots.forget_worker(0)  # as the supervisor does for a dead worker
    assert slots.active() == 1
    assert slots.try_acquire()


def test_forked_processes_racing_never_hold_more_than_the_limit() -> None:
    slots = SharedSlots(3, 4)
    race(slots.bind, slots.try_acquire, slots.release, limit=3, procs=4)
    assert slots.active() == 0


def race(
    bind: Callable[[int], None],
    try_acquire: Callable[[], bool],
    release: Callable[[], None],
    *,
    limit: int,
    procs: int,
) -> None:
    """``procs`` forked processes acquire and release in a tight loop for a while; fails
    if more than ``limit`` ever hold at once, or if they never contended."""
    # Each process marks itself as a holder while inside the admitted window, and
    # checks there that no more than `limit` processes are holders.
    holding = memoryview(multiprocessing.sharedctypes.RawArray("q", procs)).cast("B").cast("q")
    admitted = memoryview(multiprocessing.sharedctypes.RawArray("q", procs)).cast("B").cast("q")
    refused = memoryview(multiprocessing.sharedctypes.RawArray("q", procs)).cast("B").cast("q")
    run_s = 0.5 * UNIT

    def hammer(index: int) -> int:
        bind(index)
        start = time.monotonic()
        # At least run_s, then on until some process was refused (on a loaded machine the
        # processes may have run one after another), within a liveness bound.
        while (now := time.monotonic()) < start + run_s or (
            sum(refused) == 0 and now < start + run_s + 20 * UNIT
        ):
            if not try_acquire():
                refused[index] += 1
                continue
            holding[index] = 1
            if sum(holding) > limit:
                return 3
            admitted[index] += 1
            holding[index] = 0
            release()
        return 0

    pids = [_fork(functools.partial(hammer, i)) for i in range(procs)]
    with _reaped(pids):
        codes = [_wait(pid, run_s + 60 * UNIT) for pid in pids]
    assert codes == [0] * procs, "a process saw more than the limit hold at once"
    assert all(admitted), "every process got in"
    assert sum(refused) > 0, "the processes contended"


def test_a_process_killed_in_a_tight_acquire_loop_wedges_no_one() -> None:
    limit = 2
    slots = SharedSlots(limit, 2)
    loops = memoryview(multiprocessing.sharedctypes.RawArray("q", 1)).cast("B").cast("q")

    def spin() -> int:
        slots.bind(1)
        while True:
            if slots.try_acquire():
                slots.release()
            loops[0] += 1

    pid = _fork(spin)
    with _reaped([pid]):
        deadline = time.monotonic() + 30 * UNIT
        while loops[0] < 10_000 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert loops[0] >= 10_000, "the child did not start spinning"
        os.kill(pid, signal.SIGKILL)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == -signal.SIGKILL
    # killed at any instruction, it holds at most one slot (its own counter)
    slots.bind(0)
    assert slots.try_acquire(), "the parent must get a slot at once, without waiting"
    slots.forget_worker(1)  # the supervisor, after reaping it
    assert slots.active() == 1
    assert slots.try_acquire()
    assert not slots.try_acquire()
