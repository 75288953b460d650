"""Client-side balancing (stadium._client.balance): the pure decision, then real servers."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

import stadium
from stadium import AsyncClient, Client, Server, ServerConfig, SessionPool
from stadium._client.balance import (
    Balancer,
    Endpoint,
    apply_health,
    assumed_capacity,
    balancer_for,
    choose,
    forget_all,
    is_plain,
    mark_failed,
    mark_full,
    plan,
    retry_delay,
    soonest,
)
from stadium.deploy.deployment import Deployment
from tests.conftest import UNIT, serve, wait_until


@pytest.fixture(autouse=True)
def fresh_registry() -> Iterator[None]:
    forget_all()
    yield
    forget_all()


def eps(*caps: int | None) -> list[Endpoint]:
    return [Endpoint(f"http://10.0.0.{i + 1}:8000", capacity=c) for i, c in enumerate(caps)]


def counts(chosen: list[Endpoint], all_eps: list[Endpoint]) -> list[int]:
    c = collections.Counter(id(e) for e in chosen)
    return [c[id(e)] for e in all_eps]


# -- the decision ---------------------------------------------------------------------


def test_most_free_capacity_wins() -> None:
    nodes = eps(10, 10, 10)
    for ep, active in zip(nodes, (5, 2, 8), strict=True):
        apply_health(ep, 200, {"status": "healthy", "active_sessions": active, "max_sessions": 10})
    assert choose(nodes, 0.0) is nodes[1]


def test_local_accounting_spreads_a_burst_in_proportion_to_capacity() -> None:
    nodes = eps(100, 100, 100)
    assert counts(plan(nodes, 300, random.Random(1)), nodes) == [100, 100, 100]
    nodes = eps(5, 10, 15)
    assert counts(plan(nodes, 30, random.Random(1)), nodes) == [5, 10, 15]
    # held sessions count on top of the last report until the next one
    nodes = eps(10, 10)
    apply_health(nodes[0], 200, {"active_sessions": 0, "max_sessions": 10})
    nodes[0].held = 4  # opened since that report
    assert nodes[0].load == 4
    assert counts(plan(nodes, 4, random.Random(1)), nodes) == [0, 4]


def test_a_report_includes_the_sessions_held_at_its_time() -> None:
    (ep,) = eps(10)
    ep.held = 3
    apply_health(ep, 200, {"active_sessions": 7, "max_sessions": 10})  # 3 ours + 4 others
    assert ep.load == 7
    ep.held = 1  # two of ours closed since
    assert ep.load == 5


def test_unknown_capacity_gets_a_fair_share() -> None:
    nodes = eps(None, None, None)
    for ep in nodes:  # OpenEnv: {"status": "healthy"}
        apply_health(ep, 200, {"status": "healthy"})
    assert counts(plan(nodes, 30, random.Random(2)), nodes) == [10, 10, 10]
    mixed = eps(20, None)
    assert assumed_capacity(mixed) == 20
    assert counts(plan(mixed, 20, random.Random(2)), mixed) == [10, 10]


def test_ties_are_broken_at_random() -> None:
    nodes = eps(10, 10, 10)
    firsts = {id(choose(nodes, 0.0, random.Random(seed))) for seed in range(30)}
    assert len(firsts) == 3


def test_a_full_endpoint_is_skipped_until_retry_after() -> None:
    nodes = eps(10, 10)
    mark_full(nodes[0], now=100.0, retry_after_s=2.0)
    assert all(choose(nodes, 101.0, random.Random(s)) is nodes[1] for s in range(10))
    nodes[1].held = 9
    assert choose(nodes, 102.5) is nodes[0]
    # a report with room clears it early
    mark_full(nodes[0], now=200.0, retry_after_s=5.0)
    apply_health(nodes[0], 200, {"active_sessions": 3, "max_sessions": 10})
    assert nodes[0].available(201.0)


def test_a_dead_endpoint_backs_off_then_is_retried() -> None:
    rng = random.Random(3)
    delays = [retry_delay(n, random.Random(0), base_s=0.5, max_s=30.0) for n in range(1, 12)]
    assert all(d >= 0.25 for d in delays)
    assert max(delays) < 45.0
    assert delays[3] > delays[0]  # grows with consecutive failures
    nodes = eps(10, 10)
    mark_failed(nodes[0], 100.0, "refused", rng)
    first_until = nodes[0].down_until
    assert 100.25 <= first_until < 100.75
    assert choose(nodes, 100.1) is nodes[1]
    mark_failed(nodes[0], first_until, "refused", rng)
    assert nodes[0].failures == 2
    assert nodes[0].down_until - first_until >= 0.5
    assert nodes[0].available(nodes[0].down_until)  # retried once its delay has passed
    apply_health(nodes[0], 200, {"active_sessions": 0, "max_sessions": 10})
    assert nodes[0].failures == 0
    assert nodes[0].available(0.0)


def test_all_down_says_none_and_soonest_picks_the_first_back() -> None:
    nodes = eps(10, 10, 10)
    for ep, until in zip(nodes, (5.0, 3.0, 4.0), strict=True):
        ep.down_until = until
    assert choose(nodes, 1.0) is None
    assert soonest(nodes) is nodes[1]
    assert soonest(nodes, exclude=[nodes[1]]) is nodes[2]
    assert soonest(nodes, exclude=nodes) is None
    nodes[0].draining = True
    nodes[0].down_until = 0.0
    assert choose(nodes, 1.0) is None  # draining counts as unavailable


def test_draining_node_is_skipped() -> None:
    nodes = eps(10, 10)
    apply_health(nodes[0], 503, {"status": "draining", "active_sessions": 0, "max_sessions": 10})
    assert all(choose(nodes, 0.0, random.Random(s)) is nodes[1] for s in range(10))


def test_plain_urls_are_not_balanced(tmp_path: Path) -> None:
    assert is_plain("http://127.0.0.1:8000")
    assert is_plain("ws://[::1]:8000/ws")
    assert is_plain("10.0.0.1:8000")
    assert is_plain("http://router:8080?stadium_node=node2")  # a query: as given
    assert not is_plain("http://svc.example:8000")
    assert not is_plain(["http://127.0.0.1:8000", "http://127.0.0.1:8001"])
    dep = tmp_path / "d.json"
    Deployment.of(["http://127.0.0.1:8000"]).write(dep)
    assert not is_plain(str(dep))


async def test_dns_name_expands_to_its_addresses_and_is_resolved_again() -> None:
    answers = {"svc": ["127.0.0.11", "127.0.0.12", "127.0.0.13"]}

    async def resolver(host: str, port: int) -> list[str]:
        return answers[host]

    clock = [0.0]
    b = Balancer("http://svc:8000", resolver=resolver, dns_ttl_s=5.0, clock=lambda: clock[0])
    assert not await b.direct()
    assert [e.url for e in b.endpoints] == [f"http://127.0.0.{n}:8000" for n in (11, 12, 13)]
    assert {e.host for e in b.endpoints} == {"svc"}
    assert b.endpoints[0].ws_url == "ws://127.0.0.11:8000/ws"
    b.endpoints[0].failures = 4  # state survives a new resolution
    answers["svc"] = ["127.0.0.11", "127.0.0.14"]  # a pod went, another came
    clock[0] = 4.0
    await b.direct()
    assert len(b.endpoints) == 3  # within the TTL: unchanged
    clock[0] = 6.0
    await b.direct()
    assert [e.url for e in b.endpoints] == ["http://127.0.0.11:8000", "http://127.0.0.14:8000"]
    assert b.endpoints[0].failures == 4
    answers["svc"] = ["127.0.0.11"]  # one address: the URL as given, a plain connection
    clock[0] = 12.0
    assert await b.direct()


def test_registry_shares_one_balancer_per_spec() -> None:
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    a = balancer_for(urls)
    assert balancer_for(tuple(urls)) is a
    assert balancer_for(urls[:1]) is not a
    one, two = AsyncClient(urls), AsyncClient(urls)
    assert one.endpoints == urls
    assert two.endpoints == urls
    assert one.url == "ws://127.0.0.1:1/ws"  # the first node until connected
    assert AsyncClient("http://127.0.0.1:1").endpoints is None  # plain: no balancer at all


# -- real servers on loopback ------------------------------------------------------------


@contextlib.asynccontextmanager
async def servers(*configs: dict[str, Any]) -> AsyncIterator[list[Any]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(serve("benchmark", **c)) for c in configs]


def active(server: Any) -> int:
    return len(server.runtime.sessions)


def client(spec: Any, **kw: Any) -> AsyncClient[Any]:
    return AsyncClient(spec, connect_timeout=5 * UNIT, request_timeout=5 * UNIT, **kw)


async def open_many(spec: Any, n: int, stack: contextlib.AsyncExitStack) -> list[AsyncClient[Any]]:
    clients = [client(spec) for _ in range(n)]
    for c in clients:
        stack.push_async_callback(c.close)
    await asyncio.gather(*(c.reset() for c in clients))
    return clients


async def test_sessions_fill_servers_in_proportion_to_capacity() -> None:
    configs = [{"max_sessions": m} for m in (5, 10, 15)]
    async with servers(*configs) as srv, contextlib.AsyncExitStack() as stack:
        urls = [s.url for s in srv]
        clients = await open_many(urls, 30, stack)
        assert [active(s) for s in srv] == [5, 10, 15]
        landed = collections.Counter(c.endpoint for c in clients)
        assert landed == {urls[0]: 5, urls[1]: 10, urls[2]: 15}
        assert all(c.url == f"{c.endpoint.replace('http', 'ws')}/ws" for c in clients)  # type: ignore[union-attr]
        results = await asyncio.gather(*(c.step({"wait_seconds": 0.0}) for c in clients))
        assert all(r.observation["step_count"] == 1 for r in results)
        # one balancer for all 30, its accounting back to zero once they close
        assert len({id(c._balancer) for c in clients}) == 1
    b = balancer_for(urls)
    assert [e.held for e in b.endpoints] == [0, 0, 0]


async def test_a_full_server_gets_no_session_and_they_go_elsewhere() -> None:
    cfg = {"max_sessions": 4, "admission_timeout": 0.0}
    async with servers(cfg, cfg, cfg) as srv, contextlib.AsyncExitStack() as stack:
        urls = [s.url for s in srv]
        # probed once while empty, then no probe for a while: the balancer believes it free
        b = balancer_for(urls, probe_interval_s=600.0)
        (first,) = await open_many(urls, 1, stack)
        for _ in range(4 - active(srv[0])):  # fill node 0 behind the balancer's back
            c = client(srv[0].url)
            stack.push_async_callback(c.close)
            await c.reset()
        assert active(srv[0]) == 4
        clients = await open_many(urls, 6, stack)  # no CapacityError reaches the caller
        assert active(srv[0]) == 4
        assert all(c.endpoint != urls[0] for c in clients)
        assert active(srv[1]) + active(srv[2]) == 6 + (first.endpoint != urls[0])
        assert b.endpoints[0].error == "at capacity"  # it was tried, refused, marked full
        assert b.endpoints[0].full_until > 0


async def test_a_stopped_server_is_avoided_then_used_again_when_back() -> None:
    async with servers({}, {}, {}) as srv, contextlib.AsyncExitStack() as stack:
        urls = [s.url for s in srv]
        b = balancer_for(urls, probe_interval_s=0.05, retry_base_s=0.05, retry_max_s=0.2)
        await open_many(urls, 6, stack)
        assert all(active(s) == 2 for s in srv)
        port = srv[0].port
        await srv[0].stop()
        clients = await open_many(urls, 9, stack)  # the dead node costs no error
        assert all(c.endpoint != urls[0] for c in clients)
        back = Server(
            ServerConfig(target="benchmark", host="127.0.0.1", port=port, drain_timeout=0.0)
        )
        await back.start()
        stack.push_async_callback(back.stop)

        async def probe_and_check() -> bool:
            c = client(urls)
            stack.push_async_callback(c.close)
            await c.reset()
            return c.endpoint == urls[0]

        placed = False
        for _ in range(int(40 * UNIT)):
            if await probe_and_check():
                placed = True
                break
            await asyncio.sleep(0.05)
        assert placed, b.describe()
        assert active(back) >= 1


async def test_a_deployment_file_spreads_over_its_nodes(tmp_path: Path) -> None:
    async with servers({}, {}) as srv, contextlib.AsyncExitStack() as stack:
        path = tmp_path / "deployment.json"
        Deployment(nodes=tuple(s.url for s in srv), router=None, job_id="7").write(path)
        clients = await open_many(str(path), 8, stack)
        assert [active(s) for s in srv] == [4, 4]
        assert {c.endpoint for c in clients} == {s.url for s in srv}


async def test_connect_fails_clearly_when_every_node_is_dead() -> None:
    async with servers({}, {}) as srv:
        urls = [s.url for s in srv]
    c = client(urls, max_retries=1)
    with pytest.raises(stadium.ConnectError, match="any of 2 nodes after 2 rounds") as info:
        await c.connect()
    assert info.value.context["endpoints"] == urls


async def test_sync_client_and_session_pool_spread() -> None:
    async with servers({}, {}, {}) as srv:
        urls = [s.url for s in srv]
        async with SessionPool[Any](urls, 9, connect_timeout=5 * UNIT) as pool:
            await pool.reset()
            assert [active(s) for s in srv] == [3, 3, 3]
            assert len({c.endpoint for c in pool.clients}) == 3

        def work() -> list[str | None]:
            syncs = [Client[Any](urls, connect_timeout=5 * UNIT) for _ in range(3)]
            try:
                for s in syncs:
                    s.reset()
                return [s.endpoint for s in syncs]
            finally:
                for s in syncs:
                    s.close()

        assert sorted(await asyncio.to_thread(work)) == sorted(urls)  # type: ignore[type-var]


async def test_gym_make_vec_spreads_over_servers() -> None:
    pytest.importorskip("gymnasium")
    import stadium.gym

    async with contextlib.AsyncExitStack() as stack:
        srv = [await stack.enter_async_context(serve("gymnasium:CartPole-v1")) for _ in range(2)]
        urls = [s.url for s in srv]

        def work() -> None:
            envs = stadium.gym.make_vec(urls, num_envs=4, connect_timeout=5 * UNIT)
            try:
                obs, _ = envs.reset(seed=0)
                assert obs.shape == (4, 4)
                envs.step(envs.action_space.sample())
                assert [active(s) for s in srv] == [2, 2]
            finally:
                envs.close()

        await asyncio.to_thread(work)
        await wait_until(lambda: all(active(s) == 0 for s in srv), 5 * UNIT, "sessions closed")


async def test_a_dns_name_with_many_addresses_spreads_and_keeps_the_name_as_host() -> None:
    async with serve("benchmark") as first:
        second = Server(
            ServerConfig(target="benchmark", host="127.0.0.2", port=first.port, drain_timeout=0.0)
        )
        await second.start()
        try:

            async def resolver(host: str, port: int) -> list[str]:
                assert host == "localhost"
                return ["127.0.0.1", "127.0.0.2"]

            name = f"http://localhost:{first.port}"
            balancer_for(name, resolver=resolver)  # what a headless Service's name answers
            async with contextlib.AsyncExitStack() as stack:
                clients = await open_many(name, 6, stack)
                assert active(first) == 3
                assert active(second) == 3
                assert {c.endpoint for c in clients} == {
                    f"http://127.0.0.1:{first.port}",
                    f"http://127.0.0.2:{first.port}",
                }
        finally:
            await second.stop()


async def test_probes_read_capacity_unknown_capacity_and_silence() -> None:
    answers = {
        "stadium": b'{"status":"healthy","active_sessions":3,"max_sessions":8,'
        b'"waiting_sessions":1,"workers":1,"node":"n"}',
        "openenv": b'{"status":"healthy"}',
    }

    def handler(kind: str) -> Any:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            if kind in answers:
                body = answers[kind]
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
                )
                await writer.drain()
            writer.close()

        return handle

    async with contextlib.AsyncExitStack() as stack:
        urls = []
        for kind in ("stadium", "openenv", "silent"):
            srv = await asyncio.start_server(handler(kind), "127.0.0.1", 0)
            stack.push_async_callback(srv.wait_closed)
            stack.callback(srv.close)
            urls.append(f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}")
        b = Balancer(urls, probe_timeout_s=2 * UNIT)
        await b.probe()
        stadium_ep, openenv_ep, silent_ep = b.endpoints
        assert (stadium_ep.capacity, stadium_ep.load) == (8, 4)
        assert openenv_ep.capacity is None
        assert openenv_ep.available(b.clock())
        assert silent_ep.failures == 1
        assert not silent_ep.available(b.clock())
