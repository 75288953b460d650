"""The sandbox's seam, kernel side: nothing of the host leaks through a sandboxed session's
descriptors or inheritance (issue 30, item 2).

- its stdout and stderr are a pipe of its own that the worker reads into the log, bounded
  in rate, escaped, tagged (``--sandbox-output log``), or ``/dev/null`` (``drop``): never
  the server's descriptors, log file or terminal;
- its own ``devpts`` instance with a small ``max``: one session taking every pty it can
  leaves other sessions' and the host's alone;
- its initial environment block holds nothing of the server's (the template's settings
  arrive in a memfd);
- its uid is unique among the node's live sessions (:class:`UidLease`).

Real servers on port 0 with real sandboxed env processes (root, bubblewrap, cgroups,
libseccomp: skipped with the reason elsewhere), except the lease's unit tests."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pty
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import stadium
from stadium._server.isolation import sandbox_unavailable
from stadium._server.isolation.sandbox import UID_BASE, UidLease
from stadium._server.isolation.template.seccomp import seccomp_unavailable
from stadium._server.isolation.worker import output as output_module
from stadium._server.isolation.worker.output import escape
from tests.conftest import UNIT, serve, wait_until
from tests.isolation.neighbours import stepping

CODE = Path(__file__).with_name("seam_hostile.py")
TARGET = f"{CODE}:SeamHostile"
WHY_NOT = sandbox_unavailable() or seccomp_unavailable()
sandboxed = pytest.mark.skipif(WHY_NOT is not None, reason=f"--isolation sandbox: {WHY_NOT}")
MARK = "stadium-seam-mark"


async def _text(env: stadium.AsyncClient[Any], do: str, arg: str = "") -> str:
    return str((await env.step({"do": do, "arg": arg})).observation["text"])


@contextlib.contextmanager
def _server_stdio_on_a_terminal() -> Iterator[int]:
    """This process's fds 1 and 2 (the in-process server's) on a new pseudo-terminal, as
    when an operator runs ``stadium serve`` in one; yields its master side."""
    master, slave = pty.openpty()
    saved = os.dup(1), os.dup(2)
    os.dup2(slave, 1)
    os.dup2(slave, 2)
    try:
        yield master
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, slave):
            os.close(fd)


def _drain(master: int) -> bytes:
    os.set_blocking(master, False)
    got = b""
    with contextlib.suppress(BlockingIOError, OSError):
        while chunk := os.read(master, 65536):
            got += chunk
    return got


@pytest.mark.slow
@sandboxed
async def test_a_session_never_holds_the_servers_stdio_or_terminal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The server runs on a terminal (its fds 1 and 2): a sandboxed session can neither read
    the line the operator typed, nor turn echo off, nor write to it; what it prints reaches
    the log, tagged and escaped."""
    caplog.set_level(logging.INFO, logger="stadium.env")
    server_fds = {(os.fstat(fd).st_dev, os.fstat(fd).st_ino) for fd in (1, 2)}
    with _server_stdio_on_a_terminal() as master:
        server_fds |= {(os.fstat(fd).st_dev, os.fstat(fd).st_ino) for fd in (1, 2)}
        async with serve(TARGET, isolation="sandbox") as server:
            async with stadium.AsyncClient(server.url) as env:
                await env.reset()
                fds = (await _text(env, "fds")).split(",")
                held = {(int(f.split(":")[0]), int(f.split(":")[1])) for f in fds}
                assert not held & server_fds, fds
                kinds = [f.split(":", 2)[2] for f in fds]
                assert kinds == ["chr:False", "fifo:False", "fifo:False"]  # /dev/null, pipe
                os.write(master, b"the operator's password\n")  # typed on the terminal
                assert await _text(env, "read-typed") == "EBADF"  # a pipe's write end
                assert await _text(env, "echo-off") == "ENOTTY"
                assert await _text(env, "tiocsti") == "ENOTTY,ENOTTY,ENOTTY"
                assert await _text(env, "dev-tty") == "ENXIO"  # no controlling terminal
                said = await _text(env, "say", f"\x1b]0;owned\x07{MARK}\x1b[2J")
                expected = 3 if said.endswith("proc ok") else 2
                (reader,) = server.runtime.isolation.outputs.values()
                await wait_until(
                    lambda: reader.logged >= expected * len(MARK), 5 * UNIT, "output logged"
                )
        typed_back = _drain(master)
    assert MARK.encode() not in typed_back
    assert b"\x1b]0;owned" not in typed_back
    lines = [r.getMessage() for r in caplog.records if r.name == "stadium.env"]
    ours = [line for line in lines if MARK in line]
    assert len(ours) == expected, lines  # stdout, stderr (, /proc/self/fd/1)
    for line in ours:
        assert line.startswith(f"[session {os.getpid()}."), line  # the session's short id
        assert "\x1b" not in line
        assert "\x07" not in line
        assert "\\x1b]0;owned\\x07" in line


