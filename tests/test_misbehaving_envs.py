"""Environments that misbehave: calls past the step timeout (``--step-timeout``, OpenEnv's
``timeout_s``), sync calls that never return (stuck threads, shutdown), an event loop that
never yields (the watchdog) and a worker that outgrows ``--max-worker-memory``."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import textwrap
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import msgspec
import pytest
import websockets

from stadium import AsyncClient, Environment, SessionClosedError, State, StepResult
from stadium._server.processes.watchdog import MIB, Watchdog
from stadium._util.process import RECYCLE_EXIT_CODE, rss_bytes
from tests.conftest import TRANSPORTS, UNIT, proc_alive, serve, wait_until
from tests.test_supervisor import _serve

#: Set at the end of every test (and by ``_release``): lets stuck sync steps return, so
#: no thread of this process stays stuck past its test.
_RELEASE = threading.Event()


class Act(msgspec.Struct):
    sleep: float = 0.0
    hang: bool = False


class Obs(msgspec.Struct):
    value: float = 0.0
    timeout_s: float | None = None


class SlowAsync(Environment[Act, Obs, State]):
    """Async step: sleeps ``sleep`` seconds."""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Obs:
        return Obs()

    async def step(self, action: Act) -> StepResult[Obs]:  # type: ignore[override]
        await asyncio.sleep(action.sleep)
        return StepResult(Obs(action.sleep))


class SlowSync(Environment[Act, Obs, State]):
    """Blocking sync step (the thread pool): sleeps ``sleep`` s, or hangs until released."""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Obs:
        return Obs()

    def step(self, action: Act) -> StepResult[Obs]:
        if action.hang:
            _RELEASE.wait()
        else:
            _RELEASE.wait(action.sleep)
        return StepResult(Obs(action.sleep))


class TakesTimeout(Environment[Act, Obs, State]):
    """A step that takes OpenEnv's ``timeout_s`` (and reports what it got)."""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Obs:
        return Obs()

    async def step(  # type: ignore[override]
        self, action: Act, timeout_s: float | None = None
    ) -> StepResult[Obs]:
        await asyncio.sleep(action.sleep)
        return StepResult(Obs(action.sleep, timeout_s))


class SlowStart(SlowSync):
    """Creating it takes a while (a blocking constructor, on the pool)."""

    def __init__(self) -> None:
        _RELEASE.wait(5 * UNIT)


@pytest.fixture(autouse=True)
def _release() -> Any:
    _RELEASE.clear()
    yield
    _RELEASE.set()


def _ws(url: str) -> str:
    return url.replace("http", "ws") + "/ws"


def _http(url: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="GET" if data is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=10 * UNIT) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


async def _closed(ws: Any) -> Any:
    """The close frame the server sent (after any frames still to read)."""
    try:
        while True:
            await asyncio.wait_for(ws.recv(), 10 * UNIT)
    except websockets.ConnectionClosed as exc:
        return exc.rcvd


# -- the step timeout ------------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("env", [SlowAsync, SlowSync], ids=["async", "sync"])
async def test_a_step_past_the_step_timeout_is_answered_timeout_then_the_session_closes(
    transport: str, env: type[Environment[Any, Any, Any]]
) -> None:
    limit = 0.2 * UNIT
    async with serve(env, transport, step_timeout=limit) as server:
        async with websockets.connect(_ws(server.url)) as ws:
            await ws.send('{"type":"reset"}')
            await ws.recv()
            await ws.send(json.dumps({"type": "step", "data": {"sleep": 0}, "id": 1}))
            assert json.loads(await ws.recv())["type"] == "observation"  # fast steps pass
            await ws.send(json.dumps({"type": "step", "data": {"sleep": 30 * UNIT}, "id": 2}))
            await ws.send('{"type":"state"}')  # queued behind it: dropped with the session
            reply = json.loads(await asyncio.wait_for(ws.recv(), 10 * UNIT))
            assert reply["id"] == 2
            assert reply["data"]["code"] == "TIMEOUT"
            assert reply["data"]["operation"] == "step"
            assert reply["data"]["timeout_s"] == limit
            assert "new session" in reply["data"]["message"]
            close = await _closed(ws)
            assert close.code == 1011
            assert "timed out" in close.reason
        # the server goes on: a new session steps
        async with AsyncClient(server.url, max_retries=0) as client:
            await client.reset()
            assert (await client.step({"sleep": 0})).observation["value"] == 0
        _, meta = await asyncio.to_thread(_http, server.url, "/metadata")
        assert meta["worker"]["timeouts_total"] == 1
        assert meta["worker"]["errors_total"]["TIMEOUT"] == 1


