"""Sandbox hardening: the seccomp filter of every sandboxed session (``--sandbox-seccomp``)
and the pid namespace of each session's family (its init, its process, the copies ``fork``
makes).

Real servers on port 0, real sandboxed env processes (root, bubblewrap, cgroups and
libseccomp: the tests skip with the reason elsewhere; ``make sandbox-deps`` installs them).
Each hostile call is refused with the filter's answer (``EPERM``; ``clone3``: ``ENOSYS``)
while the session goes on and well-behaved sessions on the same worker keep stepping;
with ``--sandbox-seccomp off`` the same calls get the kernel's own answer, so the
assertions cannot pass without the filter."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import stat
from pathlib import Path
from typing import Any

import pytest

import stadium
from stadium import ConfigError, ErrorCode, ServerConfig
from stadium._server.isolation import sandbox_unavailable
from stadium._server.isolation.template import child as child_module
from stadium._server.isolation.template import seccomp as seccomp_module
from stadium._server.isolation.template.child import NATIVE_INIT
from tests.conftest import UNIT, serve, wait_until
from tests.isolation.neighbours import stepped, stepping

CODE = Path(__file__).with_name("kernel_hostile.py")
TARGET = f"{CODE}:KernelHostile"
WHY_NOT = sandbox_unavailable() or seccomp_module.seccomp_unavailable()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(WHY_NOT is not None, reason=f"--isolation sandbox: {WHY_NOT}"),
]
AF_NETLINK, AF_PACKET, AF_VSOCK = 16, 17, 40

#: Each hostile call (action, arg) and the filter's answer.
REFUSED = {
    ("unshare-user", ""): "EPERM",
    ("mount", ""): "EPERM",
    ("bpf", ""): "EPERM",
    ("perf", ""): "EPERM",
    ("keyctl", ""): "EPERM",
    ("io_uring", ""): "EPERM",
    ("clone3", ""): "ENOSYS",
    ("ptrace", "child"): "EPERM",
    ("socket", str(AF_NETLINK)): "EPERM",
    ("socket", str(AF_PACKET)): "EPERM",
    ("socket", str(AF_VSOCK)): "EPERM",
    ("fanotify", ""): "EPERM",
    ("personality", "0x400000"): "EPERM",  # READ_IMPLIES_EXEC: not one of Docker's values
    ("personality", "0x40000"): "EPERM",  # ADDR_COMPAT_LAYOUT
}


async def _text(env: stadium.AsyncClient[Any], do: str, arg: str = "") -> str:
    return str((await env.step({"do": do, "arg": arg})).observation["text"])


def test_config_checks_the_seccomp_setting() -> None:
    with pytest.raises(ConfigError, match="--sandbox-seccomp must be on or off"):
        ServerConfig(target="echo", sandbox_seccomp="maybe")


async def test_hostile_kernel_calls_are_refused_while_others_keepstepping() -> None:
    async with serve(
        TARGET, isolation="sandbox", warm_pool=2, max_sessions=32, resume_grace=30
    ) as server:
        isolation = server.runtime.isolation
        stop = asyncio.Event()
        progress = [0] * 8
        others = [asyncio.ensure_future(stepping(server.url, n, stop, progress)) for n in range(8)]
        try:
            async with (
                stadium.AsyncClient(server.url) as env,
                stadium.AsyncClient(server.url) as neighbour,
            ):
                await env.reset()
                await neighbour.reset()
                await stepped(progress, [0] * 8, others, 30 * UNIT)  # all stepping already
                before = list(progress)
                assert isolation.seccomp.startswith(seccomp_module.NAME)  # the template's report
                # The filter is loaded (mode 2: filter) before the env ran.
                assert "Seccomp:\t2" in await _text(env, "status")
                for (do, arg), expected in REFUSED.items():
                    assert await _text(env, do, arg) == expected, (do, arg)
                # ptrace: another session's process is not even in its pid namespace (below);
                # its own child is refused above (by the kernel as well: a process
                # that changed uid is not dumpable; the filter makes it so whatever the uid).
                # kill(-1, SIGKILL) kills no one: the session, its neighbour, the others go on.
                assert await _text(env, "kill-all") == "ESRCH"
                assert await _text(env, "echo", "alive") == "alive"
                assert await _text(neighbour, "echo", "fine") == "fine"
                # What stays allowed: threads (clone3 refused, the C library falls back to
                # clone), subprocesses, inet sockets (no route: the network namespace is empty).
                assert await _text(env, "spawn") == "thread 1 exit 7"
                assert await _text(env, "socket", str(socket.AF_INET)) == "ok"
                assert await _text(env, "personality", "0xffffffff") == "ok"  # the query
                # A fork of the session inherits the filter.
                child = await env.fork()
                try:
                    assert "Seccomp:\t2" in await _text(child, "status")
                    assert await _text(child, "keyctl") == "EPERM"
                finally:
                    await child.close()
            await stepped(progress, before, others, 30 * UNIT)  # and still stepping after
        finally:
            stop.set()
            steps = await asyncio.gather(*others)
        assert all(s > 0 for s in steps)
        assert isolation.crashes == 0
        assert isolation.limit_kills == 0


async def test_seccomp_off_leaves_the_kernel_answering() -> None:
    """The control: without the filter the same calls get through (or the kernel's own
    refusal), so the test above sees the filter's work, not the kernel's."""
    async with serve(TARGET, isolation="sandbox", sandbox_seccomp="off") as server:
        async with stadium.AsyncClient(server.url) as env:
            await env.reset()
            assert server.runtime.isolation.seccomp == "off"
            assert "Seccomp:\t0" in await _text(env, "status")
            assert await _text(env, "keyctl") == "ok"
            assert await _text(env, "socket", str(AF_NETLINK)) == "ok"
            # (ptrace stays refused without the filter too: a process that changed its
            # uid is not dumpable, and only root may trace it.)
            assert await _text(env, "clone3") != "ENOSYS"
            assert await _text(env, "perf") != "EPERM"


async def test_the_sandbox_refuses_to_start_without_libseccomp(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def missing() -> Any:
        raise OSError("libseccomp.so.2: cannot open shared object file")

    monkeypatch.setattr(seccomp_module, "_lib", None)
    monkeypatch.setattr(seccomp_module, "_library", missing)
    with pytest.raises(ConfigError, match="--sandbox-seccomp off"):
        async with serve(TARGET, isolation="sandbox"):
            pass
    monkeypatch.undo()
    async with serve(TARGET, isolation="sandbox", sandbox_seccomp="off") as server:
        async with stadium.AsyncClient(server.url) as env:
            assert (await env.reset()).observation["text"] == "ready"


def test_the_filter_is_dockers_allow_list_or_stricter(tmp_path: Path) -> None:
    """Every call the filter allows Docker's default profile allows an unprivileged
    container; every listed call is refused; the compiled filter has a rule for each allowed
    call this architecture has, and ``clone3`` gets ``ENOSYS``."""
    assert seccomp_module.ALLOWED <= seccomp_module.DOCKER_ALLOWED
    for name in seccomp_module.DENIED:
        assert name not in seccomp_module.ALLOWED, name
    for name in ("clone", "clone3", "personality", "socket", "fanotify_init", "io_uring_setup"):
        assert name not in seccomp_module.ALLOWED, name  # argument rules, or refused
    built = seccomp_module.build_filter()
    out = tmp_path / "filter.pfc"
    with open(out, "w") as f:
        built.pfc(f.fileno())
    text = out.read_text()
    for name in ("read", "write", "openat", "execve", "wait4", "prctl"):
        assert f'"{name}"' in text, name
    for name in seccomp_module.DENIED:
        assert f'"{name}"' not in text, name  # no rule: the default action, EPERM
    assert "ERRNO(38)" in text  # clone3 and the calls libseccomp cannot name: ENOSYS
    assert "ERRNO(1)" in text  # the default


def _ours_in_families() -> dict[int, list[str]]:
    """Processes descending from this test process that live in a session family's pid
    namespace (root, bubblewrap's, the family's: three levels), by pid: their NSpid."""
    parents: dict[int, int] = {}
    nspids: dict[int, list[str]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        with contextlib.suppress(OSError), open(f"/proc/{name}/status") as f:
            fields = dict(line.split(":", 1) for line in f.read().splitlines())
            parents[int(name)] = int(fields["PPid"])
            nspids[int(name)] = fields["NSpid"].split()
    me = os.getpid()

    def ours(pid: int) -> bool:
        for _ in range(64):
            pid = parents.get(pid, 0)
            if pid == me:
                return True
            if pid <= 1:
                return False
        return False

    return {pid: ns for pid, ns in nspids.items() if len(ns) >= 3 and ours(pid)}


async def test_each_session_family_has_its_own_pid_namespace() -> None:
    """Each session sees only its family's processes (its init, pid 1, and itself, pid
    2); ``kill(-1, SIGKILL)`` reaches no one; orphans are reaped; a fork shares its
    parent's namespace and outlives it; every family's processes end with its sessions."""
    async with serve(TARGET, isolation="sandbox", resume_grace=30, max_sessions=32) as server:
        isolation = server.runtime.isolation
        stop = asyncio.Event()
        progress = [0] * 8
        others = [asyncio.ensure_future(stepping(server.url, n, stop, progress)) for n in range(8)]
        try:
            async with stadium.AsyncClient(server.url) as neighbour:
                await neighbour.reset()
                await stepped(progress, [0] * 8, others, 30 * UNIT)  # all stepping already
                before = list(progress)
                env = stadium.AsyncClient(server.url)
                await env.__aenter__()
                try:
                    await env.reset()
                    assert await _text(env, "pids") == "2"  # its init is not even shown
                    assert await _text(neighbour, "pids") == "2"
                    assert await _text(env, "init-mem") == "ENOENT"  # hidden, not dumpable
                    ns = await _text(env, "pidns")
                    assert ns != await _text(neighbour, "pidns")
                    assert "NSpid:\t2" in (await _text(env, "status")).splitlines()
                    # kill(-1, SIGKILL): nobody else in sight (pid 1 is spared by the kernel).
                    assert await _text(env, "kill-all") == "ESRCH"
                    assert await _text(env, "echo", "alive") == "alive"
                    assert await _text(neighbour, "echo", "fine") == "fine"
                    # An orphan's exit is reaped by the family's init: no zombie stays.
                    assert await _text(env, "orphan", "0") == "orphaned"
                    for _ in range(int(50 * UNIT)):
                        if await _text(env, "zombies") == "":
                            break
                        await asyncio.sleep(0.1)
                    assert await _text(env, "zombies") == ""
                    child = await env.fork()
                finally:
                    await env.__aexit__(None, None, None)
                # The copy lives in its parent's namespace and goes on after it closed.
                try:
                    assert await _text(child, "pidns") == ns
                    assert await _text(child, "echo", "still") == "still"
                    assert "2" not in (await _text(child, "pids")).split(",")
                finally:
                    await child.close()
            await stepped(progress, before, others, 30 * UNIT)  # and still stepping after
        finally:
            stop.set()
            steps = await asyncio.gather(*others)
        assert all(s > 0 for s in steps)
        assert isolation.crashes == 0
        await wait_until(lambda: not isolation.live, 10 * UNIT, "env processes ended")
        await wait_until(lambda: not _ours_in_families(), 10 * UNIT, "families ended")


@pytest.mark.skipif(
    not Path(NATIVE_INIT).exists(),
    reason="the native init is not built (no cargo): make sandbox-deps builds it",
)
async def test_each_family_s_init_is_the_native_one_and_not_dumpable() -> None:
    """pid 1 of each session's namespace is ``native/stadium-init`` (built by ``make
    sandbox-deps``, or shipped in the wheel), run from the template's sealed, execute-only
    memfd copy, not a forked interpreter, and as undumpable as one that changed uid; the
    session's process holds no descriptor of that copy."""
    async with serve(TARGET, isolation="sandbox", warm_pool=0) as server:
        async with stadium.AsyncClient(server.url) as env:
            await env.reset()
            assert await _text(env, "echo", "up") == "up"
            inits = _native_inits()
            assert len(inits) == 1, inits
            ((pid, status),) = inits
            assert status["NSpid"].split()[-1] == "1"  # pid 1 of its namespace
            assert int(status["Uid"].split()[0]) >= 1_000_000  # the session's uid, not root
            # Not dumpable: its /proc files belong to root, not to the session's uid.
            assert os.stat(f"/proc/{pid}/mem").st_uid == 0
            exe = os.stat(f"/proc/{pid}/exe")  # the memfd: root's, execute-only
            assert (exe.st_uid, stat.S_IMODE(exe.st_mode)) == (0, 0o111)
            sessions = _descendants(pid)  # the session's process, under its init
            assert [_nspid(p) for p in sessions] == ["2"]
            for p in sessions:
                fds = [_link(f"/proc/{p}/fd/{fd}") for fd in os.listdir(f"/proc/{p}/fd")]
                assert not any(MEMFD in link for link in fds), fds
        assert server.runtime.isolation.crashes == 0


