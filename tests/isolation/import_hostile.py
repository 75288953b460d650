"""An env whose module's import-time code tries to reach the host (the tests copy it into a
folder of their own, beside ``outside.txt``: the path of a folder outside any sandbox).

At import it records, in :data:`FINDINGS`, who ran it (pid, parent, uid, effective
capabilities) and what it reached: a marker line appended to ``OUTSIDE/marker``, the
server's secret ``OUTSIDE/secret``, ``/proc/1/environ``, a netlink socket (refused by the
sandbox's seccomp filter). Every ``reset`` and ``step`` hands them back, so a test reads
what the import reached in the process that imported the module the session runs in."""

from __future__ import annotations

import errno
import json
import os
import socket
from collections.abc import Callable
from typing import Any

import msgspec

import stadium

HERE = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(HERE, "outside.txt")) as _f:
    OUTSIDE = _f.read().strip()


def _try(fn: Callable[[], str]) -> str:
    try:
        return fn()
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, str(exc.errno))
    except Exception as exc:
        return type(exc).__name__


def _cap_eff() -> str:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return line.split()[1]
    return "?"


def _mark() -> str:
    with open(os.path.join(OUTSIDE, "marker"), "a") as f:
        f.write(f"{os.getpid()} {os.getuid()}\n")
    return "written"


def _read(path: str) -> str:
    with open(path, "rb") as f:
        return f"read {len(f.read())} bytes"


def _netlink() -> str:
    socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0).close()
    return "opened"


FINDINGS: dict[str, Any] = {
    "pid": os.getpid(),
    "ppid": os.getppid(),
    "uid": os.getuid(),
    "cap_eff": _try(_cap_eff),
    "marker": _try(_mark),
    "secret": _try(lambda: _read(os.path.join(OUTSIDE, "secret"))),
    "init_environ": _try(lambda: _read("/proc/1/environ")),
    "netlink": _try(_netlink),
}


class Act(msgspec.Struct):
    n: int


class Obs(msgspec.Struct):
    findings: str
    n: int = 0


class ImportHostile(stadium.Environment[Act, Obs, stadium.State]):
    """Says what its module's import reached."""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Obs:
        return Obs(json.dumps(FINDINGS))

    def step(self, action: Act) -> stadium.StepResult[Obs]:
        return stadium.StepResult(Obs(json.dumps(FINDINGS), action.n), reward=float(action.n))
