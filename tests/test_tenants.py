"""Tenants (``--tenants FILE``): tokens name tenants, slots go in weighted fair order,
quotas hold over every worker, each tenant sees its own usage, SIGHUP reloads in place,
and a bad file is a clear error at start."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import random
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets
from multidict import CIMultiDict

import stadium
from stadium._core.access import (
    MAX_SEEN,
    MAX_SEEN_CHARS,
    AccessPolicy,
    Refusal,
    Tenant,
    TenantBook,
    TenantTable,
)
from stadium._core.handshake import MSGPACK_SUBPROTOCOL, Terms, Upgrade, _negotiate, negotiate
from stadium._core.protocol import Encoding
from stadium._core.resume import TOKEN_HEADER
from stadium._errors import ConfigError
from stadium._server.admission.fair import FairAdmission
from stadium._server.admission.slots import LocalSlots
from stadium._server.admission.tenants import (
    ANON,
    CHARGED,
    HELD,
    WAIT_BUCKETS,
    WAIT_HIST,
    WAIT_US,
    WAITING,
    SharedTenants,
    TenantDirectory,
    load_tenants,
)
from stadium._server.config import ServerConfig
from stadium._server.server import Server
from stadium.envs.benchmark import BenchmarkEnv
from tests.conftest import TRANSPORTS, UNIT, serve, wait_until
from tests.test_supervisor import _serve

TOKENS = {name: f"token-of-{name}-{'x' * 16}" for name in ("alpha", "beta", "gamma")}


def _sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _file(tmp_path: Path, text: str, name: str = "tenants.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _tenants(tmp_path: Path, **tenants: dict[str, Any]) -> str:
    lines = []
    for name, fields in tenants.items():
        lines.append(f"[tenants.{name}]")
        lines.append(f'token_sha256 = ["{_sha(TOKENS[name])}"]')
        lines += [f"{k} = {json.dumps(v)}" for k, v in fields.items()]
    return _file(tmp_path, "\n".join(lines) + "\n")


def _auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[name]}"}


# -- the file ----------------------------------------------------------------------


Z = 'token_sha256 = "' + "0" * 64 + '"\n'
A = "[tenants.a]\n"


@pytest.mark.parametrize(
    ("text", "field"),
    [
        (A + "weight = 1\n", "tenants.a"),  # no token
        (A + 'token_sha256 = "abc"\n', "tenants.a.token_sha256"),
        (A + Z + "weight = 0\n", "tenants.a.weight"),
        (A + Z + 'weight = "x"\n', "tenants.a.weight"),
        (A + Z + "max_sessions = -1\n", "tenants.a.max_sessions"),
        (A + Z + "rate_limit = -2\n", "tenants.a.rate_limit"),
        (A + Z + 'token = "plain"\n', "tenants.a.token"),
        (A + Z + "[tenants.b]\n" + Z, "tenants.b"),  # a token of two tenants
        (A + "token_file = '/nonexistent/token'\n", "tenants.a.token_file"),
        ("[other]\nx = 1\n", "tenants"),
    ],
)  # fmt: skip
def test_a_bad_tenants_file_is_a_clear_error_naming_the_field(
    tmp_path: Path, text: str, field: str
) -> None:
    path = _file(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_tenants(path)
    assert err.value.context["field"] == field
    assert field in err.value.message


def test_a_bad_file_stops_the_server_at_start_and_yaml_and_token_files_load(
    tmp_path: Path,
) -> None:
    bad = _file(tmp_path, A + Z + "weight = -1\n")
    with pytest.raises(ConfigError, match=r"tenants\.a\.weight"):
        Server(ServerConfig(target="echo", tenants=bad))
    with pytest.raises(ConfigError, match="one-tenant shorthand"):
        ServerConfig(target="echo", tenants="x.toml", auth_token="a" * 16)
    token = tmp_path / "token"
    token.write_text(TOKENS["beta"] + "\n")
    yaml = _file(
        tmp_path,
        f"tenants:\n  alpha:\n    token_sha256: [{_sha(TOKENS['alpha'])}]\n    weight: 2\n"
        f"  beta:\n    token_file: {token}\n    max_sessions: 3\n",
        "tenants.yaml",
    )
    entries = {e.name: e for e in load_tenants(yaml)}
    assert entries["alpha"].weight == 2.0
    assert entries["beta"].digests == [_sha(TOKENS["beta"])]
    assert entries["beta"].max_sessions == 3


def test_the_table_finds_a_tenant_by_the_hash_of_its_token() -> None:
    alpha = Tenant("alpha", 0)
    table = TenantTable([(alpha, [hashlib.sha256(b"secret-token-0123456789").digest()])])
    assert table.identify(b"secret-token-0123456789") is alpha
    assert table.identify(b"secret-token-012345678") is None


def test_a_remembered_header_names_its_tenant_only_while_its_table_is_current() -> None:
    """AccessPolicy.tenant_of remembers a header that named a tenant (its next
    connections: a dict lookup, no hash), never one that did not; a reloaded table
    (a new TenantTable in the book) starts with nothing remembered, so a token
    dropped from the file is refused at once; the memory is bounded."""
    alpha, beta = Tenant("alpha", 0), Tenant("beta", 1)
    a, b = "alpha-token-0123456789", "beta-token-0123456789"
    digests = {t: [hashlib.sha256(t.encode()).digest()] for t in (a, b)}
    book = TenantBook(TenantTable([(alpha, digests[a]), (beta, digests[b])]))
    access = AccessPolicy(tenants=book)
    first = book.table
    assert access.tenant_of(f"Bearer {a}") is alpha
    assert access.tenant_of(f"Bearer {a}") is alpha  # remembered
    assert first.seen == {f"Bearer {a}": alpha}
    assert access.tenant_of(f"Bearer {a}x") is None
    assert access.tenant_of(f"Basic {a}") is None
    assert set(first.seen) == {f"Bearer {a}"}  # a refused header is never kept
    padded = f"Bearer {a}" + " " * MAX_SEEN_CHARS
    assert access.tenant_of(padded) is alpha  # valid, stripped, but too long to keep
    assert set(first.seen) == {f"Bearer {a}"}
    book.table = TenantTable([(beta, digests[b])])  # reloaded without alpha
    assert access.tenant_of(f"Bearer {a}") is None
    assert access.check_auth(f"Bearer {a}") is not None  # the 401
    assert access.tenant_of(f"Bearer {b}") is beta
    for i in range(MAX_SEEN + 5):  # bounded: full, it starts over
        book.table.seen[f"Bearer filler-{i}"] = beta
        if len(book.table.seen) >= MAX_SEEN:
            break
    assert access.tenant_of(f" Bearer  {b}") is beta  # not remembered yet: hashed
    assert len(book.table.seen) <= MAX_SEEN
    assert book.table.seen == {f" Bearer  {b}": beta}


def test_an_upgrade_names_the_tenant_and_keeps_what_was_decided() -> None:
    """negotiate() sets the Upgrade's tenant and nothing else (the msgpack, resumable
    upgrade with its 101 headers), and a wrong token is still the 401."""
    alpha = Tenant("alpha", 0)
    token = "secret-token-0123456789"
    book = TenantBook(TenantTable([(alpha, [hashlib.sha256(token.encode()).digest()])]))
    terms = Terms(AccessPolicy(tenants=book), "node-a", 30.0, lambda: ("1f-0001", "tok"))
    headers = {"Upgrade": "websocket", "Sec-WebSocket-Protocol": MSGPACK_SUBPROTOCOL}
    target = "/ws?stadium_resume=1"

    def ask(bearer: str) -> Upgrade | Refusal | None:
        sent = CIMultiDict({**headers, "Authorization": f"Bearer {bearer}"})
        return negotiate(terms, target, sent, address="127.0.0.1:1")

    got = ask(token)
    assert isinstance(got, Upgrade)
    assert got.tenant is alpha
    sent = CIMultiDict({**headers, "Authorization": f"Bearer {token}"})
    assert got._replace(tenant=None) == _negotiate(terms, target, sent, address="127.0.0.1:1")
    assert got.encoding is Encoding.MSGPACK
    assert got.resumable
    assert got.session == ("1f-0001", "tok")
    refused = ask("secret-token-012345678")
    assert isinstance(refused, Refusal)
    assert refused.status == 401


def test_a_seat_without_a_wait_counts_in_the_first_bucket() -> None:
    """FairAdmission._seat: held, opened and the wait histogram's first bucket for a
    session admitted at once; a waited one in its own bucket, with its wait summed."""
    directory = TenantDirectory("unused.toml", SharedTenants(1))
    fair = FairAdmission(LocalSlots(4), 1.0, directory, 0, 0)
    fair._seat(3, 0.0)
    fair._seat(3, 0.02)  # 0.01 < 0.02 <= 0.05: the 4th bucket
    shared = directory.shared
    assert shared.total(3, HELD) == 2
    assert shared.opened(3) == 2
    hist = [shared.total(3, WAIT_HIST + i) for i in range(len(WAIT_BUCKETS) + 1)]
    assert hist == [1, 0, 0, 1] + [0] * (len(WAIT_BUCKETS) - 3)
    assert shared.total(3, WAIT_US) == 20_000


def test_a_fork_takes_no_free_slot_owed_to_a_needier_waiting_tenant() -> None:
    """FairAdmission.try_seat (a fork's slot, now or never): a slot left free for a needier
    tenant's waiters on another worker is not taken by a fork of a tenant holding more
    (forks in a loop would snipe every such slot); the needier tenant's own fork takes it."""
    directory = TenantDirectory("unused.toml", SharedTenants(2))
    directory.active = (0, 1, ANON)
    fair = FairAdmission(LocalSlots(4), 1.0, directory, 0, 0)
    alpha, beta = Tenant("alpha", 0), Tenant("beta", 1)
    shared = directory.shared
    shared.counts[shared.at(0, HELD)] = 2  # alpha holds 2 slots
    shared.counts[shared.at(1, WAITING) + 1] = 1  # beta (none held) waits on worker 1
    shared.any_waiting[1] = 1
    assert not fair.try_seat(alpha)
    assert fair.slots.active() == 0
    assert fair.try_seat(beta)
    shared.counts[shared.at(1, WAITING) + 1] = 0  # nobody waits: a fork takes a free slot
    shared.any_waiting[1] = 0
    assert fair.try_seat(alpha)
    assert fair.slots.active() == 2


# -- in one process ------------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_token_names_its_tenant_who_sees_only_its_own_usage(
    tmp_path: Path, transport: str
) -> None:
    path = _tenants(tmp_path, alpha={"weight": 1}, beta={"weight": 3, "max_sessions": 7})
    async with serve("benchmark", transport, tenants=path) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=10 * UNIT) as http:
            assert (await http.post("/reset", json={})).status_code == 401
            wrong = {"Authorization": "Bearer not-a-tenant-token-at-all"}
            assert (await http.post("/reset", json={}, headers=wrong)).status_code == 401
            assert (await http.get("/tenant/usage", headers=wrong)).status_code == 401
            for _ in range(3):
                r = await http.post(
                    "/step", json={"action": {"wait_seconds": 0}}, headers=_auth("alpha")
                )
                assert r.status_code == 200, r.text
            mine = (await http.get("/tenant/usage", headers=_auth("alpha"))).json()
            theirs = (await http.get("/tenant/usage", headers=_auth("beta"))).json()
        url = server.url.replace("http", "ws", 1) + "/ws"
        async with websockets.connect(url, additional_headers=_auth("beta")) as ws:
            await ws.send(json.dumps({"type": "reset", "data": {}}))
            assert json.loads(await ws.recv())["type"] == "observation"
            await ws.send(json.dumps({"type": "step", "data": {"wait_seconds": 0}}))
            assert json.loads(await ws.recv())["type"] == "observation"
        async with httpx.AsyncClient(base_url=server.url, timeout=10 * UNIT) as http:
            after = (await http.get("/tenant/usage", headers=_auth("beta"))).json()
            metrics = (await http.get("/metrics", headers=_auth("beta"))).text
    assert mine["tenant"] == "alpha"
    assert (mine["sessions_opened"], mine["steps"]) == (3, 3)
    assert theirs["tenant"] == "beta"
    assert (theirs["sessions_opened"], theirs["steps"], theirs["max_sessions"]) == (0, 0, 7)
    assert "alpha" not in json.dumps(theirs)
    assert after["sessions_opened"] == 1
    assert 'stadium_tenant_sessions_opened_total{tenant="beta"} 1.0' in metrics
    assert 'tenant="alpha"' not in metrics  # another tenant's series: not beta's to read