async def test_creating_the_env_past_the_step_timeout_is_answered_timeout() -> None:
    async with serve(SlowStart, step_timeout=0.2 * UNIT) as server:
        async with websockets.connect(_ws(server.url)) as ws:
            reply = json.loads(await asyncio.wait_for(ws.recv(), 10 * UNIT))
            assert (reply["data"]["code"], reply["data"]["operation"]) == ("TIMEOUT", "create")
            assert (await _closed(ws)).code == 1011
        assert server.runtime.sessions == set()


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_step_frame_may_bring_its_own_timeout_s(transport: str) -> None:
    async with serve(TakesTimeout, transport, step_timeout=20 * UNIT) as server:
        async with websockets.connect(_ws(server.url)) as ws:
            await ws.send('{"type":"reset"}')
            await ws.recv()
            # passed to a step that takes it (OpenEnv's signature); absent: not passed
            await ws.send('{"type":"step","data":{},"timeout_s":7.5}')
            assert json.loads(await ws.recv())["data"]["observation"]["timeout_s"] == 7.5
            await ws.send('{"type":"step","data":{}}')
            assert json.loads(await ws.recv())["data"]["observation"]["timeout_s"] is None
            # not a positive number: refused, the session goes on
            for bad in ("-1", "0", '"soon"'):
                await ws.send(f'{{"type":"step","data":{{}},"timeout_s":{bad}}}')
                reply = json.loads(await ws.recv())
                assert reply["data"]["code"] == "VALIDATION_ERROR", bad
                assert reply["data"]["field"] == "$.timeout_s"
            # the smaller of timeout_s and --step-timeout bounds the call
            limit = 0.2 * UNIT
            await ws.send(json.dumps({"type": "step", "data": {"sleep": 30}, "timeout_s": limit}))
            reply = json.loads(await asyncio.wait_for(ws.recv(), 10 * UNIT))
            assert (reply["data"]["code"], reply["data"]["timeout_s"]) == ("TIMEOUT", limit)
            assert (await _closed(ws)).code == 1011


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_http_step_honours_timeout_s_and_the_step_timeout(transport: str) -> None:
    async with serve(TakesTimeout, transport, step_timeout=0.3 * UNIT) as server:
        url = server.url
        status, body = await asyncio.to_thread(
            _http, url, "/step", {"action": {}, "timeout_s": 9.0}
        )
        assert (status, body["observation"]["timeout_s"]) == (200, 9.0)
        status, body = await asyncio.to_thread(
            _http, url, "/step", {"action": {"sleep": 30}, "timeout_s": 0.1 * UNIT}
        )
        assert status == 504
        assert (body["code"], body["operation"], body["timeout_s"]) == ("TIMEOUT", "step", 0.1)
        status, body = await asyncio.to_thread(_http, url, "/step", {"action": {"sleep": 30}})
        assert (status, body["code"], body["timeout_s"]) == (504, "TIMEOUT", 0.3 * UNIT)
        status, body = await asyncio.to_thread(
            _http, url, "/step", {"action": {}, "timeout_s": "later"}
        )
        assert (status, body["code"], body["field"]) == (422, "VALIDATION_ERROR", "$.timeout_s")


