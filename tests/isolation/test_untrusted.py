"""``--isolation sandbox --untrusted-env-code``: the env's module is imported only by each
session's process, inside its sandbox (unprivileged uid, no capabilities, seccomp), never
by the supervisor, the workers or the template; the server learns the env from a
sandboxed ``describe``, and actions are validated in the sandbox.

``import_hostile.py``'s import-time code tries to reach the host (a marker file outside the
sandbox, the server's secret, ``/proc/1/environ``, a netlink socket) and reports who ran it.
Under the default ``--isolation sandbox`` it ran in the worker and in the template, as root
with every capability (the contrast test); with ``--untrusted-env-code`` none of it succeeds
and only a session's sandboxed process ran it. Real servers, root and bubblewrap (the tests
skip with the reason elsewhere)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets

import stadium
from stadium import ErrorCode
from stadium._server.isolation import sandbox_unavailable
from stadium._server.isolation.template.seccomp import seccomp_unavailable
from tests.conftest import serve
from tests.isolation.test_isolation_serve import _workers
from tests.test_durable import _Server

HERE = Path(__file__).parent
WHY_NOT = sandbox_unavailable() or seccomp_unavailable()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(WHY_NOT is not None, reason=f"--isolation sandbox: {WHY_NOT}"),
]
NO_CAPS = "0000000000000000"


@pytest.fixture
def hostile(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """``(target, outside)``: a fresh copy of ``import_hostile.py`` (its own module name, so
    no process has it cached) and the folder outside any sandbox it tries to write to."""
    code, outside = tmp_path / "code", tmp_path / "outside"
    code.mkdir()
    outside.mkdir()
    (outside / "secret").write_text("the server's secret\n")
    (outside / "secret").chmod(0o600)
    (code / "outside.txt").write_text(str(outside))
    name = f"import_hostile_{uuid.uuid4().hex[:8]}"
    shutil.copy(HERE / "import_hostile.py", code / f"{name}.py")
    yield f"{code / name}.py:ImportHostile", outside
    for module in [m for m in sys.modules if name in m]:
        del sys.modules[module]


def _findings(result: Any) -> dict[str, Any]:
    return json.loads(result.observation["findings"])  # type: ignore[no-any-return]


def _get_now(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


async def _get(url: str) -> Any:
    """GET in a thread: the in-process servers run on this test's loop."""
    return await asyncio.to_thread(_get_now, url)


async def test_import_time_code_runs_only_in_a_sessions_sandbox(
    hostile: tuple[str, Path], tmp_path: Path
) -> None:
    target, outside = hostile
    args = ("--workers", "2", "--isolation", "sandbox", "--untrusted-env-code", "--warm-pool", "1")
    server = _Server(tmp_path / "sessions", *args, target=target)  # --durable too
    try:
        await asyncio.to_thread(server.wait_healthy)
        async with stadium.AsyncClient(server.url) as env:
            found = _findings(await env.reset())
            stepped = await env.step({"n": 3})
            with pytest.raises(stadium.ValidationError) as invalid:
                await env.step({"n": "three"})
        assert _findings(stepped) == found
        assert stepped.reward == 3.0
        assert invalid.value.code == ErrorCode.VALIDATION_ERROR
        assert invalid.value.context["field"] == "$.n"
        assert _get_now(server.url + "/schema")["action"]["required"] == ["n"]
        # --durable: sessions outlive their worker, restored into fresh sandboxed processes
        async with stadium.SessionPool(server.url, size=2, max_retries=40) as pool:
            await pool.reset()
            await pool.step([{"n": 1}] * 2)
            workers = _workers(server.proc.pid)
            assert len(workers) == 2
            for pid in workers:
                os.kill(pid, signal.SIGKILL)
            after = await pool.step([{"n": 2}] * 2)
            assert [r.reward for r in after] == [2.0, 2.0]
            assert all(client.resumes == 1 for client in pool.clients)
            assert all(_findings(r)["uid"] != 0 for r in after)
    finally:
        server.stop()
    # Only a session's process, pid 2 of its family's namespace under its init, ran it:
    assert (found["pid"], found["ppid"]) == (2, 1)
    assert found["uid"] != 0
    assert found["cap_eff"] == NO_CAPS
    assert found["marker"] in ("ENOENT", "EACCES", "EROFS")
    assert not found["secret"].startswith("read")
    assert not found["init_environ"].startswith("read")
    assert found["netlink"] == "EPERM"  # the seccomp filter's answer
    # Neither the supervisor, nor a worker, nor the template ran it (as root, they could
    # have written the marker).
    assert not (outside / "marker").exists()