# -- across the boundary: what one tenant may not reach of another's ------------------


def _counts(server: Any) -> dict[str, list[int]]:
    d = server.runtime.doors.tenants
    return {t.name: [d.shared.total(t.row, f) for f in (HELD, CHARGED)] for t in d.each()}


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_metrics_show_a_tenant_its_own_series_and_an_operator_everyones(
    tmp_path: Path, transport: str
) -> None:
    path = _tenants(tmp_path, alpha={}, beta={}, gamma={"operator": True})
    async with serve("benchmark", transport, tenants=path) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=10 * UNIT) as http:
            step = {"action": {"wait_seconds": 0}}
            assert (await http.post("/step", json=step, headers=_auth("alpha"))).status_code == 200
            seen = {n: (await http.get("/metrics", headers=_auth(n))).text for n in TOKENS}
    opened = 'stadium_tenant_sessions_opened_total{tenant="%s"}'
    assert opened % "alpha" in seen["alpha"]
    assert "stadium_sessions" in seen["alpha"]  # the node's own series, for every tenant
    assert opened % "beta" in seen["beta"]
    assert 'tenant="alpha"' not in seen["beta"]
    assert 'tenant="gamma"' not in seen["beta"] + seen["alpha"]
    assert all(opened % n in seen["gamma"] for n in TOKENS)  # the operator: every tenant


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_every_get_of_a_tenant_spends_its_rate(tmp_path: Path, transport: str) -> None:
    """``GET /metadata``, ``/schema``, ``/dashboard`` ... spend the tenant's rate as every
    other request does (on picows they were answered beside it: a tenant over its rate
    went on unchecked); ``/health`` stays open."""
    path = _tenants(tmp_path, alpha={"rate_limit": 0.01}, beta={})  # 1 per 100 s
    async with serve("benchmark", transport, tenants=path) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=10 * UNIT) as http:
            assert (await http.get("/metadata", headers=_auth("alpha"))).status_code == 200
            answers = {  # what each answers (each was the env's state for a while on picows)
                "/metadata": '"name":"benchmark"',
                "/schema": '"action"',
                "/openapi.json": '"openapi"',
                "/dashboard?every=1": "tenants-panel",
            }
            for get, says in answers.items():
                r = await http.get(get, headers=_auth("alpha"))
                assert r.status_code == 429, (get, r.status_code)
                r = await http.get(get, headers=_auth("beta"))
                assert r.status_code == 200, (get, r.status_code)
                assert says in r.text.replace(" ", ""), (get, r.text[:200])
            assert (await http.get("/health")).status_code == 200


