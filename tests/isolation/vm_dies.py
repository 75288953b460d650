"""An env whose import, inside an ``--isolation vm`` guest, ends the guest's init (pid 1):
the guest kernel panics while the VM boots (``tests/isolation/test_vm.py``)."""

from __future__ import annotations

import os

from tests.isolation.vm_env import VmHostile

if os.getpid() == 1:  # only in a guest: there the env's process is the init, which ends
    raise SystemExit("the env's import ends the guest's init")


class DiesAtBoot(VmHostile):
    """Never served: its import ends the guest."""
