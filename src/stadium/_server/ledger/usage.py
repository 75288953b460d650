"""An isolated session's env process, as the episode ledger reads it: its CPU time and
peak memory, from files the kernel makes (never anything the env process writes; each
read is a few µs, at an episode's start and end, not per step).

``--isolation process``: the worker knows the env process's pid: ``/proc/PID/stat`` and
``VmHWM`` (:func:`cpu_seconds`, :func:`peak_rss`). ``--isolation sandbox``: a sandboxed
env process is known by a key, not a pid (``isolation.proc``), but its session has
cgroups of its own (:class:`Cgroup`): cgroup v1's ``cpuacct.usage`` and
``memory.max_usage_in_bytes`` (reset at each episode's start), v2's ``cpu.stat``
``usage_usec`` and ``memory.peak`` (Linux ≥ 6.12 restarts it for one open file
description: the session's :class:`Cgroup` holds one open from its first episode's start
to its end, writes to it at each episode's start and reads through it; on older kernels,
whose ``memory.peak`` cannot be written, the peak is not read). They are read on the event
loop: an executor's round trip costs the loop as much (measured: ~7 µs per file opened,
read and closed; ~85 µs of CPU for the hop and reads), and would hold back the reply that
ends the episode.
"""

from __future__ import annotations

import os
from typing import Any

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def env_pid(env: Any) -> int | None:
    """The pid of an isolated env's process, when it has one and it is a pid (``process``
    mode: no cgroups), else ``None``."""
    proc = getattr(env, "proc", None)
    if proc is None or getattr(proc, "cgroups", None):
        return None
    pid = getattr(proc, "pid", 0)
    return pid if isinstance(pid, int) and pid > 0 else None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU of process ``pid`` and of its children it waited for (``/proc/PID/
    stat`` utime, stime, cutime, cstime; clock ticks, 10 ms here); ``None`` if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return sum(int(x) for x in fields[11:15]) / _TICK
    except (OSError, IndexError, ValueError):
        return None


def peak_rss(pid: int) -> int | None:
    """Process ``pid``'s peak resident memory in bytes (``VmHWM``); ``None`` if gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        return None
    return None


def reset_peak(pid: int) -> None:
    """Start process ``pid``'s peak resident memory again from its current (``clear_refs``
    5; needs the right to trace it: the worker's own child). Ignored where refused."""
    try:
        with open(f"/proc/{pid}/clear_refs", "wb") as f:
            f.write(b"5")
    except OSError:
        pass