class _Tasked(BenchmarkEnv):
    """The benchmark env with a Task API method (OpenEnv's ``TaskProvider``)."""

    def num_tasks(self, split: str) -> int:
        return 3


async def test_every_env_a_tenant_makes_counts_in_its_quota_and_no_env_is_shared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stateless ``tools/list`` and a Task API call build an env without a slot (OpenEnv
    answers them at capacity): they built it outside the tenant's quota too (a tenant at
    its quota could build envs without bound); they now count in it while they run. The
    web interface's one shared env (``ENABLE_WEB_INTERFACE``) would be every tenant's:
    with tenants it is off (403)."""
    monkeypatch.setenv("ENABLE_WEB_INTERFACE", "true")
    path = _tenants(tmp_path, alpha={"max_sessions": 1}, beta={})
    async with serve(_Tasked, tenants=path) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=10 * UNIT) as http:

            async def rpc(method: str, **params: Any) -> str:
                body = {"jsonrpc": "2.0", "id": 1, "method": method, "params": params}
                return (await http.post("/mcp", json=body, headers=_auth("alpha"))).text

            name = (await http.get("/list_environments", headers=_auth("beta"))).json()[0]
            tasks = f"/{name}/num_tasks"
            sid = json.loads(await rpc("openenv/session/create"))["result"]["session_id"]
            assert "holds its quota of 1" in await rpc("tools/list")  # alpha's quota is held
            over = await http.post(tasks, json={"split": "a"}, headers=_auth("alpha"))
            assert over.status_code == 429, over.text
            ok = await http.post(tasks, json={"split": "a"}, headers=_auth("beta"))
            assert ok.json() == {"num_tasks": 3}
            assert '"closed":true' in await rpc("openenv/session/close", session_id=sid)
            assert '"tools"' in await rpc("tools/list")
            ok = await http.post(tasks, json={"split": "a"}, headers=_auth("alpha"))
            assert ok.json() == {"num_tasks": 3}
            shared = await http.post("/web/reset", json={}, headers=_auth("alpha"))
            assert shared.status_code == 403
            assert "shared between tenants" in shared.text
            assert (await http.get("/web/metadata", headers=_auth("alpha"))).status_code == 200
        assert _counts(server) == {"alpha": [0, 0], "beta": [0, 0]}


async def test_only_an_operator_tenant_reads_the_recording(tmp_path: Path) -> None:
    """``/web/episodes``' JSON API reads every tenant's recorded episodes: with tenants an
    ``operator`` tenant's token reads it, the others' are refused (403)."""
    path = _tenants(tmp_path, alpha={}, gamma={"operator": True})
    async with serve("benchmark", tenants=path, record=str(tmp_path / "rec")) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=10 * UNIT) as http:
            for route in ("/web/episodes", "/web/episodes/one"):
                refused = await http.post(route, json={}, headers=_auth("alpha"))
                assert refused.status_code == 403, refused.text
                assert "operator" in refused.text
            assert (await http.post("/web/episodes", json={}, headers=_auth("gamma"))).is_success


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_request_is_its_tenants_though_removed_while_its_body_comes(
    tmp_path: Path, transport: str
) -> None:
    """A request's tenant is the one its token named when its headers passed the check:
    under ASGI it was looked up again after the body, so a tenant removed by a reload
    meanwhile had its request run as nobody's (no quota, no rate, counted to no tenant)."""
    path = _tenants(tmp_path, alpha={}, beta={})
    async with serve("benchmark", transport, tenants=path) as server:
        directory = server.runtime.doors.tenants
        row = next(t.row for t in directory.each() if t.name == "alpha")
        host, port = server.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        body = b'{"action": {"wait_seconds": 0}}'
        writer.write(
            b"POST /step HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {TOKENS['alpha']}\r\n".encode()
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body[:5]
        )
        await writer.drain()
        await asyncio.sleep(0.2 * UNIT)  # the headers are read and checked
        _tenants(tmp_path, beta={})  # alpha removed ...
        assert directory.reload()  # ... and reloaded (SIGHUP) before the rest of the body
        writer.write(body[5:])
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), 10 * UNIT)
        writer.close()
        assert b" 200 " in status, status
        assert directory.shared.opened(row) == 1  # alpha's, as a session opened before
        assert directory.shared.opened(ANON) == 0


