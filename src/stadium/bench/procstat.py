"""Server-side figures from /proc: RSS, threads and CPU of a process tree.

:class:`ServerSampler` samples the server process and all its descendants
every ``interval`` seconds from a background thread (psutil reads /proc):

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

import threading
from typing import Any

from stadium.bench.results import ServerStats

_MIB = 1024.0 * 1024.0


def _tree(pid: int) -> list[Any]:
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


class ServerSampler:
    """Samples a server's process tree during one point.

    Usage::

        sampler = ServerSampler(pid)
        sampler.start()        # records the idle baseline
        ...                    # run the load
        stats = sampler.stop() # peak RSS, threads, CPU seconds

    ``pid`` ``None`` (a remote server) yields empty :class:`ServerStats`.
    """

    def __init__(self, pid: int | None, interval: float = 0.1) -> None:
        self.pid = pid
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

    def _sample(self) -> tuple[float, int, int, dict[int, float]]:
        import psutil

        rss = 0.0
        threads = 0
        cpu: dict[int, float] = {}
        procs = _tree(self.pid) if self.pid is not None else []
        for p in procs:
            try:
                with p.oneshot():
                    rss += p.memory_info().rss
                    threads += p.num_threads()
                    t = p.cpu_times()
                    cpu[p.pid] = t.user + t.system
            except psutil.Error:
                continue
        return rss, threads, len(cpu), cpu

    def _record(self) -> None:
        rss, threads, nprocs, cpu = self._sample()
        with self._lock:
            self._peak_rss = max(self._peak_rss, rss)
            self._peak_threads = max(self._peak_threads, threads)
            self._peak_procs = max(self._peak_procs, nprocs)
            self._last_cpu.update(cpu)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._record()

    def start(self) -> None:
        """Take the idle baseline and start sampling."""
        if self.pid is None:
            return
        rss, threads, nprocs, cpu = self._sample()
        self._idle_rss = self._peak_rss = rss
        self._peak_threads, self._peak_procs = threads, nprocs
        self._base_cpu = dict(cpu)
        self._last_cpu = dict(cpu)
        self._thread = threading.Thread(target=self._run, name="stadium-bench-sampler", daemon=True)
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
