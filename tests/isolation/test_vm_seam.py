"""``--isolation vm``'s seam, attacked from inside the guest (issue #30): the env's code,
as its guest's root, against the worker that reads it. One server, two VM sessions:

- a forged out-of-memory panic (the kernel's line, printed on the console and written to
  the kernel's log, then an exit) is a crash of the env's VM, never ``LIMIT_EXCEEDED``
  (``memory``): that verdict rests on QEMU's own peak memory, which the guest cannot
  forge without filling its RAM (it was taken from the console's text alone);
- a reply header of 2 GiB written straight on the channel: ``ENV_PROTOCOL``, that session
  only;
- a console flooded from a thread: both sessions keep stepping;
- new guest code, translated anew pass after pass (4 MiB of basic blocks, 4 times): its
  QEMU's peak memory grows by at most 160 MiB (with QEMU's default 1 GiB code buffer, by
  1,235 MiB in 8 passes: ``tb-size`` bounds it now);
- what the guest is given of the host: one virtio device (the console and channel), no
  network interface but ``lo``, no vsock, no 9p or virtiofs mount;
- a real out-of-memory panic is still ``LIMIT_EXCEEDED`` (``memory``);

and the ``code`` env served in VMs: a submission that takes its grader's channel to the
worker (the guest's pid 1's descriptor, ``pidfd_getfd``, as the guest's root) and writes a
reply of its own on it (a reward of 1000) reaches nothing: the guest's init fences itself
off from what it starts (it forged the reward).

The worker-side halves that need no VM (a console flood's cost to the loop, QEMU's QMP
replies) are in ``tests/isolation/test_vm_seam_unit.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path
from typing import Any

import pytest

import stadium
from stadium import ErrorCode
from stadium._server.isolation.worker.vm import vm_unavailable
from stadium.bench.arms import spawn_server
from tests.conftest import UNIT, wait_until
from tests.isolation.test_vm import _metric

TARGET = f"{Path(__file__).with_name('vm_seam_env.py')}:VmSeam"
WHY_NO_VM = vm_unavailable()

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900 * UNIT),
    pytest.mark.skipif(WHY_NO_VM is not None, reason=f"--isolation vm: {WHY_NO_VM}"),
]


async def _step(env: stadium.AsyncClient[Any], do: str, arg: str = "") -> str:
    step = await env.step({"do": do, "arg": arg})
    text: str = step.observation["text"]
    return text


def _qemu_peaks(server: int) -> dict[int, int]:
    """The peak resident memory (``VmHWM``, bytes) of each QEMU process under ``server``."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{entry}/stat", "rb") as f:
                parents[int(entry)] = int(f.read().rsplit(b")", 1)[1].split()[1])
    peaks = {}
    for pid in parents:
        up, hops = parents.get(pid), 0
        while up not in (None, 0, 1, server) and hops < 8:
            up, hops = parents.get(up), hops + 1
        if up != server:
            continue
        with contextlib.suppress(OSError, ValueError):
            with open(f"/proc/{pid}/comm", "rb") as f:
                comm = f.read()
            with open(f"/proc/{pid}/status", "rb") as f:
                status = f.read()
            if comm.startswith(b"qemu-system"):
                for line in status.splitlines():
                    if line.startswith(b"VmHWM:"):
                        peaks[pid] = int(line.split()[1]) * 1024
    return peaks


async def test_a_hostile_guest_forges_no_verdict_and_reaches_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STADIUM_VM_BOOT_S", str(180 * UNIT))
    serving = spawn_server(
        TARGET, "--isolation", "vm", "--sandbox-memory", "512", "--sandbox-output", "drop",
        "--step-timeout", str(120 * UNIT), "--drain-timeout", "0", timeout=240 * UNIT,
    )  # fmt: skip
    with serving as (server, url):
        async with (
            stadium.AsyncClient(url, request_timeout=300 * UNIT) as a,
            stadium.AsyncClient(url, request_timeout=300 * UNIT) as b,
        ):
            await asyncio.gather(a.reset(), b.reset())
            # what of the host the guest has: nothing but its channel and console
            said = dict(part.split("=", 1) for part in (await _step(a, "shares")).split())
            assert said["virtio"] == "0x0003", said  # virtio-serial: the channel, the console
            assert said["net"] == "lo", said
            assert said["vsock"] == "False", said
            assert not {"9p", "virtiofs", "nfs", "fuse"} & set(said["fs"].split(",")), said
            # the kernel's out-of-memory line, forged: a crash, not a memory limit
            with pytest.raises(stadium.StadiumError) as forged:
                await _step(b, "forge_oom")
            assert forged.value.code == ErrorCode.ENV_CRASHED, forged.value
            await b.reset()
            # a console flooded: both sessions step on
            assert await _step(a, "flood") == "flooding"
            for n in range(3):
                assert await _step(b, "echo", f"b {n}") == f"b {n}"
                assert await _step(a, "echo", f"a {n}") == f"a {n}"
            # a 2 GiB reply header on the channel: refused by its header, this session only
            with pytest.raises(stadium.StadiumError) as oversize:
                await _step(b, "oversize")
            assert oversize.value.code == ErrorCode.ENV_PROTOCOL, oversize.value
            assert oversize.value.context["limit"] == "frame_bytes"
            await b.reset()
            assert await _step(b, "echo", "b again") == "b again"
            # new code, translated anew pass after pass: QEMU's own memory stays bounded
            before = _qemu_peaks(server.pid)
            assert int(await _step(b, "jit", "4")) == sum(range(1, 5)) << 19
            after = _qemu_peaks(server.pid)
            grown = max(after[pid] - before.get(pid, after[pid]) for pid in after)
            assert grown <= 160 << 20, f"a QEMU grew by {grown >> 20} MiB running new code"
            # a real out-of-memory panic (a console not flooded: a guest's kernel drops what
            # it prints on a console whose queue is full, its last words too): the limit
            with pytest.raises(stadium.StadiumError) as oom:
                await _step(b, "memory")
            assert oom.value.code == ErrorCode.LIMIT_EXCEEDED, oom.value.message
            assert oom.value.context["limit"] == "memory"
        await wait_until(lambda: _metric(url, "stadium_isolated_processes") == 0, 30 * UNIT,
                         "VMs ended")  # fmt: skip
        assert _metric(url, "stadium_isolated_crashes_total") == 1
        assert _metric(url, "stadium_isolated_limit_kills_total") == 1
        assert _metric(url, "stadium_isolated_protocol_errors_total") == 1