async def test_a_tenants_waiting_sessions_are_bounded_whatever_addresses_they_come_from(
    tmp_path: Path,
) -> None:
    """Without per-client limits a session's address is not counted, so a tenant without
    a quota could queue sessions without bound; a tenant now has at most
    ``--max-waiting-per-client`` waiting in a worker (refused at once past it, naming its
    tenant), and another tenant still queues."""
    path = _tenants(tmp_path, alpha={}, beta={})
    config = {"max_sessions": 1, "admission_timeout": 30 * UNIT, "max_waiting_per_client": 2}
    async with serve("benchmark", tenants=path, **config) as server:
        url = server.url.replace("http", "ws", 1) + "/ws"
        admission = server.runtime.admission
        async with contextlib.AsyncExitStack() as stack:

            async def connect(name: str) -> Any:
                return await stack.enter_async_context(
                    websockets.connect(url, additional_headers=_auth(name))
                )

            await connect("alpha")  # holds the one slot
            for n in (1, 2):
                await connect("alpha")
                await wait_until(lambda n=n: admission.waiting == n, 10 * UNIT, "alpha waits")
            third = await connect("alpha")
            refused = await asyncio.wait_for(third.recv(), 10 * UNIT)
            assert "tenant 'alpha' already has 2 sessions waiting" in refused
            async with httpx.AsyncClient(base_url=server.url, timeout=10 * UNIT) as http:
                step = {"action": {"wait_seconds": 0}}
                r = await http.post("/step", json=step, headers=_auth("alpha"))
            assert r.status_code == 503
            assert "tenant 'alpha' already has 2 sessions waiting" in r.text
            await connect("beta")
            await wait_until(lambda: admission.waiting == 3, 10 * UNIT, "beta waits too")
        zero = {"alpha": [0, 0], "beta": [0, 0]}
        await wait_until(lambda: _counts(server) == zero, 10 * UNIT, "all given back")
        assert admission.waiting == 0


