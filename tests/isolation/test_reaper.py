"""The teardown of isolated sessions off the event loop (:class:`Reaper`): sockets closed
on its thread, ended sessions' cgroups recycled when empty and removed (their processes
killed) when not, spare cgroups made ahead, and cgroups of dead workers swept."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from stadium._server.isolation.sandbox import Cgroups, Limits, sandbox_unavailable
from stadium._server.isolation.worker.reaper import Reaper
from tests.conftest import UNIT

WHY_NO_SANDBOX = sandbox_unavailable()
needs_cgroups = pytest.mark.skipif(WHY_NO_SANDBOX is not None, reason=f"cgroups: {WHY_NO_SANDBOX}")


def _submitter(threads: list[str]) -> Callable[[Callable[[], None]], None]:
    """Runs each drain at once on a thread of its own (joined), named in ``threads``."""

    def submit(fn: Callable[[], None]) -> None:
        def run() -> None:
            threads.append(threading.current_thread().name)
            fn()

        t = threading.Thread(target=run, name=f"reaper-{len(threads)}")
        t.start()
        t.join(60 * UNIT)  # a sweep of many dead workers' cgroups takes seconds
        assert not t.is_alive(), "the reaper's drain did not finish"

    return submit


def test_sockets_are_closed_on_the_reapers_thread() -> None:
    threads: list[str] = []
    reaper = Reaper(None, _submitter(threads))
    ours, theirs = socket.socketpair()
    with theirs:
        reaper.close_fd(ours.detach())
        theirs.settimeout(5 * UNIT)
        assert theirs.recv(1) == b""  # end of stream: closed
    assert threads
    assert threading.current_thread().name not in threads
    assert reaper.closed == 1
    assert reaper.pending() == 0


@needs_cgroups
def test_empty_cgroups_are_recycled_and_busy_ones_removed(tmp_path: Path) -> None:
    cgroups = Cgroups(Limits(), f"w{os.getpid()}")
    threads: list[str] = []
    reaper = Reaper(cgroups, _submitter(threads))
    stale = [os.path.join(parent, "w999999999-7") for parent in cgroups.parents]
    for path in stale:  # a killed worker's (no such pid): swept when spares are made
        os.makedirs(path, exist_ok=True)
    sleeper: subprocess.Popen[bytes] | None = None
    try:
        reaper.make_spares(2)
        assert reaper.spares() == 2
        assert not any(os.path.exists(path) for path in stale)
        first = reaper.take("a")
        second = reaper.take("b")
        made = reaper.take("c")  # no spare left: made now
        assert reaper.spares() == 0
        assert len({tuple(first), tuple(second), tuple(made)}) == 3
        assert all(os.path.isdir(path) for path in made)
        # A session that wrote a file: the page cache is charged to its cgroup...
        procs = " ".join(os.path.join(path, "cgroup.procs") for path in first)
        script = f"for p in {procs}; do echo $$ > $p; done; exec head -c 16777216 /dev/zero"
        with open(tmp_path / "written", "wb") as out:
            subprocess.run(["sh", "-c", script], stdout=out, check=True, timeout=30 * UNIT)
        assert _charged(cgroups, first) >= 8 << 20
        reaper.remove(first)  # empty: kept for the next session
        assert reaper.spares() == 1
        assert reaper.take("d") == first
        assert _charged(cgroups, first) < 1 << 20  # ...and given back before it is reused
        sleeper = subprocess.Popen(["sleep", "60"])
        for path in second:  # a process left in it: killed, and the cgroup removed
            with open(os.path.join(path, "cgroup.procs"), "w") as f:
                f.write(str(sleeper.pid))
        # Reaped as soon as it is killed (a zombie not yet waited for keeps its cgroup busy).
        waiter = threading.Thread(target=sleeper.wait, name="wait-sleeper")
        waiter.start()
        reaper.remove(second)
        waiter.join(10 * UNIT)
        assert sleeper.returncode == -9
        assert not any(os.path.exists(path) for path in second)
        assert reaper.spares() == 0
        reaper.remove(made)
        reaper.flush(5 * UNIT, [first])
        assert reaper.spares() == 0
        assert not any(os.path.exists(path) for path in [*first, *made])
    finally:
        if sleeper is not None and sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()
        reaper.flush(5 * UNIT, [stale])


def _charged(cgroups: Cgroups, paths: list[str]) -> int:
    """Bytes of memory (page cache included) a cgroup is charged for."""
    name = "memory.current" if cgroups.version == 2 else "memory.usage_in_bytes"
    with open(os.path.join(paths[0], name)) as f:
        return int(f.read())


@needs_cgroups
def test_cgroups_handed_over_after_the_flush_are_removed_not_kept() -> None:
    """A spawn the dying template never answered gives its (empty) cgroups back after the
    worker's shutdown flushed the reaper: removed, not kept as a spare nobody removes."""
    cgroups = Cgroups(Limits(), f"w{os.getpid()}")
    reaper = Reaper(cgroups, _submitter([]))
    taken = reaper.take("late")
    reaper.flush(5 * UNIT)
    reaper.remove(taken)  # empty: before the fix, kept as a spare after the flush
    assert reaper.spares() == 0
    assert not any(os.path.exists(path) for path in taken)
    reaper.make_spares(2)  # nothing made after the flush
    assert reaper.spares() == 0