#: A submission to the ``code`` env that answers its tests right and, meanwhile, takes its
#: grader's channel to the worker (the guest's pid 1's descriptor, through ``pidfd_getfd``:
#: the guest's root may, unless the grader is out of its reach) and writes on it a step's
#: reply of its own: a reward of 1000. It then tries the other ways to its grader or the
#: guest's kernel, each refused: its memory, descriptors, ptrace, the channel's device,
#: a usermode helper, the image's files, a mount, ``/dev/mem``, a kernel module.
FORGER = """
import ctypes, glob, os, struct

libc = ctypes.CDLL(None, use_errno=True)


def probe(name, attempt):
    try:
        err = ctypes.get_errno() if attempt() == -1 else 0
    except OSError as exc:
        err = exc.errno
    # EPERM, EACCES, EBUSY, EROFS, ENXIO: refused; anything else is said
    print(f"PROBE {name}: {'refused' if err in (1, 13, 16, 30, 6) else f'errno {err}'}")


def write(path, data):
    with open(path, "wb") as f:
        f.write(data)


def add(a, b):
    pidfd = libc.syscall(434, 1, 0)  # pidfd_open(1): the grader, the guest's init
    for fd in range(64):
        try:
            target = os.readlink(f"/proc/1/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/dev/vport"):
            mine = libc.syscall(438, pidfd, fd, 0)  # pidfd_getfd
            if mine >= 0:
                body = b"\\x96\\x00\\x80\\xcb" + struct.pack(">d", 1000.0) + b"\\xc3\\xc2\\x80"
                os.write(mine, struct.pack("<I", len(body)) + body)
    probe("proc-mem", lambda: open("/proc/1/mem", "r+b").close())
    probe("proc-fd", lambda: os.readlink("/proc/1/fd/0"))
    probe("ptrace", lambda: libc.ptrace(16, 1, 0, 0))  # PTRACE_ATTACH
    probe("channel", lambda: [os.open(p, os.O_RDWR) for p in glob.glob("/dev/vport*")] and 0)
    probe("core-pattern", lambda: write("/proc/sys/kernel/core_pattern", b"|/tmp/x"))
    probe("image-file", lambda: write("/etc/hosts", b"forged"))
    probe("mount", lambda: libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 0, None))
    probe("dev-mem", lambda: open("/dev/mem", "rb").close())
    probe("module", lambda: libc.syscall(313, 0, b"", 0))  # finit_module
    return a + b
"""


async def test_a_graded_submission_cannot_reach_its_grader_in_the_guest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STADIUM_VM_BOOT_S", str(180 * UNIT))
    serving = spawn_server(
        "code", "--isolation", "vm", "--step-timeout", str(120 * UNIT), "--drain-timeout", "0",
        timeout=240 * UNIT,
    )  # fmt: skip
    with serving as (_, url):
        async with stadium.AsyncClient(url, request_timeout=300 * UNIT) as env:
            await env.reset(options={"task": "add"})
            step = await env.step({"code": FORGER})
            assert step.reward == 1.0, step  # every test passed: its own reward, no more
            assert step.observation["passed"] == step.observation["total"]
            probes = [line for line in step.observation["output"].splitlines() if "PROBE" in line]
            assert len(probes) >= 9, step.observation["output"]
            assert all(line.endswith(": refused") for line in probes), probes
            again = await env.step({"code": "def add(a, b):\n    return a - b\n"})
            assert again.reward is not None
            assert again.reward < 1.0, again  # the grader's own verdict still