async def test_another_tenants_mcp_and_resumable_sessions_are_unknown_to_a_tenant(
    tmp_path: Path,
) -> None:
    """An MCP session id or a resume token of alpha's does not let beta's token use,
    attach to, close or resume alpha's session (nor charge it to alpha): answered as an
    unknown session; alpha's own token still reaches it, and the counts go back to 0."""
    path = _tenants(tmp_path, alpha={}, beta={})
    async with serve("benchmark", tenants=path, resume_grace=30 * UNIT) as server:
        ws_url = server.url.replace("http", "ws", 1) + "/ws"
        async with httpx.AsyncClient(base_url=server.url, timeout=10 * UNIT) as http:

            async def rpc(name: str, method: str, **params: Any) -> dict[str, Any]:
                body = {"jsonrpc": "2.0", "id": 1, "method": method, "params": params}
                r = await http.post("/mcp", json=body, headers=_auth(name))
                return dict(r.json())

            sid = (await rpc("alpha", "openenv/session/create"))["result"]["session_id"]
            for method in ("tools/list", "openenv/session/close"):
                assert "Unknown session_id" in json.dumps(await rpc("beta", method, session_id=sid))
            async with websockets.connect(
                f"{ws_url}?session_id={sid}", additional_headers=_auth("beta")
            ) as ws:
                assert "is not open" in await ws.recv()  # as a session that is not there
            async with websockets.connect(ws_url, additional_headers=_auth("beta")) as ws:
                close = {"jsonrpc": "2.0", "id": 2, "method": "openenv/session/close",
                         "params": {"session_id": sid}}  # fmt: skip
                await ws.send(json.dumps({"type": "mcp", "data": close}))
                assert "Unknown session_id" in await ws.recv()
            assert "tools" in json.dumps(await rpc("alpha", "tools/list", session_id=sid))
            assert (await rpc("alpha", "openenv/session/close", session_id=sid))["result"]["closed"]

        async with websockets.connect(
            f"{ws_url}?stadium_resume=1", additional_headers=_auth("alpha")
        ) as ws:
            own, token = (ws.response.headers[h] for h in ("X-Stadium-Session", TOKEN_HEADER))
            await ws.send(json.dumps({"type": "reset", "data": {}}))
            await ws.recv()
        await _resumed_by_its_own_tenant_only(
            f"{ws_url}?stadium_resume={own}&stadium_received=1", token
        )
        zero = {"alpha": [0, 0], "beta": [0, 0]}
        await wait_until(lambda: _counts(server) == zero, 10 * UNIT, "all given back")


async def test_a_tenant_is_charged_its_episodes_cost_and_a_forks_steps_once(
    tmp_path: Path,
) -> None:
    """Each ended episode's cost is summed into its tenant's (usage and ``/metrics``); a
    fork's copy of the episode is one of them, accounted from the fork: its inherited steps
    are its parent's, counted once."""
    path = _tenants(tmp_path, alpha={}, beta={}, gamma={"operator": True})
    async with serve("benchmark", tenants=path) as server:
        wait = {"wait_seconds": 0}
        async with stadium.AsyncClient(server.url, token=TOKENS["alpha"]) as parent:
            await parent.reset()
            for _ in range(3):
                await parent.step(wait)
            await parent.reset()  # the first episode ends: 3 steps
            for _ in range(2):
                await parent.step(wait)
            child = await parent.fork()  # the running episode's 2 steps are the parent's
            try:
                await child.step(wait)
            finally:
                await child.close()
        # The child's close ends its copy (1 step since the fork); the parent's its second
        # episode (2 steps).
        async with httpx.AsyncClient(base_url=server.url, timeout=10 * UNIT) as http:

            async def usage(name: str) -> dict[str, Any]:
                r = await http.get("/tenant/usage", headers=_auth(name))
                return dict(r.json())

            await wait_until_async(
                lambda: usage("alpha"), lambda u: u["sessions_active"] == 0, "both closed"
            )
            mine, theirs = await usage("alpha"), await usage("beta")
            metrics = (await http.get("/metrics", headers=_auth("gamma"))).text  # an operator
    assert mine["steps"] == 3 + 2 + 1, mine
    episodes = mine["episodes"]
    assert (episodes["ended"], episodes["steps"]) == (3, 6), episodes
    assert episodes["bytes_in"] > 0
    assert episodes["bytes_out"] > 0
    assert episodes["wall_s"] > 0
    assert episodes["cpu_s"] >= 0
    assert theirs["episodes"]["ended"] == 0
    assert 'stadium_tenant_episodes_total{tenant="alpha"} 3.0' in metrics
    assert 'stadium_tenant_episode_steps_total{tenant="alpha"} 6.0' in metrics
    assert 'stadium_tenant_episode_cpu_seconds_total{tenant="beta"} 0.0' in metrics