async def test_by_default_the_server_and_the_template_import_the_env_as_root(
    hostile: tuple[str, Path],
) -> None:
    """The contrast: what the same import reaches under a default ``--isolation sandbox``."""
    target, outside = hostile
    async with serve(target, isolation="sandbox") as server:
        async with stadium.AsyncClient(server.url) as env:
            found = _findings(await env.reset())
    marks = (outside / "marker").read_text().split("\n")
    assert f"{os.getpid()} 0" in marks  # the worker (this process) ran it, as root
    # The session's process is a fork of the template, which imported it as root with
    # every capability and no seccomp filter (before any session's sandbox).
    assert found["uid"] == 0
    assert found["cap_eff"] != NO_CAPS
    assert found["netlink"] == "opened"


async def test_the_worker_never_imports_the_env_module(hostile: tuple[str, Path]) -> None:
    target, outside = hostile
    async with serve(target, isolation="sandbox", untrusted_env_code=True) as server:
        assert type(server.spec.env_cls).__module__ != "import_hostile"
        async with stadium.AsyncClient(server.url) as env:
            assert _findings(await env.reset())["uid"] != 0
    code_file = target.rsplit(":", 1)[0]
    assert not [m for m in sys.modules.values() if getattr(m, "__file__", None) == code_file]
    assert not (outside / "marker").exists()


async def _errors(url: str, actions: list[Any]) -> list[tuple[str, str, Any]]:
    out = []
    async with stadium.AsyncClient(url) as env:
        await env.reset()
        for action in actions:
            with pytest.raises(stadium.StadiumError) as err:
                await env.step(action)
            out.append((str(err.value.code), err.value.message, err.value.context.get("field")))
    return out


async def test_an_ordinary_env_serves_alike_with_its_errors() -> None:
    bad = [{"message": 3}, {"message": "x", "extra": 1}, {}]
    async with serve("echo") as server:
        expected = await _errors(server.url, bad)
        schema = await _get(server.url + "/schema")
        metadata = await _get(server.url + "/metadata")
    async with serve("echo", isolation="sandbox", untrusted_env_code=True) as server:
        assert await _errors(server.url, bad) == expected
        assert await _get(server.url + "/schema") == schema
        assert await _get(server.url + "/metadata") == metadata
        assert (await _get(server.url + "/openapi.json"))["info"]["title"] == "echo"
        async with stadium.AsyncClient(server.url) as env:
            await env.reset()
            step = await env.step({"message": "hi"})
            assert step.observation["echoed_message"] == "hi"
            assert (await env.state())["step_count"] == 1


async def test_tools_fork_and_the_warm_pool_work_untrusted() -> None:
    async with serve("tools", isolation="sandbox", untrusted_env_code=True, warm_pool=2,
                     resume_grace=30) as server:  # fmt: skip
        assert (await _get(server.url + "/schema"))["tools"]
        async with stadium.AsyncClient(server.url) as env:
            await env.reset()
            called = await env.step(
                {"type": "call_tool", "tool_name": "add_note", "arguments": {"text": "hi"}}
            )
            assert called.observation["result"]["data"] == 1
            listed = await env.step({"type": "list_tools"})
            assert "add_note" in {t["name"] for t in listed.observation["tools"]}
            child = await env.fork()
            try:
                again = await child.step(
                    {"type": "call_tool", "tool_name": "add_note", "arguments": {"text": "b"}}
                )
                assert again.observation["result"]["data"] == 2  # the note came along
            finally:
                await child.close()
        assert server.runtime.outcomes["forked"] == 1
        async with websockets.connect(server.url.replace("http", "ws") + "/ws") as ws:
            rpc = {"jsonrpc": "2.0", "method": "tools/list", "params": {}, "id": 1}
            await ws.send(json.dumps({"type": "mcp", "data": rpc, "id": 9}))
            reply = json.loads(await ws.recv())
            assert "add_note" in {t["name"] for t in reply["data"]["result"]["tools"]}


async def test_an_openenv_app_directory_serves_untrusted() -> None:
    pytest.importorskip("openenv")
    app = str(HERE.parent / "openenv_apps" / "echo_env")
    async with serve(app) as server:
        schema = await _get(server.url + "/schema")
        metadata = await _get(server.url + "/metadata")
    async with serve(app, isolation="sandbox", untrusted_env_code=True) as server:
        assert await _get(server.url + "/schema") == schema
        assert await _get(server.url + "/metadata") == metadata
        async with stadium.AsyncClient(server.url) as env:
            await env.reset()
            step = await env.step({"message": "hey"})
            assert "hey" in json.dumps(step.observation)
