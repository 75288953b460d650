"""The benchmark env reports where it runs as the scaling study's env does."""

from __future__ import annotations

import socket
import urllib.parse

import pytest

import stadium
from stadium.bench.arms import spawn_server
from stadium.envs.benchmark import BenchmarkEnv, host_url


def test_host_url_names_this_host_and_the_port_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STADIUM_PORT", "8123")
    assert host_url() == f"{socket.gethostname()}:8123"
    monkeypatch.delenv("STADIUM_PORT")
    monkeypatch.setenv("PORT", "9001")
    assert host_url() == f"{socket.gethostname()}:9001"
    assert BenchmarkEnv().__class__.name == "benchmark"


@pytest.mark.slow
def test_stadium_serve_reports_host_url_with_its_own_port() -> None:
    """``stadium serve benchmark``: every observation carries ``host_url`` =
    ``<hostname>:<the port it listens on>`` (what ``test_scaling.py`` counts hosts by),
    and keeps ``host``."""
    with spawn_server("benchmark", "--log-level", "warning") as (_, url):
        port = urllib.parse.urlsplit(url).port
        with stadium.Client(url) as env:
            first = env.reset()
            result = env.step({"wait_seconds": 0})
    expected = f"{socket.gethostname()}:{port}"
    assert first.observation["host_url"] == expected
    assert result.observation["host_url"] == expected
    assert result.observation["host"] == socket.gethostname()