async def wait_until_async(
    get: Callable[[], Awaitable[Any]], ok: Callable[[Any], bool], what: str
) -> None:
    """Poll ``get()`` until ``ok`` holds of it (a liveness bound of ``10 * UNIT``)."""
    deadline = time.monotonic() + 10 * UNIT
    while not ok(await get()):
        assert time.monotonic() < deadline, f"timed out waiting for: {what}"
        await asyncio.sleep(0.02)


async def _demand(url: str, name: str, width: int, stop: asyncio.Event, wait: float) -> None:
    """``width`` requests of tenant ``name`` at once, each a session holding a slot for
    ``wait`` seconds, until ``stop``."""
    async with httpx.AsyncClient(
        base_url=url, timeout=60 * UNIT, limits=httpx.Limits(max_connections=width)
    ) as http:

        async def one() -> None:
            while not stop.is_set():
                r = await http.post(
                    "/step", json={"action": {"wait_seconds": wait}}, headers=_auth(name)
                )
                assert r.status_code == 200, r.text

        await asyncio.gather(*(one() for _ in range(width)))


async def _opened(url: str, name: str) -> int:
    async with httpx.AsyncClient(base_url=url, timeout=10 * UNIT) as http:
        usage = (await http.get("/tenant/usage", headers=_auth(name))).json()
    return int(usage["sessions_opened"])


async def test_weights_one_to_three_share_the_slots_one_to_three(tmp_path: Path) -> None:
    """Both tenants keep three times the server's capacity waiting; over the measured
    window (after a warm-up) the slots went 1 : 3, within 10 %."""
    path = _tenants(tmp_path, alpha={"weight": 1}, beta={"weight": 3})
    async with serve("benchmark", tenants=path, max_sessions=4, admission_timeout=60) as server:
        stop = asyncio.Event()
        load = [
            asyncio.ensure_future(_demand(server.url, name, 12, stop, 0.01))
            for name in ("alpha", "beta")
        ]
        try:
            await wait_until(
                lambda: server.runtime.admission.waiting >= 16, 10 * UNIT, "both queued"
            )
            start = [await _opened(server.url, n) for n in ("alpha", "beta")]
            deadline = time.monotonic() + 60 * UNIT
            while True:
                now = [await _opened(server.url, n) for n in ("alpha", "beta")]
                if sum(now) - sum(start) >= 600 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
        finally:
            stop.set()
            await asyncio.gather(*load)
    got = [b - a for a, b in zip(start, now, strict=True)]
    share = got[0] / sum(got)
    assert sum(got) >= 600, got
    assert 0.25 * 0.9 <= share <= 0.25 * 1.1, got


async def test_a_tenant_alone_gets_all_of_the_capacity_and_quotas_are_hard(
    tmp_path: Path,
) -> None:
    path = _tenants(tmp_path, alpha={"weight": 1}, beta={"weight": 3, "max_sessions": 2})
    async with serve("benchmark", tenants=path, max_sessions=4, admission_timeout=60) as server:
        stop = asyncio.Event()
        load = asyncio.ensure_future(_demand(server.url, "alpha", 8, stop, 0.05))
        try:
            slots = server.runtime.admission.slots
            await wait_until(lambda: slots.active() == 4, 10 * UNIT, "every slot alpha's")
            async with httpx.AsyncClient(base_url=server.url, timeout=10 * UNIT) as http:
                usage = (await http.get("/tenant/usage", headers=_auth("alpha"))).json()
            assert usage["sessions_active"] + usage["sessions_waiting"] >= 4
        finally:
            stop.set()
            await load
        async with httpx.AsyncClient(base_url=server.url, timeout=30 * UNIT) as http:
            step = {"action": {"wait_seconds": 0.5 * UNIT}}
            codes = await asyncio.gather(
                *(http.post("/step", json=step, headers=_auth("beta")) for _ in range(5))
            )
            assert sorted(r.status_code for r in codes) == [200, 200, 429, 429, 429]
            assert "tenant 'beta' holds its quota of 2" in codes[-1].text or any(
                "tenant 'beta'" in r.text for r in codes
            )


# -- over processes ------------------------------------------------------------------


def _codes(port: int, name: str, n: int, wait: float) -> list[int]:
    async def go() -> list[int]:
        async def one() -> int:
            # A connection each: the kernel spreads them over the workers.
            async with httpx.AsyncClient(timeout=30 * UNIT) as http:
                r = await http.post(
                    f"http://127.0.0.1:{port}/step",
                    json={"action": {"wait_seconds": wait}},
                    headers=_auth(name),
                )
                return r.status_code

        return list(await asyncio.gather(*(one() for _ in range(n))))

    return asyncio.run(go())


@pytest.mark.slow
def test_a_quota_is_exact_over_two_workers(tmp_path: Path) -> None:
    path = _tenants(tmp_path, alpha={"max_sessions": 3})
    with _serve("benchmark", "--workers", "2", "--tenants", path) as s:
        codes = _codes(s.port, "alpha", 10, 1.0 * UNIT)
        assert sorted(codes) == [200] * 3 + [429] * 7, codes
        assert json.loads(_usage(s.port, "alpha"))["sessions_opened"] == 3