def test_the_native_init_runs_from_a_sealed_execute_only_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pip installs the init 0755: the template executes a memfd copy of it, 0111 (a file it
    cannot read makes the process undumpable from ``execve`` on, before its ``prctl``) and
    sealed. A file others may write is not used; nor a copy others could read."""
    copy = tmp_path / "stadium-init"
    data = b"\x7fELF" + os.urandom(64)
    copy.write_bytes(data)
    monkeypatch.setattr(child_module, "NATIVE_INIT", str(copy))
    for mode, used in ((0o755, True), (0o711, True), (0o644, True), (0o775, False), (0o757, False)):
        copy.chmod(mode)
        fd = child_module.native_init()
        assert (fd is not None) is used, oct(mode)
        if fd is None:
            continue
        try:
            info = os.fstat(fd)
            assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (os.geteuid(), 0o111)
            assert os.pread(fd, 128, 0) == data
            with pytest.raises(PermissionError):  # sealed: no byte of it changes
                os.pwrite(fd, b"x", 0)
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 1)
        finally:
            os.close(fd)
    copy.chmod(0o755)
    # A copy others may read (were fchmod to leave it so) is refused, not executed.
    monkeypatch.setattr(child_module.os, "fchmod", lambda fd, mode: os.chmod(fd, 0o755))
    assert child_module.native_init() is None
    monkeypatch.undo()
    monkeypatch.setattr(child_module, "NATIVE_INIT", str(copy))
    copy.unlink()
    assert child_module.native_init() is None


#: What ``/proc/PID/exe`` of a process running the native init's memfd copy reads.
MEMFD = "/memfd:stadium-init"


def _native_inits() -> list[tuple[int, dict[str, str]]]:
    """This process's descendants running the native init, with their /proc status."""
    found = []
    for pid in _descendants(os.getpid()):
        if _exe(pid).startswith(MEMFD):
            lines = Path(f"/proc/{pid}/status").read_text().splitlines()
            found.append((pid, dict(line.split(":\t", 1) for line in lines)))
    return found


