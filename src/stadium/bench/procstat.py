"""Server-side figures from /proc: CPU, RSS and threads of a process and of its tree.

Dependency-free (Linux /proc only; ``stadium demo`` uses it too):

* :func:`read_stat` — one process's CPU seconds, RSS and threads, from
  ``/proc/PID/stat``;
* :func:`process_tree` — a process and all its descendants (from the kernel's lists of
  children, or every process's parent in /proc); :func:`process_trees` — those of several;
* :func:`run_time_s` — CPU seconds of trees to the nanosecond (schedstat);
* :func:`tree_cpu_s` — CPU seconds of a tree, reaped children included;
* :func:`terminate` — SIGTERM a server started here, SIGKILL after a grace;
* :func:`count_fds` — a process's open file descriptors;
* :func:`tree_figures` — RSS, threads, processes, fds and CPU of a tree, now;
* :class:`ServerSampler` — samples a server's tree every ``interval``
  seconds from a background thread during one point:

  * **idle RSS** — the tree's resident memory just before the load starts;
  * **peak RSS** — the largest sum of the tree's RSS seen in one sample (a
    sampled peak: a spike shorter than the interval can be missed);
  * **peak threads / processes** — the largest counts seen in one sample;
  * **CPU** — user + system time the tree spent during the point: for each
    process, its last sampled CPU time minus its CPU time at the start (0 for
    processes born during the point). A process that exits between samples
    loses at most one interval of CPU.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from stadium.bench.results import ServerStats

_MIB = 1024.0 * 1024.0
_PROC = Path("/proc")


class ProcStat(NamedTuple):
    """One process at one instant."""

    cpu_s: float
    """User + system CPU seconds since it started (10 ms ticks on most kernels)."""
    rss_bytes: int
    """Resident memory."""
    threads: int


def _stat_fields(pid: int) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command name (field 3, the state, first)."""
    text = (_PROC / str(pid) / "stat").read_text()
    return text.rsplit(")", 1)[1].split()