# -- stuck sync calls --------------------------------------------------------------------


async def test_stuck_sync_steps_never_exhaust_the_pool() -> None:
    async with serve(SlowSync, executor_threads=2) as server:
        # two sessions hang their step on both pool threads, then leave
        for _ in range(2):
            async with websockets.connect(_ws(server.url)) as ws:
                await ws.send('{"type":"reset"}')
                await ws.recv()
                await ws.send('{"type":"step","data":{"hang":true}}')
                await asyncio.sleep(0.05 * UNIT)
        invoke = server.runtime.invoke
        await wait_until(lambda: invoke.stuck == 2, 10 * UNIT, "two threads written off")
        # a third session steps: the stuck threads no longer count against the bound of 2
        async with AsyncClient(server.url, max_retries=0) as client:
            await client.reset()
            for _ in range(3):
                assert (await client.step({"sleep": 0})).observation["value"] == 0
        _, meta = await asyncio.to_thread(_http, server.url, "/metadata")
        assert meta["worker"]["stuck_threads"] == 2
        assert meta["worker"]["executor_limit"] == 2
        assert invoke.executor.written_off == 2
        # a stuck thread that returns at last is no longer counted
        _RELEASE.set()
        await wait_until(lambda: invoke.stuck == 0, 10 * UNIT, "the threads back")


def _env_file(tmp_path: Path) -> Path:
    path = tmp_path / "misbehaving.py"
    path.write_text(
        textwrap.dedent(
            """
            import os, threading, time
            from typing import Any
            from stadium import Environment, State, StepResult

            class Hangs(Environment[dict, dict, State]):
                action_type = dict
                observation_type = dict

                def reset(self, *, seed=None, options=None):
                    return {"pid": os.getpid()}

                def step(self, action):
                    if action.get("hang"):
                        threading.Event().wait()
                    return StepResult({"pid": os.getpid()})

            class Spins(Environment[dict, dict, State]):
                action_type = dict
                observation_type = dict

                def reset(self, *, seed=None, options=None):
                    return {"pid": os.getpid()}

                async def step(self, action):
                    if action.get("spin"):
                        time.sleep(1000)  # blocks the event loop: never yields
                    return StepResult({"pid": os.getpid()})

            class Grows(Environment[dict, dict, State]):
                action_type = dict
                observation_type = dict

                def reset(self, *, seed=None, options=None):
                    return {"pid": os.getpid()}

                async def step(self, action):
                    if action.get("grow"):
                        self.blob = b"x" * (action["grow"] << 20)  # touched: resident
                    return StepResult({"pid": os.getpid()})
            """
        )
    )
    return path


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
async def test_sigterm_exits_although_a_sync_step_never_returns(
    tmp_path: Path, workers: int
) -> None:
    env = f"{_env_file(tmp_path)}:Hangs"
    with _serve(env, "--workers", str(workers), "--drain-timeout", "0") as srv:
        client = AsyncClient(srv.url, max_retries=0)
        await client.reset()
        hung = asyncio.ensure_future(client.step({"hang": True}))
        await asyncio.sleep(0.2 * UNIT)
        assert not hung.done()
        start = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        # drain 0 s + the final grace of in-flight calls (5 s) + a generous margin
        code = await asyncio.to_thread(srv.proc.wait, 30 * UNIT)
        assert code == 0, srv.output()
        assert time.monotonic() - start < 30 * UNIT
        with pytest.raises(SessionClosedError):  # the session is gone
            await asyncio.wait_for(hung, 10 * UNIT)
        await client.close()
        if workers == 1:
            assert "still running a call that never returned" in srv.output()


# -- the watchdog ---------------------------------------------------------------------------