@pytest.mark.slow
@sandboxed
async def test_a_flood_of_output_is_bounded_while_others_keep_stepping(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="stadium.env")
    async with serve(TARGET, isolation="sandbox", max_sessions=16) as server:
        isolation = server.runtime.isolation
        stop = asyncio.Event()
        others = [asyncio.ensure_future(stepping(server.url, n, stop)) for n in range(4)]
        try:
            async with stadium.AsyncClient(server.url) as env:
                await env.reset()
                loop = asyncio.get_running_loop()
                started = loop.time()
                written = int(await _text(env, "flood", str(32 * 1024 * 1024)))
                await wait_until(
                    lambda: any(r.dropped for r in isolation.outputs.values()),
                    5 * UNIT,
                    "output dropped",
                )
                elapsed = loop.time() - started
                reader = next(r for r in isolation.outputs.values() if r.dropped)
                bound = output_module.BURST + output_module.RATE * elapsed
                assert reader.logged <= bound + output_module.LINE_MAX
                assert reader.logged + reader.dropped <= written
                assert await _text(env, "echo", "still here") == "still here"
        finally:
            stop.set()
            steps = await asyncio.gather(*others)
    assert all(s > 0 for s in steps)
    said = [r for r in caplog.records if "bytes of output dropped" in r.getMessage()]
    assert said
    assert all(r.levelno == logging.WARNING for r in said)


@pytest.mark.slow
@sandboxed
async def test_sandbox_output_drop_sends_it_nowhere(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="stadium.env")
    async with serve(TARGET, isolation="sandbox", sandbox_output="drop") as server:
        async with stadium.AsyncClient(server.url) as env:
            await env.reset()
            fds = (await _text(env, "fds")).split(",")
            assert [f.split(":", 2)[2] for f in fds] == ["chr:False"] * 3  # /dev/null
            assert (await _text(env, "say", MARK)).startswith("said")
            assert not server.runtime.isolation.outputs
    assert not [r for r in caplog.records if MARK in r.getMessage()]


@pytest.mark.slow
@sandboxed
async def test_one_session_taking_every_pty_leaves_the_others_theirs() -> None:
    async with serve(TARGET, isolation="sandbox") as server:
        async with (
            stadium.AsyncClient(server.url) as greedy,
            stadium.AsyncClient(server.url) as other,
        ):
            await greedy.reset()
            await other.reset()
            got = await _text(greedy, "grab-ptys")
            assert await _text(other, "openpty") == "ok"
            master, slave = pty.openpty()  # the host's
            os.close(master)
            os.close(slave)
            assert got == f"{server.runtime.isolation.limits.ptys} ENOSPC", got


@pytest.mark.slow
@sandboxed
async def test_the_initial_environment_block_holds_nothing_of_the_server() -> None:
    secret = "hunter2-seam-secret"
    async with serve(TARGET, isolation="sandbox", env_kwargs={"secret": secret}) as server:
        async with stadium.AsyncClient(server.url) as env:
            await env.reset()
            assert await _text(env, "secret") == secret  # the env has its kwargs
            assert await _text(env, "stack-has", "PATH=") == "True"  # the probe sees the block
            assert await _text(env, "stack-has", secret) == "False"
            assert await _text(env, "stack-has", "STADIUM") == "False"
            assert await _text(env, "child-env") == "HOME,LANG,PATH,TMPDIR"


@pytest.mark.slow
@sandboxed
async def test_two_workers_sessions_never_share_a_uid() -> None:
    """Two servers in one process (the same pid, as two workers whose pids agree modulo
    4,096 were before): their sessions' uids differ."""
    async with serve(TARGET, isolation="sandbox") as one, serve(TARGET, isolation="sandbox") as two:
        async with stadium.AsyncClient(one.url) as a, stadium.AsyncClient(two.url) as b:
            uid_a = (await a.reset()).observation["uid"]
            uid_b = (await b.reset()).observation["uid"]
            assert min(uid_a, uid_b) >= UID_BASE
            assert uid_a != uid_b
            leases_a = one.runtime.isolation.uids.leased
            leases_b = two.runtime.isolation.uids.leased
            assert not set(leases_a) & set(leases_b)


# -- the lease, alone ------------------------------------------------------------------


def test_leases_are_disjoint_and_a_dead_workers_is_taken_again(tmp_path: Path) -> None:
    run = str(tmp_path / "uids")
    first = UidLease(run, start=7, block=8)
    second = UidLease(run, start=7, block=8)  # the same start (pids agreeing): the next block
    assert first.leased != second.leased
    assert not set(first.leased[0]) & set(second.leased[0])
    taken = first.leased
    first.close()  # its worker died: its descriptor closed
    third = UidLease(run, start=7, block=8)
    assert third.leased == taken
    second.close()
    third.close()


def test_a_lease_that_wraps_never_hands_out_a_live_uid(tmp_path: Path) -> None:
    lease = UidLease(str(tmp_path / "uids"), block=8)
    live: set[int] = set()
    for n in range(200):
        uid = lease.take()
        assert uid not in live
        live.add(uid)
        if n % 3:  # two of three end; one stays live (with a fork of it, now and then)
            lease.release(uid)
            live.discard(uid)
        elif n % 2:
            lease.hold(uid)
            lease.release(uid)
    uids = {u for r in lease.leased for u in r}
    assert live <= uids
    lease.close()


def test_the_lease_folder_must_be_private(tmp_path: Path) -> None:
    run = tmp_path / "open"
    run.mkdir(mode=0o755)
    run.chmod(0o755)
    with pytest.raises(stadium.ConfigError, match="0700"):
        UidLease(str(run))


def test_output_lines_are_escaped() -> None:
    assert escape(b"plain line") == "plain line"
    assert escape(b"\x1b[2Jcleared\x07") == "\\x1b[2Jcleared\\x07"
    assert escape(b"bad \xff byte") == "bad \\xff byte"
    assert escape("rtl \u202e override".encode()) == "rtl \\u202e override"
