"""Shared fixtures: in-process servers on port 0, subprocess servers, a scalable time unit."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import uvicorn

from stadium import Server, ServerConfig
from stadium._env.contract import Environment
from stadium._server.transports.asgi import AsgiApp

#: Every timeout in the tests is a multiple of this unit (STADIUM_TEST_UNIT scales it).
UNIT = float(os.environ.get("STADIUM_TEST_UNIT", "1.0"))


@dataclasses.dataclass
class AsgiServer:
    """A Stadium ASGI app under uvicorn, with the attributes tests read from a Server."""

    app: AsgiApp
    url: str

    @property
    def runtime(self) -> Any:
        return self.app.runtime

    @property
    def config(self) -> ServerConfig:
        return self.app.config


@contextlib.asynccontextmanager
async def serve(
    target: str | type[Environment[Any, Any, Any]] = "benchmark",
    transport: str = "picows",
    **config: Any,
) -> AsyncIterator[Any]:
    """Run a server in this event loop on 127.0.0.1:0; stop it afterwards.

    ``transport`` is ``picows`` (``stadium serve``'s) or ``asgi`` (the ASGI app under uvicorn).
    """
    env_cls = None if isinstance(target, str) else target
    name = target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"
    config.setdefault("drain_timeout", 0.0)
    cfg = ServerConfig(target=name, host="127.0.0.1", port=0, **config)
    if transport == "asgi":
        app = AsgiApp(cfg, env_cls)
        uv = uvicorn.Server(
            uvicorn.Config(
                app, host="127.0.0.1", port=0, log_level="warning", lifespan="on",
                ws="websockets-sansio", ws_max_size=cfg.max_message_bytes,
                ws_per_message_deflate=False,
            )
        )  # fmt: skip
        task = asyncio.ensure_future(uv.serve())
        while not uv.started:
            await asyncio.sleep(0.01)
            if task.done():
                task.result()
        port = uv.servers[0].sockets[0].getsockname()[1]
        try:
            yield AsgiServer(app, f"http://127.0.0.1:{port}")
        finally:
            uv.should_exit = True
            await task
        return
    server = Server(cfg, env_cls)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


TRANSPORTS = ["picows", "asgi"]

#: Markers of tiers that are process-level by nature; their tests are ``slow`` too.
SLOW_TIERS = frozenset({"cluster", "container", "stress"})


class _LoopErrors(logging.Handler):
    """What an event loop's exception handler reported (an exception in a callback, a task's
    exception never retrieved): asyncio's and uvloop's default handler log it on ``asyncio``."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(autouse=True)
def _loop_errors_fail_the_test() -> Iterator[None]:
    """An exception that reached an event loop's exception handler during a test fails it
    (as an exception in a thread does: pytest's warning, an error here)."""
    handler = _LoopErrors()
    logger = logging.getLogger("asyncio")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
    if handler.records:
        said = "\n".join(handler.format(r) + (f"\n{r.exc_text or ''}") for r in handler.records)
        pytest.fail(f"the event loop's exception handler was called:\n{said}", pytrace=False)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """``slow`` covers the cluster, container and stress tiers (``make check`` skips them)."""
    for item in items:
        if any(mark.name in SLOW_TIERS for mark in item.iter_markers()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def unit() -> float:
    return UNIT


async def wait_until(predicate: Callable[[], bool], limit_s: float, what: str = "") -> None:
    """Poll ``predicate`` until true; fail the test after ``limit_s`` seconds.

    For states with no event to wait on (/proc, a log file, a server's counters).
    """
    deadline = time.monotonic() + limit_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"not true after {limit_s:.1f} s: {what or predicate}")
        await asyncio.sleep(0.02)


def proc_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone (reaped between open and read)
        return False


def daemon_code(pid_file: str) -> str:
    """Python that leaves a daemon running (in a session of its own, after a double fork,
    its descriptors closed) and has written its pid to ``pid_file`` before it goes on (so
    that a loaded machine cannot end the caller first)."""
    return (
        "import os, time\n"
        "r, w = os.pipe()\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        os.write(w, str(os.getpid()).encode())\n"
        "        os.closerange(0, 1024)\n"
        "        time.sleep(1000)\n"
        "    pid = os.read(r, 32)\n"
        f"    with open({pid_file!r}, 'wb') as f:\n"
        "        f.write(pid)\n"
        "    os._exit(0)\n"
        "os.wait()\n"
    )


def assert_ended(pid: int, what: str) -> None:
    """``pid`` no longer runs (killed here if it does, and the test fails naming ``what``)."""
    alive = proc_alive(pid)
    if alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"{what} outlived it"


def proc_children(pid: int) -> list[int]:
    """The child processes of ``pid`` (e.g. a supervisor's workers)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return []
