"""An isolated session's env process, as the episode ledger reads it: its CPU time and
peak resident memory, from ``/proc`` (procfs files the kernel makes: never anything the
sandboxed process writes, and each read is a few µs, once per episode end).

``--isolation process`` only: there the worker knows the env process's pid. A sandboxed
env process is known by a key, not a pid (``isolation.proc``); its cost says
``cpu_source: unmeasured`` (docs/PROTOCOL.md, "Episode cost").
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


__all__ = ["cpu_seconds", "env_pid", "peak_rss", "reset_peak"]