async def _sessions_on_two_workers(url: str) -> dict[int, AsyncClient]:
    """One session on each of two workers (new connections land where the kernel says)."""
    by_pid: dict[int, AsyncClient] = {}
    spare: list[AsyncClient] = []
    deadline = time.monotonic() + 20 * UNIT
    while len(by_pid) < 2:
        assert time.monotonic() < deadline, "no session on a second worker"
        client = AsyncClient(url, max_retries=0)
        pid = (await client.reset()).observation["pid"]
        if pid in by_pid:
            spare.append(client)
        else:
            by_pid[pid] = client
    for client in spare:
        await client.close()
    return by_pid


@pytest.mark.slow
async def test_a_worker_whose_event_loop_is_stuck_is_replaced(tmp_path: Path) -> None:
    env = f"{_env_file(tmp_path)}:Spins"
    with _serve(env, "--workers", "2", "--stall-limit", "1", "--drain-timeout", "0") as srv:
        await wait_until(lambda: len(srv.workers()) == 2, 10 * UNIT, "two workers")
        sessions = await _sessions_on_two_workers(srv.url)
        (stuck_pid, victim), (healthy_pid, healthy) = sessions.items()
        spin = asyncio.ensure_future(victim.step({"spin": True}))
        # the other worker keeps stepping meanwhile
        deadline = time.monotonic() + 20 * UNIT
        while proc_alive(stuck_pid):
            assert time.monotonic() < deadline, f"pid {stuck_pid} not replaced:\n{srv.output()}"
            assert (await healthy.step({})).observation["pid"] == healthy_pid
            await asyncio.sleep(0.05)
        # Dead is not yet reaped: wait for the supervisor to list its replacement instead.
        await wait_until(
            lambda: stuck_pid not in srv.workers() and len(srv.workers()) == 2,
            10 * UNIT,
            "a replacement worker",
        )
        assert healthy_pid in srv.workers()
        with pytest.raises(SessionClosedError):  # its session is lost
            await asyncio.wait_for(spin, 10 * UNIT)
        out = srv.output()
        assert f"[{stuck_pid}] stadium.watchdog: the event loop has been stalled" in out
        assert "time.sleep(1000)" in out  # the loop's stack is logged
        assert f"exit code {RECYCLE_EXIT_CODE}" in out
        assert "ended itself to be replaced" in out
        assert "restarting it in" not in out  # not a crash
        assert (await healthy.step({})).observation["pid"] == healthy_pid
        for client in (victim, healthy):
            await client.close()


@pytest.mark.slow
async def test_a_worker_over_its_memory_cap_drains_and_is_replaced(tmp_path: Path) -> None:
    env = f"{_env_file(tmp_path)}:Grows"
    with _serve(
        env, "--workers", "2", "--max-worker-memory", "64", "--drain-timeout", "0"
    ) as srv:  # fmt: skip
        await wait_until(lambda: len(srv.workers()) == 2, 10 * UNIT, "two workers")
        old = set(srv.workers())
        async with websockets.connect(_ws(srv.url)) as ws:
            await ws.send('{"type":"reset"}')
            pid = json.loads(await ws.recv())["data"]["observation"]["pid"]
            await ws.send('{"type":"step","data":{"grow":80}}')
            assert json.loads(await ws.recv())["type"] == "observation"
            close = await _closed(ws)  # drained: closed like on SIGTERM
            assert close.code == 1001
        await wait_until(lambda: not proc_alive(pid), 20 * UNIT, "the grown worker gone")
        await wait_until(  # the grown one's pid may be listed until it is reaped
            lambda: len(srv.workers()) == 2 and len(set(srv.workers()) - old) == 1,
            30 * UNIT,
            "a replacement worker",
        )
        out = srv.output()
        assert "over --max-worker-memory 64 MiB" in out
        assert "asked to be replaced" in out
        assert "restarting it in" not in out  # not a crash
        # the server goes on serving new sessions
        async with AsyncClient(srv.url, max_retries=0) as client:
            await client.reset()
            assert (await client.step({})).observation["pid"] in srv.workers()
        assert os.getpid() not in srv.workers()


