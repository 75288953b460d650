"""A pytest plugin that re-aims OpenEnv's own live tests at a server: ``PEER_SERVER`` is
``openenv`` (OpenEnv 0.10's uvicorn server, as the tests run it) or ``stadium``
(``stadium serve``). Loaded by scripts/openenv-peer-tests.sh with ``-p openenv_peer_plugin``;
the same tests, unchanged, run once per server:

* ``python -m uvicorn MODULE:app ...`` started by a test (``tests/envs/test_websockets.py``'s
  ``run_server``) becomes ``python -m stadium serve MODULE:app ...`` for ``stadium``; its
  startup timeout is raised to ``PEER_STARTUP_S`` on both sides (importing OpenEnv alone
  can take longer than the tests' 10 s on a loaded machine);
* ``EnvClient.from_docker_image("x-env:latest")`` (``test_coding_env_integration.py``; no
  Docker here) serves ``x_env.server.app:app`` with the chosen server instead and returns
  a connected synchronous client;
* ``fastapi.testclient.TestClient(app)`` (the production/simulation-mode route tests)
  becomes an HTTP client of a live server of that app object: uvicorn in a thread, or
  Stadium's ``Server`` built from what ``create_app`` was given, in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import httpx

SERVER = os.environ.get("PEER_SERVER", "openenv")
STARTUP_S = float(os.environ.get("PEER_STARTUP_S", "90"))
_Popen = subprocess.Popen
_started: list[Any] = []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve_command(target: str, host: str, port: int) -> list[str]:
    if SERVER == "stadium":
        return [sys.executable, "-m", "stadium", "serve", target, "--host", host,
                "--port", str(port), "--log-level", "warning"]  # fmt: skip
    return [sys.executable, "-m", "uvicorn", target, "--host", host, "--port", str(port)]


class _Redirecting(_Popen):  # type: ignore[type-arg,misc]
    """``python -m uvicorn TARGET --host H --port P`` as the chosen server's command."""

    def __init__(self, args: Any, *rest: Any, **kwargs: Any) -> None:
        if (
            SERVER == "stadium"
            and isinstance(args, list | tuple)
            and len(args) >= 4
            and list(args[1:3]) == ["-m", "uvicorn"]
        ):
            argv = [str(a) for a in args]
            host = argv[argv.index("--host") + 1] if "--host" in argv else "127.0.0.1"
            port = int(argv[argv.index("--port") + 1]) if "--port" in argv else 8000
            args = _serve_command(argv[3], host, port)
        super().__init__(args, *rest, **kwargs)


def _wait_healthy(url: str, proc: Any = None) -> None:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the {SERVER} server exited ({proc.returncode})")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise TimeoutError(f"the {SERVER} server at {url} was not healthy in {STARTUP_S:g} s")


def _from_docker_image(cls: Any, image: str, *args: Any, **kwargs: Any) -> Any:
    """Serve ``<name>.server.app:app`` (``name`` from the image: ``coding-env`` ->
    ``coding_env``) with the chosen server; a connected synchronous client."""
    name = image.split("/")[-1].split(":")[0].replace("-", "_")
    port = _free_port()
    proc = _Popen(_serve_command(f"{name}.server.app:app", "127.0.0.1", port),
                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    _started.append(proc)
    url = f"http://127.0.0.1:{port}"
    _wait_healthy(url, proc)
    return cls(base_url=url).sync()


class _LiveWebSocket:
    """What TestClient's ``websocket_connect`` returns, over a real WebSocket."""

    def __init__(self, url: str) -> None:
        from websockets.sync.client import connect

        self._ws = connect(url, open_timeout=STARTUP_S, max_size=None)

    def send_text(self, data: str) -> None:
        self._ws.send(data)

    def send_json(self, data: Any) -> None:
        self._ws.send(json.dumps(data))

    def receive_text(self) -> str:
        return str(self._ws.recv(timeout=STARTUP_S))

    def receive_json(self) -> Any:
        return json.loads(self.receive_text())

    def close(self, code: int = 1000) -> None:
        self._ws.close(code)

    def __enter__(self) -> _LiveWebSocket:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _Thread:
    """A server for an app object on its own event loop in a daemon thread."""

    def __init__(self, app: Any) -> None:
        self.url = ""
        self._ready = threading.Event()
        self._error: BaseException | None = None
        threading.Thread(target=self._run, args=(app,), daemon=True).start()
        if not self._ready.wait(STARTUP_S):
            raise TimeoutError(f"the {SERVER} server did not start")
        if self._error is not None:
            raise self._error

    def _run(self, app: Any) -> None:
        try:
            asyncio.run(self._serve(app))
        except BaseException as exc:
            self._error = exc
            self._ready.set()

    async def _serve(self, app: Any) -> None:
        if SERVER == "stadium":
            from stadium import Server, ServerConfig
            from stadium.integrations.openenv import openenv_environment
            from stadium.integrations.openenv_app import app_settings

            settings = app_settings(app, "peer test app")
            env_cls = openenv_environment(settings.env_class, app=settings)
            server = Server(ServerConfig(target="peer", port=0, drain_timeout=0.0), env_cls)
            await server.start()
            self.url = server.url
            self._ready.set()
            await asyncio.Event().wait()
        import uvicorn

        port = _free_port()
        uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        task = asyncio.ensure_future(uv.serve())
        while not uv.started:  # noqa: ASYNC110 (uvicorn has no started event)
            await asyncio.sleep(0.02)
        self.url = f"http://127.0.0.1:{port}"
        self._ready.set()
        await task


class LiveClient(httpx.Client):
    """``TestClient(app)`` as a client of a live server of ``app``."""

    def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
        self._server = _Thread(app)
        super().__init__(base_url=self._server.url, timeout=STARTUP_S)

    def websocket_connect(self, path: str, *args: Any, **kwargs: Any) -> _LiveWebSocket:
        return _LiveWebSocket(self._server.url.replace("http", "ws", 1) + path)


def pytest_configure(config: Any) -> None:
    subprocess.Popen = _Redirecting  # type: ignore[misc]
    import fastapi.testclient
    from openenv.core.env_client import EnvClient

    fastapi.testclient.TestClient = LiveClient  # type: ignore[misc,assignment]
    EnvClient.from_docker_image = classmethod(_from_docker_image)  # type: ignore[method-assign,assignment]
    os.environ.setdefault("SKIP_DOCKER_TESTS", "0")


def pytest_collection_modifyitems(session: Any, config: Any, items: Any) -> None:
    """The tests' own ``run_server`` gets ``PEER_STARTUP_S`` to start, on both sides."""
    for module in {item.module for item in items if getattr(item, "module", None)}:
        run_server = getattr(module, "run_server", None)
        inner = getattr(run_server, "__wrapped__", None)
        defaults = getattr(inner, "__defaults__", None)
        if defaults and len(defaults) >= 2 and isinstance(defaults[1], float):
            inner.__defaults__ = (defaults[0], STARTUP_S, *defaults[2:])


def pytest_unconfigure(config: Any) -> None:
    for proc in _started:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
