"""The hostile env (:mod:`.hostile`) with what only a VM's guest can be asked: its kernel,
its ``/proc``, and a crash of its kernel (``--isolation vm`` tests)."""

from __future__ import annotations

import os
import random

from tests.isolation.hostile import Hostile


class VmHostile(Hostile):
    """``uname``, ``procs``, ``random``, ``panic`` on top of :class:`Hostile`'s actions."""

    def _do(self, do: str, arg: str) -> str:
        if do == "uname":  # the kernel the env runs on
            return os.uname().release
        if do == "procs":  # the processes it can see
            return " ".join(sorted(p for p in os.listdir("/proc") if p.isdigit()))
        if do == "random":  # the guest's random state (clones of one snapshot must differ)
            return f"{os.urandom(16).hex()} {random.random()}"
        if do == "panic":  # the guest's kernel crashes (its root may: the guest is its own)
            with open("/proc/sysrq-trigger", "w") as trigger:
                trigger.write("c")
            return "still here"
        return super()._do(do, arg)