async def test_an_openenv_step_gets_the_requests_timeout_s() -> None:
    pytest.importorskip("openenv")
    from openenv.core.env_server.interfaces import Environment as OpenEnvEnvironment
    from openenv.core.env_server.types import Action, Observation

    from stadium.integrations.openenv import openenv_environment

    class Wait(Action):
        seconds: float = 0.0

    class Waited(Observation):
        timeout_s: float | None = None

    class Timed(OpenEnvEnvironment[Wait, Waited, Any]):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def reset(self, seed: Any = None, episode_id: Any = None, **kw: Any) -> Waited:
            return Waited()

        def step(self, action: Wait, timeout_s: float | None = None, **kw: Any) -> Waited:
            _RELEASE.wait(action.seconds)
            return Waited(timeout_s=timeout_s)

        @property
        def state(self) -> Any:
            return None

    async with serve(openenv_environment(Timed)) as server:
        status, body = await asyncio.to_thread(
            _http, server.url, "/step", {"action": {}, "timeout_s": 4.0}
        )
        assert (status, body["observation"]["timeout_s"]) == (200, 4.0)
        status, body = await asyncio.to_thread(
            _http, server.url, "/step", {"action": {"seconds": 30}, "timeout_s": 0.1 * UNIT}
        )
        assert (status, body["code"]) == (504, "TIMEOUT")
        async with websockets.connect(_ws(server.url)) as ws:
            await ws.send('{"type":"reset"}')
            await ws.recv()
            await ws.send('{"type":"step","data":{},"timeout_s":2.5}')
            assert json.loads(await ws.recv())["data"]["observation"]["timeout_s"] == 2.5


async def test_the_watchdog_reports_a_stall_and_ends_the_worker_past_the_limit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    codes: list[int] = []
    watchdog = Watchdog(
        asyncio.get_running_loop(),
        stall_limit=1.0,
        max_memory_mib=0,
        stuck_threads=None,
        on_recycle=lambda why: None,
        exit=codes.append,
    )
    watchdog.start()
    try:
        time.sleep(1.6)  # noqa: ASYNC251 - the loop blocked on purpose, past the 1 s limit
        await wait_until(lambda: codes != [], 5 * UNIT, "the watchdog giving up")
    finally:
        watchdog.stop()
    assert codes == [RECYCLE_EXIT_CODE]
    assert watchdog.stalls == 1
    assert watchdog.longest_stall_s > 1.0
    assert "test_the_watchdog_reports_a_stall" in caplog.text  # the loop's stack


async def test_the_watchdog_asks_for_a_recycle_past_the_memory_cap_or_the_stuck_bound() -> None:
    loop = asyncio.get_running_loop()
    reasons: list[str] = []
    base = rss_bytes() // MIB
    watchdog = Watchdog(
        loop, stall_limit=0, max_memory_mib=base + 32, stuck_threads=None,
        on_recycle=reasons.append,
    )  # fmt: skip
    watchdog.start()
    watchdog.sample()
    assert reasons == []
    blob = b"x" * (64 * MIB)  # resident: every page written
    watchdog.sample()
    watchdog.sample()  # asked once only
    watchdog.stop()
    del blob
    assert len(reasons) == 1
    assert f"over --max-worker-memory {base + 32} MiB" in reasons[0]
    stuck = Watchdog(
        loop, stall_limit=0, max_memory_mib=0, stuck_threads=lambda: (9, 8),
        on_recycle=reasons.append,
    )  # fmt: skip
    stuck.sample()
    assert "9 threads are stuck" in reasons[1]
    # a cap below what a worker holds at start would recycle forever: ignored, loudly
    low = Watchdog(
        loop, stall_limit=0, max_memory_mib=1, stuck_threads=None, on_recycle=reasons.append
    )
    low.start()
    low.sample()
    low.stop()
    assert (low.max_memory_mib, len(reasons)) == (0, 2)