class Cgroup:
    """The files of one sandboxed session's cgroups the ledger reads (``paths``: the
    session's cgroup folders, one per hierarchy in v1 — the hierarchy's name is the
    folder's grandparent's: ``cpuacct``, ``cpu,cpuacct``, ``memory`` — or one in v2)."""

    __slots__ = ("cpu", "paths", "peak", "peak_fd", "v2")

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths
        self.v2 = len(paths) == 1
        self.cpu: str | None = None
        self.peak: str | None = None
        self.peak_fd = -1
        """v2: ``memory.peak`` held open (its peak restarts for this descriptor only)."""
        if self.v2:
            self.cpu = os.path.join(paths[0], "cpu.stat")
            self.peak = os.path.join(paths[0], "memory.peak")
            return
        cpu = None
        for path in paths:
            hierarchy = os.path.basename(os.path.dirname(os.path.dirname(path))).split(",")
            if "cpuacct" in hierarchy:
                self.cpu = os.path.join(path, "cpuacct.usage")
            elif "cpu" in hierarchy:
                cpu = path
            if "memory" in hierarchy:
                self.peak = os.path.join(path, "memory.max_usage_in_bytes")
        if self.cpu is None and cpu is not None:  # cpuacct's files may be under cpu's name
            self.cpu = os.path.join(cpu, "cpuacct.usage")

    def cpu_seconds(self) -> float | None:
        """The CPU time of every process the session's cgroup has held (``None``: not
        readable, or no ``cpuacct`` hierarchy)."""
        if self.cpu is None:
            return None
        data = _read(self.cpu)
        if data is None:
            return None
        try:
            if not self.v2:
                return int(data) / 1e9
            for line in data.splitlines():
                if line.startswith(b"usage_usec "):
                    return int(line.split()[1]) / 1e6
        except ValueError:
            return None
        return None

    def peak_bytes(self) -> int | None:
        """The most memory the cgroup was charged since :meth:`reset_peak` (v1: resident
        pages, page cache and kernel memory; v2: the same, read through the descriptor
        :meth:`reset_peak` wrote to)."""
        if self.v2:
            try:
                data = None if self.peak_fd < 0 else os.pread(self.peak_fd, 64, 0)
            except OSError:
                data = None
        else:
            data = None if self.peak is None else _read(self.peak)
        try:
            return None if data is None else int(data)
        except ValueError:
            return None

    def reset_peak(self) -> None:
        """Start the peak again from the current usage (v1: ``0`` written to it; v2: any
        text written to ``memory.peak`` through the descriptor kept open, Linux ≥ 6.12)."""
        if self.v2:
            self._reset_v2()
        elif self.peak is not None:
            try:
                fd = os.open(self.peak, os.O_WRONLY)
                try:
                    os.write(fd, b"0")
                finally:
                    os.close(fd)
            except OSError:
                pass

    def _reset_v2(self) -> None:
        if self.peak is None:
            return
        try:
            if self.peak_fd < 0:
                self.peak_fd = os.open(self.peak, os.O_RDWR | os.O_CLOEXEC)
            os.write(self.peak_fd, b"reset\n")
        except OSError:  # before Linux 6.12 memory.peak is read-only: not measured
            self.close()
            self.peak = None

    def close(self) -> None:
        """Let go of ``memory.peak``'s descriptor (v2)."""
        if self.peak_fd >= 0:
            fd, self.peak_fd = self.peak_fd, -1
            os.close(fd)

    def __del__(self) -> None:  # the session (its last episode) is gone
        self.close()


def _read(path: str) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            return os.read(fd, 4096)
        finally:
            os.close(fd)
    except OSError:
        return None


def _cgroups(env: Any) -> list[str] | None:
    paths = getattr(getattr(env, "proc", None), "cgroups", None)
    return paths if paths and isinstance(paths, list) else None


Started = tuple["int | Cgroup", float]
"""What an episode's end reads its env process's usage from (its pid, or its session's
:class:`Cgroup`) and the CPU seconds at its start."""


def episode_start(env: Any, held: Started | None, shared: bool = False) -> Started | None:
    """At an episode's start (its reset's reply): where its env process's usage is read,
    the CPU so far, the peak memory restarted; ``None``: not measurable. ``held``: the
    session's previous episode's (its :class:`Cgroup` is reused). ``shared``: a fork's
    copy, whose cgroups are its parent's: their peak is not restarted (that would cut the
    parent's running episode's peak); the copy's peak is then the cgroups' since the
    parent's restart (under v2, with no descriptor of its own, not read)."""
    pid = env_pid(env)
    if pid is not None:
        cpu = cpu_seconds(pid)
        if cpu is None:
            return None
        reset_peak(pid)
        return pid, cpu
    paths = _cgroups(env)
    if paths is None:
        return None
    old = None if held is None else held[0]
    cgroup = old if isinstance(old, Cgroup) and old.paths is paths else Cgroup(paths)
    cpu = cgroup.cpu_seconds()
    if cpu is None:
        return None
    if not shared:
        cgroup.reset_peak()
    return cgroup, cpu


def episode_usage(env: Any, started: Started) -> tuple[float, int | None, str] | None:
    """The env process's CPU seconds and peak memory since ``started``, and how they were
    measured (``process`` or ``cgroup``); ``None``: not readable (the process changed)."""
    where, cpu0 = started
    if isinstance(where, Cgroup):
        if _cgroups(env) is not where.paths:
            return None
        now = where.cpu_seconds()
        return None if now is None else (max(0.0, now - cpu0), where.peak_bytes(), "cgroup")
    if env_pid(env) != where:
        return None
    now = cpu_seconds(where)
    return None if now is None else (max(0.0, now - cpu0), peak_rss(where), "process")


__all__ = [
    "Cgroup",
    "Started",
    "cpu_seconds",
    "env_pid",
    "episode_start",
    "episode_usage",
    "peak_rss",
    "reset_peak",
]