def _nspid(pid: int) -> str:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return line.split()[-1]
    return ""


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{p}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(p))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _exe(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return ""


async def test_a_dying_init_takes_its_namespace_down_and_is_reported() -> None:
    async with serve(TARGET, isolation="sandbox", resume_grace=30) as server:
        async with (
            stadium.AsyncClient(server.url) as env,
            stadium.AsyncClient(server.url) as bystander,
        ):
            await env.reset()
            await bystander.reset()
            ns = await _text(env, "pidns")
            child = await env.fork()
            try:
                inits = [
                    pid
                    for pid, nspid in _ours_in_families().items()
                    if nspid[-1] == "1" and os.readlink(f"/proc/{pid}/ns/pid") == ns
                ]
                assert len(inits) == 1
                os.kill(inits[0], signal.SIGKILL)
                err = None
                for _ in range(int(50 * UNIT)):  # the kernel kills the namespace's processes
                    try:
                        await env.step({"do": "echo", "arg": ""})
                    except stadium.StadiumError as exc:
                        err = exc
                        break
                    await asyncio.sleep(0.1)
                assert err is not None
                assert err.code == ErrorCode.ENV_CRASHED
                assert err.context["signal"] == "SIGKILL"
                err = await _error(child, "echo")
                assert err.code == ErrorCode.ENV_CRASHED
            finally:
                await child.close()
            assert (await env.reset()).observation["text"] == "ready"
            assert await _text(bystander, "echo", "x") == "x"


async def _error(env: stadium.AsyncClient[Any], do: str, arg: str = "") -> stadium.StadiumError:
    with pytest.raises(stadium.StadiumError) as info:
        await env.step({"do": do, "arg": arg})
    return info.value
