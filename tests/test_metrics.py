"""``GET /metrics``: Prometheus text, parsed with prometheus-client's own parser, whose
counters equal what the test sent, summed over forked workers (also after one is killed)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import urllib.error
import urllib.request
from typing import Any

import pytest
import websockets
from prometheus_client.parser import text_string_to_metric_families

from stadium import AsyncClient
from stadium.envs.benchmark import BenchmarkObservation
from tests.conftest import TRANSPORTS, UNIT, proc_alive, proc_children, serve, wait_until
from tests.test_supervisor import _serve

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str, str]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10 * UNIT) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read().decode()


async def scrape(base: str, headers: dict[str, str] | None = None) -> Samples:
    """``GET base/metrics``, parsed: (sample name, sorted labels) -> value."""
    status, ctype, text = await asyncio.to_thread(_get, base + "/metrics", headers)
    assert status == 200, text
    assert ctype.startswith("text/plain; version=")
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name, tuple(sorted(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[name, tuple(sorted(labels.items()))]


def per_worker(samples: Samples, name: str) -> dict[str, float]:
    return {dict(k[1])["worker"]: v for k, v in samples.items() if k[0] == name}


async def _sessions(url: str, n: int, k: int) -> set[int]:
    """``n`` sessions of ``k`` steps each (reset first); the worker pids that served them."""
    pids: set[int] = set()

    async def one() -> None:
        async with AsyncClient(url, observation_type=BenchmarkObservation) as env:
            await env.reset()
            for _ in range(k):
                pids.add((await env.step({"wait_seconds": 0})).observation.pid)

    await asyncio.gather(*(one() for _ in range(n)))
    return pids


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_single_worker_counts_what_it_served(transport: str) -> None:
    n, k = 5, 7
    async with serve("benchmark", transport) as server:
        await _sessions(server.url, n, k)
        await wait_until(lambda: not server.runtime.sessions, 5 * UNIT, "sessions ended")
        m = await scrape(server.url)
    assert value(m, "stadium_steps_total") == n * k
    assert value(m, "stadium_step_duration_seconds_count") == n * k
    assert value(m, "stadium_step_duration_seconds_bucket", le="+Inf") == n * k
    assert value(m, "stadium_step_duration_seconds_sum") >= 0
    assert value(m, "stadium_reset_duration_seconds_count") == n
    assert value(m, "stadium_sessions_total", outcome="completed") == n
    for outcome in ("refused", "errored", "reaped", "resumed"):
        assert value(m, "stadium_sessions_total", outcome=outcome) == 0
    assert value(m, "stadium_sessions_active") == 0
    assert value(m, "stadium_admission_queue") == 0
    assert value(m, "stadium_admission_wait_seconds_count") == n
    assert value(m, "stadium_errors_total", code="INVALID_JSON") == 0
    (rss,) = per_worker(m, "stadium_worker_resident_memory_bytes").values()
    assert rss > 1 << 20
    assert next(iter(per_worker(m, "stadium_worker_cpu_seconds_total").values())) > 0
    assert next(iter(per_worker(m, "stadium_bytes_sent_total").values())) >= 0
    assert str(os.getpid()) in per_worker(m, "stadium_worker_open_connections")


async def test_errors_are_counted_by_code_and_waiting_sessions_are_seen() -> None:
    async with serve("benchmark", max_sessions=1, admission_timeout=30 * UNIT) as server:
        ws_url = server.url.replace("http", "ws") + "/ws"
        async with websockets.connect(ws_url) as ws:
            for frame in ("{nope", "{nope", '{"type":"fly"}', '{"type":"step","data":{}}'):
                await ws.send(frame)
                await ws.recv()
            await ws.send('{"type":"reset"}')
            await ws.recv()
            await ws.send('{"type":"step","data":{"wait_seconds":"soon"}}')
            await ws.recv()
            m = await scrape(server.url)
            assert value(m, "stadium_errors_total", code="INVALID_JSON") == 2
            assert value(m, "stadium_errors_total", code="UNKNOWN_TYPE") == 1
            assert value(m, "stadium_errors_total", code="VALIDATION_ERROR") == 1
            assert value(m, "stadium_errors_total", code="SESSION_ERROR") == 1
            assert value(m, "stadium_sessions_active") == 1
            # A second session waits for the only slot.
            async with websockets.connect(ws_url) as waiting:
                await wait_until(lambda: server.runtime.admission.waiting == 1, 5 * UNIT)
                m = await scrape(server.url)
                assert value(m, "stadium_admission_queue") == 1
                assert value(m, "stadium_sessions_active") == 1
                await ws.close()
                await waiting.send('{"type":"reset"}')
                assert json.loads(await waiting.recv())["type"] == "observation"
                m = await scrape(server.url)
                assert value(m, "stadium_admission_queue") == 0
                assert value(m, "stadium_admission_wait_seconds_count") == 2
                assert value(m, "stadium_admission_wait_seconds_sum") > 0
        # No wait at all (admission timeout 0): refused.
    async with serve("benchmark", max_sessions=1, admission_timeout=0) as server:
        async with AsyncClient(server.url) as env:
            await env.reset()
            async with websockets.connect(server.url.replace("http", "ws") + "/ws") as other:
                refusal = json.loads(await other.recv())
                assert refusal["data"]["code"] == "CAPACITY_REACHED"
            m = await scrape(server.url)
        assert value(m, "stadium_sessions_total", outcome="refused") == 1
        assert value(m, "stadium_errors_total", code="CAPACITY_REACHED") == 1


async def test_idle_sessions_reaped_count_as_reaped() -> None:
    async with serve("benchmark", idle_timeout=0.2) as server:
        async with websockets.connect(server.url.replace("http", "ws") + "/ws") as ws:
            await ws.send('{"type":"reset"}')
            await ws.recv()
            await wait_until(lambda: server.runtime.outcomes["reaped"] == 1, 10 * UNIT)
        m = await scrape(server.url)
    assert value(m, "stadium_sessions_total", outcome="reaped") == 1
    assert value(m, "stadium_sessions_total", outcome="completed") == 0


async def test_metrics_need_the_token_when_one_is_set() -> None:
    async with serve("benchmark", auth_token="s3cret-token-for-metrics") as server:
        status, _, _ = await asyncio.to_thread(_get, server.url + "/metrics")
        assert status == 401
        m = await scrape(server.url, {"Authorization": "Bearer s3cret-token-for-metrics"})
        assert value(m, "stadium_steps_total") == 0


@pytest.mark.slow
async def test_two_workers_are_summed_and_a_killed_worker_counts_stay() -> None:
    with _serve("benchmark", "--workers", "2", "--max-sessions", "64") as served:
        pids: set[int] = set()
        rounds = 0
        total_sessions = 0
        while len(pids) < 2 and rounds < 20:  # sessions land where the kernel puts them
            pids |= await _sessions(served.url, 8, 5)
            rounds += 1
            total_sessions += 8
        assert len(pids) == 2, "every session landed on one worker"
        expected_steps = total_sessions * 5
        # Counted as they are answered, in shared memory: exact at once, on either worker.
        for _ in range(4):
            m = await scrape(served.url)
            assert value(m, "stadium_steps_total") == expected_steps
            assert value(m, "stadium_step_duration_seconds_count") == expected_steps
            assert value(m, "stadium_reset_duration_seconds_count") == total_sessions

        async def settled() -> Samples:
            m: Samples = {}

            async def done() -> bool:
                nonlocal m
                m = await scrape(served.url)
                return (
                    value(m, "stadium_steps_total") == expected_steps
                    and value(m, "stadium_sessions_total", outcome="completed") == total_sessions
                )

            for _ in range(int(50 * UNIT)):
                if await done():
                    return m
                await asyncio.sleep(0.1)
            pytest.fail(f"metrics never added up: {m}")

        m = await settled()
        assert value(m, "stadium_step_duration_seconds_count") == expected_steps
        assert set(per_worker(m, "stadium_worker_resident_memory_bytes")) == {str(p) for p in pids}
        # SIGKILL one worker: its counts move to the retired row; nothing goes down.
        victim = min(pids)
        os.kill(victim, signal.SIGKILL)
        await wait_until(lambda: not proc_alive(victim), 5 * UNIT, "the worker died")
        await wait_until(
            lambda: (
                len(proc_children(served.proc.pid)) == 2
                and victim not in proc_children(served.proc.pid)
            ),
            10 * UNIT,
            "the worker was replaced",
        )
        m = await scrape(served.url)  # the dead worker's counts are in the retired row
        assert value(m, "stadium_steps_total") == expected_steps
        assert value(m, "stadium_sessions_total", outcome="completed") == total_sessions
        assert str(victim) not in per_worker(m, "stadium_worker_resident_memory_bytes")
        assert value(m, "stadium_step_duration_seconds_count") == expected_steps
        # And the new worker counts on top of them.
        await _sessions(served.url, 4, 3)
        m = await scrape(served.url)
        assert value(m, "stadium_steps_total") == expected_steps + 12


@pytest.mark.slow
async def test_json_logs_are_one_object_per_line_with_the_fields() -> None:
    with _serve("benchmark", "--log-format", "json", "--log-level", "info") as served:
        async with websockets.connect(served.url.replace("http", "ws") + "/ws") as ws:
            await ws.send('{"type":"reset","data":{"state_kb":-1}}')  # the env raises
            assert json.loads(await ws.recv())["data"]["code"] == "EXECUTION_ERROR"
        served.proc.send_signal(signal.SIGTERM)
        served.proc.wait(15 * UNIT)
        lines = [line for line in served.output().splitlines() if line.startswith("{")]
    assert lines, served.output()
    records: list[dict[str, Any]] = [json.loads(line) for line in lines]
    for record in records:
        assert {"time", "level", "logger", "message", "pid"} <= set(record)
    assert any("draining" in r["message"] for r in records)
    (raised,) = [r for r in records if "reset raised" in r["message"]]
    assert raised["level"] == "WARNING"
    assert raised["session"].startswith(f"{raised['pid']}.")
    assert "Traceback" in raised["exception"]


def test_json_log_records_carry_the_session_id() -> None:
    import logging

    from stadium._server.runtime import SESSION_ID
    from stadium._server.server import JsonLogFormatter

    token = SESSION_ID.set("123.4")
    try:
        record = logging.LogRecord(
            "stadium.session", logging.WARNING, __file__, 1, "x %d", (1,), None
        )
        out = json.loads(JsonLogFormatter().format(record))
    finally:
        SESSION_ID.reset(token)
    assert out["session"] == "123.4"
    assert out["message"] == "x 1"
    assert out["level"] == "WARNING"
