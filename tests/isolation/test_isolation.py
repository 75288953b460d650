"""Isolated sessions (``--isolation process|sandbox``): real servers on port 0, real env
processes, hostile envs. Sandbox tests need root, bubblewrap and cgroups: they skip with
the reason elsewhere (``make test`` installs bubblewrap as root: ``make sandbox-deps``)."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path
from typing import Any

import pytest

import stadium
from stadium import ConfigError, ErrorCode, ServerConfig
from stadium._server.isolation import sandbox_unavailable
from tests.conftest import TRANSPORTS, UNIT, serve, wait_until
from tests.isolation.neighbours import stepping

CODE = Path(__file__).with_name("hostile.py")
TARGET = f"{CODE}:Hostile"
WHY_NO_SANDBOX = sandbox_unavailable()
needs_sandbox = pytest.mark.skipif(
    WHY_NO_SANDBOX is not None, reason=f"--isolation sandbox: {WHY_NO_SANDBOX}"
)
MODES = ["process", pytest.param("sandbox", marks=needs_sandbox)]

pytestmark = pytest.mark.slow


async def _error(env: stadium.AsyncClient[Any], do: str, arg: str = "") -> stadium.StadiumError:
    with pytest.raises(stadium.StadiumError) as info:
        await env.step({"do": do, "arg": arg})
    return info.value


def test_config_checks_the_isolation_settings() -> None:
    with pytest.raises(ConfigError, match="--isolation must be"):
        ServerConfig(target="echo", isolation="kvm")
    ServerConfig(target="echo", isolation="process", durable=True)  # they go together
    with pytest.raises(ConfigError, match="--warm-pool"):
        ServerConfig(target="echo", isolation="process", warm_pool=-1)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("mode", MODES)
async def test_each_session_runs_in_its_own_process_with_the_same_protocol(
    mode: str, transport: str
) -> None:
    async with serve(TARGET, transport, isolation=mode) as server:
        async with (
            stadium.AsyncClient(server.url) as a,
            stadium.AsyncClient(server.url) as b,
        ):
            ra, rb = await a.reset(), await b.reset()
            assert ra.observation["text"] == "ready"
            pids = {ra.observation["pid"], rb.observation["pid"]}
            if mode == "sandbox":  # each is pid 2 of a pid namespace of its own (1: its init)
                assert pids == {2}
            else:
                assert len(pids) == 2
                assert os.getpid() not in pids
            step = await a.step({"do": "echo", "arg": "hi"})
            assert step.observation["text"] == "hi"
            assert step.reward == 1.0
            assert not step.done
            assert step.observation["pid"] == ra.observation["pid"]
            state = await a.state()
            assert state["step_count"] == 1
            if mode == "sandbox":  # an unprivileged uid of its own, not root, not ours
                uids = {ra.observation["uid"], rb.observation["uid"]}
                assert len(uids) == 2
                assert 0 not in uids
                assert os.getuid() not in uids
        isolation = server.runtime.isolation
        await wait_until(lambda: not isolation.live, 10 * UNIT, "env processes ended")
        assert isolation.starts == 2
        assert isolation.crashes == 0


@pytest.mark.parametrize("mode", MODES)
async def test_a_crash_is_named_and_reset_starts_a_fresh_process(mode: str) -> None:
    async with serve(TARGET, isolation=mode) as server:
        async with (
            stadium.AsyncClient(server.url) as env,
            stadium.AsyncClient(server.url) as other,
        ):
            obs = (await env.reset()).observation
            first = obs["pid"], obs["uid"]  # sandboxed: each process is pid 2, its uid its own
            await other.reset()
            err = await _error(env, "segfault")
            assert err.code == ErrorCode.ENV_CRASHED
            assert err.context["signal"] == "SIGSEGV"
            assert err.context["operation"] == "step"
            assert isinstance(err, stadium.EnvCrashedError)
            err = await _error(env, "echo")  # no reset yet: says so
            assert err.code == ErrorCode.SESSION_ERROR
            assert "reset" in err.message
            obs = (await env.reset()).observation
            second = obs["pid"], obs["uid"]
            assert second != first
            err = await _error(env, "exit")
            assert err.code == ErrorCode.ENV_CRASHED
            assert err.context["exit_code"] == 3
            await env.reset()
            assert (await env.step({"do": "echo", "arg": "ok"})).observation["text"] == "ok"
            # The other session never noticed.
            assert (await other.step({"do": "echo", "arg": "x"})).observation["text"] == "x"
            assert server.runtime.isolation.crashes == 2
            metrics = await asyncio.to_thread(_get, server.url + "/metrics")
            assert "stadium_isolated_crashes_total 2.0" in metrics
            assert 'stadium_errors_total{code="ENV_CRASHED"} 2.0' in metrics


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10 * UNIT) as r:
        return str(r.read().decode())


@pytest.mark.parametrize("mode", MODES)
async def test_a_call_past_its_time_limit_kills_the_process(mode: str) -> None:
    async with serve(TARGET, isolation=mode, step_timeout=1 * UNIT) as server:
        async with stadium.AsyncClient(server.url) as env:
            await env.reset()
            err = await _error(env, "spin")
            assert err.code == ErrorCode.LIMIT_EXCEEDED
            assert err.context["limit"] == "wall_time"
            assert (await env.reset()).observation["text"] == "ready"
            assert (await env.step({"do": "echo", "arg": "ok"})).observation["text"] == "ok"
        assert server.runtime.isolation.limit_kills == 1


async def test_process_isolation_survives_an_env_that_kills_its_parent() -> None:
    """``process`` does not stop an env from killing the template (``sandbox`` does): the
    worker and the other sessions go on, and new sessions start a new template."""
    async with serve(TARGET, isolation="process") as server:
        async with stadium.AsyncClient(server.url) as bystander:
            await bystander.reset()
            async with stadium.AsyncClient(server.url) as env:
                await env.reset()
                assert (await env.step({"do": "kill-parent"})).observation["text"] == "killed"
            assert (await bystander.step({"do": "echo", "arg": "x"})).observation["text"] == "x"
            async with stadium.AsyncClient(server.url) as late:
                assert (await late.reset()).observation["text"] == "ready"


@pytest.mark.parametrize("mode", MODES)
async def test_fork_forks_the_env_process(mode: str) -> None:
    async with serve(TARGET, isolation=mode, resume_grace=30) as server:
        async with stadium.AsyncClient(server.url) as parent:
            await parent.reset()
            await parent.step({"do": "echo", "arg": "a"})
            child = await parent.fork()
            try:
                step = await child.step({"do": "echo", "arg": "b"})
                assert step.reward == 2.0  # the env's own counter came along: 1 step before
                assert (await parent.step({"do": "echo", "arg": "c"})).reward == 2.0
                pids = {step.observation["pid"]}
                pids.add((await parent.step({"do": "echo", "arg": "d"})).observation["pid"])
                assert len(pids) == 2
            finally:
                await child.close()
        assert server.runtime.outcomes["forked"] == 1


async def test_the_warm_pool_hands_out_processes_forked_ahead() -> None:
    async with serve(TARGET, isolation="process", warm_pool=3) as server:
        isolation = server.runtime.isolation
        await wait_until(lambda: len(isolation.warm) == 3, 30 * UNIT, "warm pool filled")
        ready = {proc.pid for proc in isolation.warm}
        async with stadium.AsyncClient(server.url) as env:
            pid = (await env.reset()).observation["pid"]
            assert pid in ready
            await wait_until(lambda: len(isolation.warm) == 3, 30 * UNIT, "warm pool refilled")


@needs_sandbox
async def test_hostile_sandboxed_envs_are_contained_while_50_others_keep_stepping(
    tmp_path: Path,
) -> None:
    """One hostile session per threat, each contained and reported with its code, while
    50 well-behaved sessions on the same worker step throughout without an error."""
    outside = tmp_path / "precious.txt"
    outside.write_text("keep me")
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    port = listener.getsockname()[1]
    code_file = str(CODE)
    async with serve(
        TARGET, isolation="sandbox", step_timeout=2 * UNIT, sandbox_memory=64, sandbox_pids=32,
        max_sessions=128, warm_pool=4,
    ) as server:  # fmt: skip
        stop = asyncio.Event()

        others = [asyncio.ensure_future(stepping(server.url, n, stop)) for n in range(50)]
        async with (
            stadium.AsyncClient(server.url) as env,
            stadium.AsyncClient(server.url) as neighbour,
        ):
            await env.reset()
            await neighbour.reset()
            # Deletes files outside its work directory: the host's are not there, the
            # code is read-only.
            err = await _error(env, "delete", str(outside))
            assert err.code == ErrorCode.EXECUTION_ERROR
            assert "FileNotFoundError" in err.message
            err = await _error(env, "delete", code_file)
            assert "Read-only file system" in err.message
            assert outside.read_text() == "keep me"
            assert "class Hostile" in CODE.read_text()
            # Reads another session's files: each has its own /tmp.
            written = (await neighbour.step({"do": "write", "arg": "secret.txt"})).observation
            err = await _error(env, "read", written["text"])
            assert "FileNotFoundError" in err.message
            err = await _error(env, "read", f"/proc/{written['pid']}/root{written['text']}")
            assert "FileNotFoundError" in err.message, err.message  # not even seen
            # Opens a network connection: no network at all.
            err = await _error(env, "connect", f"127.0.0.1:{port}")
            assert "unreachable" in err.message
            with pytest.raises(BlockingIOError):
                listener.accept()
            # Sees none of the server's environment (tokens, keys).
            names = (await env.step({"do": "environ"})).observation["text"].split(",")
            assert set(names) <= {"HOME", "LANG", "PATH", "TMPDIR"}
            # Kills its parent: that is its family's init, pid 1 of its pid namespace, which
            # the kernel shields from signals sent inside the namespace (the template and
            # the worker are not in it); the session goes on.
            assert (await env.step({"do": "kill-parent"})).observation["text"] == "killed"
            assert (await env.step({"do": "echo", "arg": "on"})).observation["text"] == "on"
            # Fork bomb: the process limit refuses it.
            err = await _error(env, "forkbomb")
            assert err.code == ErrorCode.LIMIT_EXCEEDED
            assert err.context["limit"] == "pids"
            await env.reset()
            # Memory bomb: the kernel kills it at the cgroup's limit.
            err = await _error(env, "memory")
            assert err.code == ErrorCode.LIMIT_EXCEEDED
            assert err.context["limit"] == "memory"
            await env.reset()
            # Busy loop: killed at the per-call limit.
            err = await _error(env, "spin")
            assert err.code == ErrorCode.LIMIT_EXCEEDED
            assert err.context["limit"] == "wall_time"
            await env.reset()
            # Segfault.
            err = await _error(env, "segfault")
            assert err.code == ErrorCode.ENV_CRASHED
            assert err.context["signal"] == "SIGSEGV"
            assert (await env.reset()).observation["text"] == "ready"
            assert (await env.step({"do": "echo", "arg": "fine"})).observation["text"] == "fine"
        stop.set()
        steps = await asyncio.gather(*others)
        assert all(s > 0 for s in steps)
        isolation = server.runtime.isolation
        assert isolation.limit_kills == 3
        assert isolation.crashes == 1
    listener.close()
    ours = f"w{os.getpid()}-"
    await wait_until(
        lambda: not [p for p in os.listdir("/sys/fs/cgroup/pids/stadium") if p.startswith(ours)],
        10 * UNIT,
        "the sessions' cgroups removed",
    )


async def test_tool_envs_take_their_step_actions_in_their_own_process() -> None:
    async with serve("tools", isolation="process") as server:
        async with stadium.AsyncClient(server.url) as env:
            await env.reset()
            listed = await env.step({"type": "list_tools"})
            assert "add_note" in {t["name"] for t in listed.observation["tools"]}
            called = await env.step(
                {"type": "call_tool", "tool_name": "add_note", "arguments": {"text": "hi"}}
            )
            assert called.observation["result"]["data"] == 1
        assert server.runtime.isolation.starts == 1


@needs_sandbox
async def test_the_code_env_runs_submissions_against_tests_in_the_sandbox() -> None:
    async with serve("code") as server:  # the env asks for the sandbox itself
        assert server.runtime.isolation.sandbox
        async with stadium.AsyncClient(server.url) as env:
            first = await env.reset(options={"task": "fizzbuzz"})
            assert first.observation["total"] == 4
            wrong = await env.step({"code": "def fizzbuzz(n):\n    return str(n)\n"})
            assert wrong.observation["passed"] == 1
            assert wrong.reward == 0.25
            assert not wrong.done
            assert "returned '3', expected 'Fizz'" in wrong.observation["failures"][0]
            hostile = "import socket\nsocket.create_connection(('127.0.0.1', 1))\n"
            refused = await env.step({"code": hostile + "def fizzbuzz(n): return ''\n"})
            assert "unreachable" in refused.observation["failures"][0]
            right = (
                "def fizzbuzz(n):\n    return 'FizzBuzz' if n % 15 == 0 else 'Fizz' if n % 3 == 0"
                " else 'Buzz' if n % 5 == 0 else str(n)\n"
            )
            done = await env.step({"code": right})
            assert done.reward == 1.0
            assert done.done


@needs_sandbox
async def test_the_shell_env_runs_commands_as_an_unprivileged_user_without_network() -> None:
    async with serve("shell") as server:
        assert server.runtime.isolation.sandbox
        async with stadium.AsyncClient(server.url) as env:
            await env.reset()
            who = await env.step({"command": "id -u; echo hi > note.txt; cat note.txt; pwd"})
            uid, hi, pwd = who.observation["stdout"].split()
            assert int(uid) not in (0, os.getuid())
            assert hi == "hi"
            assert who.observation["exit_code"] == 0
            net = await env.step({"command": "exec 3<>/dev/tcp/127.0.0.1/22"})
            assert net.observation["exit_code"] != 0
            gone = await env.step({"command": f"ls {pwd}/note.txt && rm -rf /usr/bin/env"})
            assert "Read-only file system" in gone.observation["stderr"]
            assert gone.observation["exit_code"] != 0


async def test_no_template_starts_again_once_the_isolation_is_shut_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The warm pool's fills still on their way when the worker shuts down start no
    template again (one did, and its process and socket outlived the server)."""
    from stadium._server.isolation import Isolation, IsolationConfig
    from stadium._server.isolation.worker import template_host as host

    started: list[Any] = []
    popen = host.subprocess.Popen

    def counted(*args: Any, **kwargs: Any) -> Any:
        started.append(popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(host.subprocess, "Popen", counted)
    iso = Isolation(IsolationConfig("process", "echo", warm_pool=3))
    iso.start()  # the template, and three fills not yet run
    iso.shutdown()
    for _ in range(20):
        await asyncio.sleep(0.01)
    assert len(started) == 1
    assert started[0].poll() is not None
    assert iso.pools.all() == []
    assert iso._control is None
    assert not iso._tasks


@pytest.mark.parametrize("shape", ["LoopSyncEnv", "LoopAsyncEnv"])
async def test_env_calls_see_the_loop_they_would_in_process(shape: str) -> None:
    """A sync step runs with no running loop (its own ``asyncio.run`` works); an async one
    in a task (``asyncio.timeout`` works); a fork's copy goes on stepping alike."""
    target = f"{Path(__file__).with_name('shapes.py')}:{shape}"
    async with serve(target, isolation="process", resume_grace=30) as server:
        async with stadium.AsyncClient(server.url) as env:
            await env.reset()
            assert (await env.step({"add": 2})).observation["total"] == 2
            copy = await env.fork()
            try:
                assert (await copy.step({"add": 3})).observation["total"] == 5
                assert (await env.step({"add": 1})).observation["total"] == 3
            finally:
                await copy.close()