def _usage(port: int, name: str) -> str:
    r = httpx.get(f"http://127.0.0.1:{port}/tenant/usage", headers=_auth(name), timeout=10 * UNIT)
    return r.text if r.status_code == 200 else str(r.status_code)


@pytest.mark.slow
def test_sighup_reloads_the_tenants_in_place_keeping_sessions(tmp_path: Path) -> None:
    path = _tenants(tmp_path, alpha={})
    with _serve("benchmark", "--workers", "2", "--tenants", path) as s:
        workers = sorted(s.workers())

        async def go() -> None:
            url = f"ws://127.0.0.1:{s.port}/ws"
            async with websockets.connect(url, additional_headers=_auth("alpha")) as ws:
                await ws.send(json.dumps({"type": "reset", "data": {}}))
                assert json.loads(await ws.recv())["type"] == "observation"
                assert _usage(s.port, "beta") == "401"
                _tenants(tmp_path, alpha={}, beta={"weight": 2})
                os.kill(s.pid, signal.SIGHUP)
                # Both workers take the new table (each asked on a connection of its own).
                await wait_until(
                    lambda: all(_usage(s.port, "beta") != "401" for _ in range(8)),
                    10 * UNIT,
                    "beta accepted by every worker",
                )
                _file(tmp_path, "[tenants.alpha]\nweight = -1\n")  # bad: refused
                os.kill(s.pid, signal.SIGHUP)
                await wait_until(
                    lambda: "tenants not reloaded" in s.output(), 10 * UNIT, "refusal logged"
                )
                assert json.loads(_usage(s.port, "beta"))["weight"] == 2.0
                await ws.send(json.dumps({"type": "step", "data": {"wait_seconds": 0}}))
                assert json.loads(await ws.recv())["type"] == "observation"

        asyncio.run(go())
        assert sorted(s.workers()) == workers  # no worker recycled


# -- fairness over two worker processes ----------------------------------------------------


class _Lane:
    """A kept-alive HTTP/1.1 connection of one tenant to one worker, spoken by hand (cheap
    enough that one test process keeps dozens of them asking at once)."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, port: int
    ) -> None:
        self.reader, self.writer = reader, writer
        self.host = f"Host: 127.0.0.1:{port}\r\n".encode()

    @classmethod
    async def open(cls, port: int) -> _Lane:
        return cls(*await asyncio.open_connection("127.0.0.1", port), port)

    async def step(self, name: str, hold: float) -> int:
        """``POST /step`` holding a slot ``hold`` seconds: the pid of the worker that served."""
        body = json.dumps({"action": {"wait_seconds": hold}}).encode()
        self.writer.write(
            b"POST /step HTTP/1.1\r\nContent-Type: application/json\r\n"
            + self.host
            + f"Authorization: Bearer {TOKENS[name]}\r\n".encode()
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), 60 * UNIT)
        assert head.startswith(b"HTTP/1.1 200"), head
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        reply = json.loads(await self.reader.readexactly(length))
        return int(reply["observation"]["pid"])

    def close(self) -> None:
        self.writer.close()


async def _lanes(port: int, name: str, workers: list[int]) -> list[tuple[_Lane, int]]:
    """A connection of tenant ``name`` to each of ``workers``: connections are opened
    until the kernel hands one to that worker (each answers with its worker's pid)."""
    out: list[tuple[_Lane, int]] = []
    for worker in workers:
        for _ in range(64):
            lane = await _Lane.open(port)
            if await lane.step(name, 0) == worker:
                out.append((lane, worker))
                break
            lane.close()
        else:
            raise AssertionError(f"the kernel never gave worker {worker} a connection")
    return out


async def _pinned(
    lanes: list[tuple[_Lane, int]], name: str, hold: float, stop: asyncio.Event,
    served: dict[int, int],
) -> None:  # fmt: skip
    """One request at a time on each lane, each a session holding a slot ``hold`` seconds
    on average (0.5-1.5 x: sessions of one length would end in waves), until ``stop``;
    ``served`` counts replies per pid."""
    rng = random.Random(name)

    async def run(lane: _Lane, want: int) -> None:
        try:
            while not stop.is_set():
                pid = await lane.step(name, hold * rng.uniform(0.5, 1.5))
                assert pid == want  # the kept connection, the same worker
                served[pid] = served.get(pid, 0) + 1
        finally:
            lane.close()

    await asyncio.gather(*(run(lane, w) for lane, w in lanes))


async def _usage_of(http: httpx.AsyncClient, name: str) -> dict[str, Any]:
    r = await http.get("/tenant/usage", headers=_auth(name))
    return dict(r.json())


@pytest.mark.slow
def test_shares_hold_one_to_three_when_each_tenant_waits_on_its_own_worker(
    tmp_path: Path,
) -> None:
    """Two workers, 4 slots over the node; alpha (weight 1) keeps 12 sessions asking, all
    on worker A, beta (weight 3) 12, all on worker B (each connection's worker checked in
    every reply): every slot freed on one worker for the other's tenant crosses over
    (the deferral to the other worker's poll). Over the window the slots went 1 : 3
    within 10 %; then alpha alone, on both workers, holds every slot."""
    path = _tenants(tmp_path, alpha={"weight": 1}, beta={"weight": 3})
    with _serve(
        "benchmark", "--workers", "2", "--tenants", path, "--max-sessions", "4",
        "--admission-timeout", "120", "--drain-timeout", "0",
    ) as s:  # fmt: skip
        wait_until_sync(lambda: len(s.workers()) == 2, "two workers")
        a, b = sorted(s.workers())
        names = ("alpha", "beta")

        async def shares(http: httpx.AsyncClient) -> tuple[list[int], list[dict[int, int]]]:
            stop = asyncio.Event()
            served: list[dict[int, int]] = [{}, {}]
            lanes = [
                await _lanes(s.port, "alpha", [a] * 12),
                await _lanes(s.port, "beta", [b] * 12),
            ]
            load = [
                asyncio.ensure_future(_pinned(lanes[i], names[i], 0.02, stop, served[i]))
                for i in range(2)
            ]
            try:
                deadline = time.monotonic() + 30 * UNIT
                while True:  # both tenants queued (each asks 3 x the node's slots)
                    got = [await _usage_of(http, n) for n in names]
                    if all(u["sessions_waiting"] >= 4 for u in got):
                        break
                    assert time.monotonic() < deadline, f"never both queued: {got}"
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.5)  # warm-up
                start = [(await _usage_of(http, n))["sessions_opened"] for n in names]
                deadline = time.monotonic() + 60 * UNIT
                while True:
                    now = [(await _usage_of(http, n))["sessions_opened"] for n in names]
                    if sum(now) - sum(start) >= 600 or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.1)
            finally:
                stop.set()
                await asyncio.gather(*load)
            return [y - x for x, y in zip(start, now, strict=True)], served

        async def alone(http: httpx.AsyncClient) -> tuple[dict[str, Any], dict[int, int]]:
            stop = asyncio.Event()
            served: dict[int, int] = {}
            lanes = await _lanes(s.port, "alpha", [a] * 6 + [b] * 6)
            load = asyncio.ensure_future(_pinned(lanes, "alpha", 0.2, stop, served))
            try:
                deadline = time.monotonic() + 30 * UNIT
                while True:
                    usage = await _usage_of(http, "alpha")
                    if usage["sessions_active"] == 4 and usage["sessions_waiting"] > 0:
                        return usage, served
                    assert time.monotonic() < deadline, f"alpha never held every slot: {usage}"
                    await asyncio.sleep(0.02)
            finally:
                stop.set()
                await load

        async def both() -> tuple[Any, Any]:
            async with httpx.AsyncClient(base_url=s.url, timeout=10 * UNIT) as http:
                return await shares(http), await alone(http)

        (got, (by_alpha, by_beta)), (usage, served) = asyncio.run(both())
        assert set(by_alpha) == {a}, by_alpha  # alpha served on worker A only
        assert set(by_beta) == {b}, by_beta  # beta on worker B only
        assert sum(got) >= 600, got
        assert 0.25 * 0.9 <= got[0] / sum(got) <= 0.25 * 1.1, got
        assert set(served) == {a, b}, served  # alone: its sessions on both workers...
        assert usage["sessions_active"] == 4  # ...and every slot its


