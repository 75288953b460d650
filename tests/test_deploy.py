"""Deployment files and the HAProxy router: parsing, rendering, and HAProxy for real on loopback."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from stadium import Client, ConfigError
from stadium._cli.main import main
from stadium._core.urls import base_url
from stadium.bench.arms import free_port, spawn_server, wait_healthy
from stadium.deploy.deployment import Deployment, endpoints
from stadium.deploy.haproxy import RouterOptions, check_config, render
from tests.conftest import UNIT

#: Process-level: servers, tools or interpreters in subprocesses (`make check` skips it).
pytestmark = pytest.mark.slow

HAPROXY = shutil.which("haproxy")
needs_haproxy = pytest.mark.skipif(
    HAPROXY is None, reason="haproxy is not installed (make test installs it when root)"
)


@pytest.mark.parametrize(
    ("text", "url"),
    [
        ("http://10.0.0.1:8000", "http://10.0.0.1:8000"),
        ("ws://10.0.0.1:8000/ws", "http://10.0.0.1:8000"),
        ("10.0.0.1:8000", "http://10.0.0.1:8000"),
        ("wss://example.org/ws", "https://example.org:443"),
        ("http://[::1]:9/", "http://[::1]:9"),
    ],
)
def test_base_url_accepts_every_form_users_give(text: str, url: str) -> None:
    assert base_url(text) == url


@pytest.mark.parametrize("text", ["ftp://h:1", "http://h:1/other", "http://:80", "http://h:x"])
def test_base_url_says_what_is_wrong(text: str) -> None:
    with pytest.raises(ConfigError):
        base_url(text)


def test_deployment_file_round_trip_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "d" / "deployment.json"
    d = Deployment(nodes=("ws://10.0.0.1:8000/ws", "10.0.0.2:8000"), router="10.0.0.1:8080",
                   job_id="42", max_sessions_per_node=100)  # fmt: skip
    d.write(path)
    again = Deployment.read(path)
    assert again == d
    assert again.nodes == ("http://10.0.0.1:8000", "http://10.0.0.2:8000")
    assert again.url == "http://10.0.0.1:8080"
    assert endpoints([str(path)]) == d
    assert endpoints(["h1:1", "h2:2"]).nodes == ("http://h1:1", "http://h2:2")
    (tmp_path / "bad.json").write_text('{"nodes": "h:1"}')
    with pytest.raises(ConfigError, match="nodes"):
        Deployment.read(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="cannot read"):
        Deployment.read(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="at least one node"):
        Deployment(nodes=())


def test_render_places_caps_checks_and_routes_back() -> None:
    d = Deployment(nodes=("h1:8000", "h2:8000"), max_sessions_per_node=500)
    text = render(d, RouterOptions(port=9000, stats_socket="/run/s.sock", tunnel_timeout=7200))
    assert "balance leastconn" in text
    assert "bind 0.0.0.0:9000" in text
    assert "server node1 h1:8000 maxconn 500" in text
    assert "server node2 h2:8000 maxconn 500" in text
    assert "http-check send meth GET uri /health ver HTTP/1.1" in text
    assert "timeout tunnel 7200000ms" in text
    assert "stats socket /run/s.sock mode 600 level admin" in text
    assert "use-server node2 if { url_param(stadium_node) -m str node2 h2:8000 }" in text
    # The caller's capacity wins over the deployment's.
    assert "server node1 h1:8000 maxconn 7\n" in render(d, RouterOptions(max_sessions_per_node=7))


def test_router_command_writes_the_file(tmp_path: Path) -> None:
    out = tmp_path / "haproxy.cfg"
    main(["router", "h1:8000", "ws://h2:8000/ws", "--port", "9001", "-o", str(out)])
    assert "server node2 h2:8000" in out.read_text()


@needs_haproxy
def test_haproxy_accepts_the_rendered_configuration() -> None:
    d = Deployment(nodes=("127.0.0.1:1", "127.0.0.1:2", "https://127.0.0.1:3"))
    assert check_config(render(d, RouterOptions(port=free_port())))
    with pytest.raises(ConfigError, match="rejects"):
        check_config("frontend x\n    bogus_keyword 1\n")


@contextlib.contextmanager
def _haproxy(cfg: str, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    assert HAPROXY is not None
    path = tmp_path / "haproxy.cfg"
    path.write_text(cfg)
    proc = subprocess.Popen([HAPROXY, "-f", str(path), "-db"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10 * UNIT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _pid_of_session(url: str) -> int:
    with Client(url) as env:
        obs = env.reset().observation
        return int(obs["pid"])


@needs_haproxy
def test_sessions_through_haproxy_reach_every_node_and_come_back_to_one(tmp_path: Path) -> None:
    serve = ("benchmark", "--log-level", "warning")
    with spawn_server(*serve) as (a, url_a), spawn_server(*serve) as (b, url_b):
        port = free_port()
        cfg = render(Deployment.of([url_a, url_b]), RouterOptions(bind="127.0.0.1", port=port))
        with _haproxy(cfg, tmp_path) as proxy:
            wait_healthy(port, proxy, 30 * UNIT)
            router = f"http://127.0.0.1:{port}"
            # Health checks mark both nodes up (a check every second, rise 2).
            seen: set[int] = set()

            def both() -> bool:
                seen.add(_pid_of_session(router))
                return seen >= {a.pid, b.pid}

            for _ in range(200):  # bounded: the checks need ~2 s to mark both up
                if both():
                    break
            assert seen >= {a.pid, b.pid}, "sessions through HAProxy did not reach both nodes"
            for _ in range(4):
                assert _pid_of_session(f"{router}?stadium_node=node2") == b.pid
                assert _pid_of_session(f"{router}?stadium_node=node1") == a.pid


def test_cli_module_runs() -> None:
    cmd = [sys.executable, "-m", "stadium", "router", "--help"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=os.environ.copy())
    assert "haproxy.cfg" in out.stdout
