"""``--isolation vm``: each session's env in a microVM of its own, through a real server.

One server, two VM sessions side by side (each VM boots in seconds under QEMU's emulator
on a host whose KVM cannot run a stock kernel; with hardware KVM, faster): each sees a
kernel and a ``/proc`` of its own, the hostile battery's basics stay inside its guest, a
fork of one is a VM of its own with its parent's state, and a crash of one guest's
kernel ends only that session (``ENV_CRASHED``) while the other keeps stepping; VMs
restored from one snapshot get random state of their own; a VM that ends while it boots
says why. ``make test`` installs QEMU and the guest kernel as root (``make vm-deps``).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import stadium
from stadium import ConfigError, ErrorCode, ServerConfig
from stadium._server.isolation.worker.vm import vm_unavailable
from stadium._server.processes.worker import isolation_config
from stadium.bench.arms import spawn_server
from tests.conftest import UNIT, wait_until

TARGET = f"{Path(__file__).with_name('vm_env.py')}:VmHostile"
DIES = f"{Path(__file__).with_name('vm_dies.py')}:DiesAtBoot"
WHY_NO_VM = vm_unavailable()

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900 * UNIT)]


async def _step(env: stadium.AsyncClient[Any], do: str, arg: str = "") -> str:
    step = await env.step({"do": do, "arg": arg})
    text: str = step.observation["text"]
    return text


def test_vm_is_a_mode_and_says_why_it_cannot_run() -> None:
    config = ServerConfig(target=TARGET, isolation="vm")
    if WHY_NO_VM is None:
        settings = isolation_config(config, None)
        assert settings is not None
        assert settings.mode == "vm"
    else:  # refused before the server binds, naming what is missing
        with pytest.raises(ConfigError, match="--isolation vm cannot run here"):
            isolation_config(config, None)
    with pytest.raises(ConfigError, match="--isolation must be"):
        ServerConfig(target="echo", isolation="kvm")
    with pytest.raises(ConfigError, match="--image and --images need --isolation sandbox"):
        isolation_config(ServerConfig(target=TARGET, isolation="vm", image="x"), None)


@pytest.fixture
def slow_boots(monkeypatch: pytest.MonkeyPatch) -> None:
    """The servers' bound on a VM's boot, scaled as every timeout here: an emulated guest
    boots in 15-100 s on a loaded 2-core host (the template's, once per server)."""
    monkeypatch.setenv("STADIUM_VM_BOOT_S", str(180 * UNIT))


@pytest.fixture
def in_tmp() -> Iterator[str]:
    """The hostile env served from a file under ``/tmp``, as a checkout there (a CI's clean
    clone) has all its code: the guest's own ``/tmp`` must hide none of it (it did)."""
    with tempfile.TemporaryDirectory(prefix="stadium-vm-target-", dir="/tmp") as here:
        Path(here, "vm_here.py").write_text(
            "from tests.isolation.vm_env import VmHostile\n\n\nclass InTmp(VmHostile):\n    pass\n"
        )
        yield f"{here}/vm_here.py:InTmp"


@pytest.mark.skipif(WHY_NO_VM is not None, reason=f"--isolation vm: {WHY_NO_VM}")
async def test_each_session_has_its_own_kernel_and_a_guest_crash_ends_only_its_own(
    in_tmp: str, slow_boots: None
) -> None:
    host_kernel = os.uname().release
    marker = f"/tmp/stadium-vm-test-{os.getpid()}"
    serving = spawn_server(
        in_tmp, "--isolation", "vm", "--step-timeout", str(60 * UNIT), "--drain-timeout", "0",
        timeout=240 * UNIT,
    )  # fmt: skip
    with serving as (_, url):
        async with (
            stadium.AsyncClient(url, request_timeout=300 * UNIT) as a,
            stadium.AsyncClient(url, request_timeout=300 * UNIT) as b,
        ):
            ra, rb = await asyncio.gather(a.reset(), b.reset())
            # the env's process is the guest's pid 1, as root of a kernel of its own
            assert ra.observation["pid"] == rb.observation["pid"] == 1
            kernel = await _step(a, "uname")
            assert kernel != host_kernel
            assert kernel == await _step(b, "uname")
            # restored from one snapshot, yet each with random state of its own
            assert await _step(a, "random") != await _step(b, "random")
            procs = (await _step(a, "procs")).split()
            assert "1" in procs
            assert str(os.getpid()) not in procs or len(procs) < 50  # not the host's /proc
            # the hostile basics stay in the guest: its files, no network, its "parent"
            assert await _step(a, "write", marker) == marker
            assert not await asyncio.to_thread(os.path.exists, marker)
            with pytest.raises(stadium.StadiumError) as refused:
                await _step(a, "connect", "127.0.0.1:22")
            assert refused.value.code == ErrorCode.EXECUTION_ERROR
            # fork: a copy of a's VM sees a's state at the fork, then each goes its own way
            assert await _step(a, "write", "/tmp/before") == "/tmp/before"
            c = await a.fork()
            try:
                assert await _step(c, "read", "/tmp/before") == "secret"
                assert await _step(c, "uname") == kernel
                await _step(a, "write", "/tmp/parent")
                await _step(c, "write", "/tmp/child")
                assert await _step(c, "read", "/tmp/child") == "secret"
                for env, other in ((a, "/tmp/child"), (c, "/tmp/parent")):
                    with pytest.raises(stadium.StadiumError) as unseen:
                        await _step(env, "read", other)
                    assert unseen.value.code == ErrorCode.EXECUTION_ERROR
            finally:
                await c.close()
            # a crash of a's guest kernel: a's session only
            with pytest.raises(stadium.StadiumError) as crashed:
                await _step(a, "panic")
            assert crashed.value.code == ErrorCode.ENV_CRASHED
            for n in range(3):  # the neighbour VM steps on
                assert await _step(b, "echo", f"after {n}") == f"after {n}"
            # a's next reset: a fresh VM (restored again), whose env's death ends it too
            assert (await a.reset()).observation["pid"] == 1
            assert await _step(a, "echo", "again") == "again"
            with pytest.raises(stadium.StadiumError) as segfault:
                await _step(a, "segfault")
            assert segfault.value.code == ErrorCode.ENV_CRASHED
            assert await _step(b, "echo", "still") == "still"
            # b's guest out of memory: its kernel panics (the env is its init), and says so
            with pytest.raises(stadium.StadiumError) as oom:
                await _step(b, "memory")
            assert oom.value.code == ErrorCode.LIMIT_EXCEEDED
            assert oom.value.context["limit"] == "memory"
        await wait_until(lambda: _metric(url, "stadium_isolated_processes") == 0, 30 * UNIT,
                         "VMs ended")  # fmt: skip
        assert _metric(url, "stadium_isolated_crashes_total") == 2


@pytest.mark.skipif(WHY_NO_VM is not None, reason=f"--isolation vm: {WHY_NO_VM}")
async def test_a_vm_that_ends_while_it_boots_says_why(slow_boots: None) -> None:
    # its env's import ends the guest's init: the guest kernel panics, QEMU exits; the
    # error names QEMU's exit status and carries the end of the guest's console
    serving = spawn_server(DIES, "--isolation", "vm", "--drain-timeout", "0", timeout=240 * UNIT)
    with serving as (_, url):
        async with stadium.AsyncClient(url, request_timeout=300 * UNIT) as env:
            with pytest.raises(stadium.StadiumError) as failed:
                await env.reset()
    assert failed.value.code == ErrorCode.EXECUTION_ERROR
    said = failed.value.message
    assert "an isolated env's VM ended while it booted" in said
    assert "QEMU exited with code 0" in said  # the guest's panic: -no-reboot, panic=-1
    assert "stadium vm guest: SystemExit: the env's import ends the guest's init" in said
    assert "Kernel panic" in said
    assert "Attempted to kill init! exitcode=0x00000100" in said


@pytest.mark.skipif(WHY_NO_VM is not None, reason=f"--isolation vm: {WHY_NO_VM}")
async def test_a_vm_slower_than_its_boot_bound_is_told_slow_not_crashed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STADIUM_VM_BOOT_S", "0.01")  # no guest boots in 10 ms
    serving = spawn_server(TARGET, "--isolation", "vm", "--drain-timeout", "0", timeout=240 * UNIT)
    with serving as (_, url):
        async with stadium.AsyncClient(url, request_timeout=300 * UNIT) as env:
            with pytest.raises(stadium.StadiumError) as slow:
                await env.reset()
    assert slow.value.code == ErrorCode.EXECUTION_ERROR
    assert "did not boot within 0.01 s (killed then: the host is slow)" in slow.value.message
    assert "ended" not in slow.value.message


def _metric(url: str, name: str) -> float:
    """One unlabelled series of the server's ``/metrics``."""
    with urllib.request.urlopen(url + "/metrics", timeout=10 * UNIT) as reply:
        for line in reply.read().decode().splitlines():
            if line.split(" ")[0] == name:
                return float(line.split(" ")[1])
    raise AssertionError(f"{name} not in /metrics")