def wait_until_sync(ok: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10 * UNIT
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for: {what}"
        time.sleep(0.05)


async def test_another_tenants_durable_session_is_not_restored_for_a_tenant(
    tmp_path: Path,
) -> None:
    """A durable session moved to a second server sharing the store (its first worker
    gone, as far as the resume goes) is restored for its own tenant's token only: beta,
    holding alpha's id and token, is told it is unknown (and charged nothing)."""
    path = _tenants(tmp_path, alpha={}, beta={})
    key = tmp_path / "store.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    durable = {"durable": True, "session_store": str(tmp_path / "s"), "session_store_key": str(key)}
    async with (
        serve("benchmark", tenants=path, **durable) as a,
        serve("benchmark", tenants=path, **durable) as b,
    ):
        async with websockets.connect(
            a.url.replace("http", "ws", 1) + "/ws?stadium_resume=1",
            additional_headers=_auth("alpha"),
        ) as ws:
            own, token = (ws.response.headers[h] for h in ("X-Stadium-Session", TOKEN_HEADER))
            await ws.send(json.dumps({"type": "reset", "data": {}}))
            await ws.recv()
        resume = b.url.replace("http", "ws", 1) + f"/ws?stadium_resume={own}&stadium_received=1"
        await _resumed_by_its_own_tenant_only(resume, token, lambda: _counts(b)["alpha"] == [1, 1])
        zero = {"alpha": [0, 0], "beta": [0, 0]}
        await wait_until(lambda: _counts(b) == zero, 10 * UNIT, "all given back on b")


async def _resumed_by_its_own_tenant_only(
    resume: str, token: str, held: Callable[[], bool] = lambda: True
) -> None:
    """``resume`` (a resume URL of alpha's session) with alpha's session token: refused to
    beta's bearer token, taken by alpha's (``held`` true then), then closed (ended, not
    held for another resume)."""
    async with websockets.connect(
        resume, additional_headers={**_auth("beta"), TOKEN_HEADER: token}
    ) as ws:
        assert '"RESUME_FAILED"' in await ws.recv()
    async with websockets.connect(
        resume, additional_headers={**_auth("alpha"), TOKEN_HEADER: token}
    ) as ws:
        assert '"resumed"' in await ws.recv()
        assert held()
        await ws.send(json.dumps({"type": "close"}))
