"""The worker supervisor, through real ``stadium serve`` processes: crash restarts with
backoff, the SIGHUP rolling recycle, and the open-file limit."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http.client
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import IO

import pytest

from stadium import AsyncClient
from tests.conftest import UNIT, proc_alive, proc_children, wait_until

#: Process-level: servers, tools or interpreters in subprocesses (`make check` skips it).
pytestmark = pytest.mark.slow


@dataclasses.dataclass
class _Served:
    proc: subprocess.Popen[bytes]
    url: str
    port: int
    out: IO[bytes]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        self.out.seek(0)
        return self.out.read().decode(errors="replace")

    def workers(self) -> list[int]:
        return proc_children(self.proc.pid)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _healthy(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2.0)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


@contextlib.contextmanager
def _serve(*args: str, nofile: tuple[int, int] | None = None) -> Iterator[_Served]:
    """``stadium serve ARGS`` on a free port (with RLIMIT_NOFILE ``nofile``), until healthy.

    Afterwards: SIGTERM to the server, then SIGKILL by pid to it and to the workers
    it still has, each wait bounded.
    """
    port = _free_port()
    cmd = [sys.executable, "-m", "stadium", "serve", *args, "--port", str(port)]

    def limits() -> None:  # in the child, before exec
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, nofile)

    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=limits,
        )  # fmt: skip
        served = _Served(proc, f"http://127.0.0.1:{port}", port, out)
        try:
            deadline = time.monotonic() + 30 * UNIT
            while not _healthy(port):
                assert proc.poll() is None, f"the server exited early:\n{served.output()}"
                assert time.monotonic() < deadline, f"not healthy in time:\n{served.output()}"
                time.sleep(0.05)
            yield served
        finally:
            workers = proc_children(proc.pid)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(15 * UNIT)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10 * UNIT)
            for pid in workers:  # they get SIGTERM when the supervisor dies; in case not
                with contextlib.suppress(ProcessLookupError):
                    if proc_alive(pid):
                        os.kill(pid, signal.SIGKILL)


def _open_files_limit(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            if line.startswith("Max open files"):
                soft, hard = line.split()[3:5]
                return int(soft), int(hard)
    raise AssertionError("no open-files line")


async def test_a_worker_killed_again_and_again_is_restarted_each_time() -> None:
    # More crashes, faster, than the old budget (10 x workers over the server's
    # life, then the whole server stopped); the healthy worker is never touched.
    kills = 24
    with _serve(
        "benchmark", "--workers", "2", "--drain-timeout", "0",
        "--restart-max-delay", str(0.2 * UNIT),
    ) as srv:  # fmt: skip
        await wait_until(lambda: len(srv.workers()) == 2, 10 * UNIT, "two workers")
        healthy, victim = srv.workers()
        killed: set[int] = set()
        for _ in range(kills):
            os.kill(victim, signal.SIGKILL)
            killed.add(victim)
            await wait_until(
                lambda: len(set(srv.workers()) - killed - {healthy}) == 1,
                10 * UNIT,
                f"a worker replacing pid {victim}",
            )
            (victim,) = set(srv.workers()) - killed - {healthy}
        assert srv.proc.poll() is None, "the supervisor is alive"
        assert healthy in srv.workers(), "the healthy worker was left alone"
        async with AsyncClient(srv.url, max_retries=3) as env:
            await env.reset()
            assert (await env.step({"wait_seconds": 0})).observation["pid"] in srv.workers()
        # crashes are logged with their cause and the delay, rate-limited
        lines = [line for line in srv.output().splitlines() if "restarting it in" in line]
        assert 1 <= len(lines) < kills
        assert "killed by SIGKILL" in lines[0]


async def test_sighup_recycles_the_workers_and_drains_open_sessions() -> None:
    with _serve("benchmark", "--workers", "2", "--drain-timeout", str(20 * UNIT)) as srv:
        await wait_until(lambda: len(srv.workers()) == 2, 10 * UNIT, "two workers")
        old = set(srv.workers())
        client = AsyncClient(srv.url, max_retries=0)
        await client.reset()
        pid = (await client.step({"wait_seconds": 0})).observation["pid"]
        assert pid in old
        in_flight = asyncio.ensure_future(client.step({"wait_seconds": 1.0 * UNIT}))
        await asyncio.sleep(0.2 * UNIT)
        os.kill(srv.pid, signal.SIGHUP)
        # both old workers are told to drain, one at a time, once their replacement serves
        await wait_until(
            lambda: srv.output().count("recycled: pid") == 2, 15 * UNIT, "two recycled workers"
        )
        await wait_until(
            lambda: all(f"[{p}] stadium.server: signal received" in srv.output() for p in old),
            10 * UNIT,
            "the old workers draining",
        )
        new = set(srv.workers()) - old
        assert len(new) == 2
        # the open session is drained, not killed: its in-flight step and the next are answered
        done = (await in_flight).observation
        assert (done["pid"], done["waited_seconds"]) == (pid, 1.0 * UNIT)
        assert (await client.step({"wait_seconds": 0})).observation["pid"] == pid
        # new sessions go to the new workers
        fresh = [AsyncClient(srv.url, max_retries=0) for _ in range(4)]
        await asyncio.gather(*(c.reset() for c in fresh))
        pids = {(await c.step({"wait_seconds": 0})).observation["pid"] for c in fresh}
        assert pids <= new
        # the old worker exits once its last session closes; the supervisor stays
        await client.close()
        await wait_until(lambda: set(srv.workers()) == new, 10 * UNIT, "the old workers gone")
        assert srv.proc.poll() is None
        await asyncio.gather(*(c.close() for c in fresh))
        # SIGTERM still stops everything cleanly
        os.kill(srv.pid, signal.SIGTERM)
        assert await asyncio.to_thread(srv.proc.wait, 30 * UNIT) == 0


async def test_sighup_to_a_single_process_server_is_logged_and_ignored() -> None:
    with _serve("echo") as srv:
        async with AsyncClient(srv.url, max_retries=0) as env:
            await env.reset()
            os.kill(srv.pid, signal.SIGHUP)
            await wait_until(lambda: "SIGHUP ignored" in srv.output(), 10 * UNIT, "SIGHUP logged")
            await env.step({"message": "still here"})
        assert srv.proc.poll() is None


def test_the_open_file_soft_limit_is_raised_to_the_hard_limit() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY or hard < 256:
        pytest.skip(f"the hard open-file limit ({hard}) leaves no room to test the raise")
    soft = min(1024, hard // 2)
    with _serve("echo", "--workers", "2", "--max-sessions", "8", nofile=(soft, hard)) as srv:
        assert _open_files_limit(srv.pid) == (hard, hard)
        workers = srv.workers()
        assert len(workers) == 2
        for pid in workers:
            assert _open_files_limit(pid) == (hard, hard)
        assert "open-file limit" not in srv.output()


async def test_a_server_short_of_descriptors_says_so() -> None:
    # 64 descriptors cannot hold 8,192 sessions: a warning at start; then, with
    # every descriptor taken by idle connections, the worker logs that it is out.
    with _serve("echo", "--max-sessions", "8192", nofile=(64, 64)) as srv:
        assert "open-file limit (64 per process" in srv.output()
        conns = []
        try:
            for _ in range(100):
                conns.append(socket.create_connection(("127.0.0.1", srv.port), timeout=5))
            await wait_until(
                lambda: "worker out of file descriptors" in srv.output(),
                10 * UNIT,
                "the out-of-descriptors warning",
            )
        finally:
            for c in conns:
                c.close()
        # with the descriptors back, the server serves again
        async with AsyncClient(srv.url, max_retries=5) as env:
            await env.reset()
        assert srv.proc.poll() is None


@pytest.mark.parametrize("workers", ["1", "2"])
async def test_a_draining_server_refuses_new_connections_while_its_sessions_finish(
    workers: str,
) -> None:
    # A router's health check (or a client) must be refused at once, not left in the
    # listening socket's backlog that nobody accepts any more (the supervisor's copy).
    with _serve("benchmark", "--workers", workers, "--drain-timeout", str(10 * UNIT)) as srv:
        async with AsyncClient(srv.url) as env:
            await env.reset()
            srv.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 5 * UNIT
            while True:
                try:
                    with socket.create_connection(("127.0.0.1", srv.port), timeout=1.0):
                        pass
                except ConnectionRefusedError:
                    break
                assert time.monotonic() < deadline, "still accepting while draining"
                await asyncio.sleep(0.05)
            # Refused for newcomers, still served for the session already there.
            assert (await env.step({"wait_seconds": 0})).reward == 1.0