def read_stat(pid: int) -> ProcStat:
    """CPU seconds, RSS bytes and thread count of ``pid``; ``OSError`` if it is gone."""
    fields = _stat_fields(pid)
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    rss = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
    return ProcStat(cpu, rss, int(fields[17]))


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants alive now (``[]`` if ``pid`` is gone), parents first."""
    return process_trees([pid])


def _children(pid: int) -> list[int] | None:
    """``pid``'s children, from each of its threads' ``/proc/PID/task/TID/children``
    (``[]`` when it is gone; ``None`` when the kernel has no such files)."""
    try:
        tids = os.listdir(_PROC / str(pid) / "task")
    except OSError:
        return []
    kids: list[int] = []
    for tid in tids:
        try:
            text = (_PROC / str(pid) / "task" / tid / "children").read_text()
        except FileNotFoundError:
            if (_PROC / str(pid) / "task" / tid).exists():
                return None  # CONFIG_PROC_CHILDREN is off: scan every process instead
            continue  # the thread ended while we looked
        except OSError:
            continue
        kids += [int(k) for k in text.split()]
    return kids


def process_trees(pids: Sequence[int]) -> list[int]:
    """Every process of the trees rooted at ``pids`` (each once), parents first: walked
    down the kernel's lists of each process's children, or, where the kernel keeps none,
    from one scan of every process's parent in /proc. (The walk reads a few files for a
    server's tree; the scan reads every process's, which took ~6 ms on a busy machine and
    held the GIL of the load generator sampling it.)"""
    tree = _walk(pids, _children)
    return tree if tree is not None else _scan_trees(pids)


def _walk(pids: Sequence[int], children: Callable[[int], list[int] | None]) -> list[int] | None:
    """The trees rooted at ``pids``, breadth first, ``children(pid)`` giving each process's
    children; ``None`` as soon as it gives ``None``."""
    tree: list[int] = []
    seen: set[int] = set()
    for root in pids:
        if root in seen or not (_PROC / str(root)).exists():
            continue
        at = len(tree)
        tree.append(root)
        seen.add(root)
        while at < len(tree):  # the list grows as children are found
            kids = children(tree[at])
            at += 1
            if kids is None:
                return None
            for c in kids:
                if c not in seen:
                    seen.add(c)
                    tree.append(c)
    return tree


def _scan_trees(pids: Sequence[int]) -> list[int]:
    """:func:`process_trees` from one scan of /proc (every process's parent)."""
    children: dict[int, list[int]] = {}
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int(_stat_fields(int(entry.name))[1])
        except (OSError, IndexError, ValueError):
            continue  # exited while we looked
        children.setdefault(parent, []).append(int(entry.name))
    return _walk(pids, lambda p: children.get(p, [])) or []


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid``'s tree now, each process's own and that of the children it
    has reaped (``utime + stime + cutime + cstime``, 10 ms ticks): the processes of
    sessions that came and went still count, through their parents."""
    total = 0
    for p in process_tree(pid):
        try:
            fields = _stat_fields(p)
        except (OSError, IndexError):
            continue
        total += sum(int(x) for x in fields[11:15])
    return total / os.sysconf("SC_CLK_TCK")


def terminate(proc: subprocess.Popen[Any], grace: float = 30.0) -> None:
    """Stop a server this process started: SIGTERM (it drains), SIGKILL after ``grace``
    seconds; reaped either way."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_time_s(pids: Sequence[int]) -> float:
    """CPU seconds the trees rooted at ``pids`` have run, to the nanosecond: the sum
    of ``/proc/PID/task/TID/schedstat``'s run time over every live thread (threads
    that already exited are not counted; ``/proc/PID/stat`` counts them, in 10 ms
    ticks). For CPU per step of small points, where ticks are too coarse."""
    total = 0
    for pid in process_trees(pids):
        try:
            tids = os.listdir(_PROC / str(pid) / "task")
        except OSError:
            continue
        for tid in tids:
            try:
                total += int((_PROC / str(pid) / "task" / tid / "schedstat").read_text().split()[0])
            except (OSError, IndexError, ValueError):
                continue
    return total / 1e9


def count_fds(pid: int) -> int:
    """Open file descriptors of ``pid`` (entries of ``/proc/PID/fd``); ``OSError`` if
    it is gone or not ours to read."""
    return len(os.listdir(_PROC / str(pid) / "fd"))


class TreeFigures(NamedTuple):
    """A process tree at one instant (sums over its processes)."""

    rss_bytes: int
    threads: int
    procs: int
    fds: int
    cpu_s: float


def tree_figures(pid: int) -> TreeFigures:
    """RSS, threads, processes, open fds and CPU seconds of ``pid``'s tree, now
    (processes that exit while read are left out)."""
    rss = threads = procs = fds = 0
    cpu = 0.0
    for p in process_tree(pid):
        try:
            s = read_stat(p)
            n = count_fds(p)
        except (OSError, IndexError, ValueError):
            continue
        rss += s.rss_bytes
        threads += s.threads
        procs += 1
        fds += n
        cpu += s.cpu_s
    return TreeFigures(rss, threads, procs, fds, cpu)


class _Sample(NamedTuple):
    rss: float
    threads: int
    procs: int
    cpu: dict[int, float]


def _sample_tree(pids: Sequence[int]) -> _Sample:
    rss = 0.0
    threads = 0
    cpu: dict[int, float] = {}
    for p in process_trees(pids) if pids else []:
        try:
            s = read_stat(p)
        except (OSError, IndexError, ValueError):
            continue
        rss += s.rss_bytes
        threads += s.threads
        cpu[p] = s.cpu_s
    return _Sample(rss, threads, len(cpu), cpu)


class ServerSampler:
    """Samples a server's process tree during one point.

    Usage::

        sampler = ServerSampler(pid)
        sampler.start()        # records the idle baseline
        ...                    # run the load
        stats = sampler.stop() # peak RSS, threads, CPU seconds

    ``pid`` ``None`` (a remote server) yields empty :class:`ServerStats`; several
    pids (the nodes of a url arm with several endpoints) are sampled together,
    their trees' figures summed.

    The samples are taken by a thread of the calling process: each scans /proc
    (~6 ms of Python here), and while it holds the GIL the process's event loop
    waits, so a client that times replies sees those waits as latency. ``interval``
    0 takes no samples in between: only the baseline and the last reading (CPU is
    exact for processes alive at the end; the peaks are those two readings').
    """

    def __init__(self, pid: int | Sequence[int] | None, interval: float = 0.1) -> None:
        self.pids: tuple[int, ...] = (
            () if pid is None else (pid,) if isinstance(pid, int) else tuple(pid)
        )
        self.pid = self.pids[0] if self.pids else None
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._base_cpu: dict[int, float] = {}
        self._last_cpu: dict[int, float] = {}
        self._idle_rss = 0.0
        self._peak_rss = 0.0
        self._peak_threads = 0
        self._peak_procs = 0
        self._lock = threading.Lock()

    def _record(self) -> None:
        s = _sample_tree(self.pids)
        with self._lock:
            self._peak_rss = max(self._peak_rss, s.rss)
            self._peak_threads = max(self._peak_threads, s.threads)
            self._peak_procs = max(self._peak_procs, s.procs)
            self._last_cpu.update(s.cpu)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._record()

    def start(self) -> None:
        """Take the idle baseline and start sampling."""
        if self.pid is None:
            return
        s = _sample_tree(self.pids)
        self._idle_rss = self._peak_rss = s.rss
        self._peak_threads, self._peak_procs = s.threads, s.procs
        self._base_cpu = dict(s.cpu)
        self._last_cpu = dict(s.cpu)
        if self.interval > 0:
            self._thread = threading.Thread(
                target=self._run, name="stadium-bench-sampler", daemon=True
            )
            self._thread.start()

    def stop(self) -> ServerStats:
        """Take a last sample, stop the thread and return the point's figures."""
        if self.pid is None:
            return ServerStats()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self._record()
        with self._lock:
            cpu = sum(v - self._base_cpu.get(pid, 0.0) for pid, v in self._last_cpu.items())
            return ServerStats(
                idle_rss_mb=self._idle_rss / _MIB,
                peak_rss_mb=self._peak_rss / _MIB,
                peak_threads=self._peak_threads,
                peak_procs=self._peak_procs,
                cpu_s=max(0.0, cpu),
            )
