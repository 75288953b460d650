"""Access control: bearer token, Origin and Host checks, on both transports; start-up warnings.

Every refusal must come before an environment is built and before a session
slot is taken; ``/health`` stays open.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import socket
from pathlib import Path
from typing import Any

import msgspec
import pytest

import stadium
from stadium import AsyncClient, ConnectError
from stadium._core.access import (
    UNAUTHORIZED,
    AccessPolicy,
    exposure_warnings,
    header_values,
    is_loopback_host,
)
from stadium._server.config import ServerConfig
from stadium._server.server import _announce
from stadium.envs.echo import EchoEnv
from tests.conftest import TRANSPORTS, UNIT, serve

TOKEN = "s3cret-token-0123456789"


class Counted(EchoEnv):
    """Echo that counts its constructions."""

    made = 0

    def __init__(self) -> None:
        super().__init__()
        type(self).made += 1


# -- the pure decisions ----------------------------------------------------------------


def test_check_auth() -> None:
    policy = AccessPolicy(token=TOKEN)
    assert policy.check_auth(f"Bearer {TOKEN}") is None
    assert policy.check_auth(f"bearer  {TOKEN} ") is None  # scheme is case-insensitive
    for bad in (None, "", "Bearer", f"Basic {TOKEN}", f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}"):
        refusal = policy.check_auth(bad)
        assert refusal is UNAUTHORIZED
        assert refusal.status == 401
        assert ("WWW-Authenticate", "Bearer") in refusal.headers
        body = msgspec.json.decode(refusal.body)
        assert body["code"] == "UNAUTHORIZED"
        assert "token=" in body["message"]
        assert "headers=" in body["message"]
    assert AccessPolicy().check_auth(None) is None  # no token configured: open


def test_check_origin() -> None:
    policy = AccessPolicy(allowed_origins=("https://app.example",))
    assert policy.check_origin(None, "127.0.0.1:8000") is None  # not a browser
    assert policy.check_origin("http://127.0.0.1:8000", "127.0.0.1:8000") is None
    assert policy.check_origin("http://LOCALHOST:8000", "localhost:8000") is None
    assert policy.check_origin("https://host.example", "host.example:443") is None  # default port
    assert policy.check_origin("http://[::1]:8000", "[::1]:8000") is None
    assert policy.check_origin("https://app.example", "127.0.0.1:8000") is None  # listed
    for origin, host in (
        ("https://evil.example", "127.0.0.1:8000"),
        ("http://127.0.0.1:9999", "127.0.0.1:8000"),  # another port is another origin
        ("https://127.0.0.1:8000/x", "127.0.0.1:8000"),
        ("null", "127.0.0.1:8000"),  # sandboxed frames, file:// pages
        ("http://127.0.0.1:8000", None),
    ):
        refusal = policy.check_origin(origin, host)
        assert refusal is not None, origin
        assert refusal.status == 403
        assert "--allow-origin" in refusal.message
    assert AccessPolicy(allowed_origins=("*",)).check_origin("https://evil.example", "x") is None


def test_check_host_stops_dns_rebinding_on_loopback() -> None:
    policy = AccessPolicy(allowed_origins=("https://proxy.example:8443",))
    for host in ("127.0.0.1:8000", "localhost:8000", "localhost", "[::1]:8000", "10.1.2.3", None):
        assert policy.check_host(host, "127.0.0.1") is None, host
    assert policy.check_host("proxy.example", "127.0.0.1") is None  # an allowed origin's host
    for local in ("127.0.0.1", "::1", "::ffff:127.0.0.1"):
        refusal = policy.check_host("evil.example:8000", local)
        assert refusal is not None
        assert refusal.status == 403
        assert refusal.code == "FORBIDDEN_HOST"
        assert "--allow-origin" in refusal.message
    # Not loopback (or unknown): a network-facing server relies on its token.
    assert policy.check_host("evil.example", "10.0.0.5") is None
    assert policy.check_host("evil.example", None) is None
    assert AccessPolicy(allowed_origins=("*",)).check_host("evil.example", "127.0.0.1") is None


def test_check_order_and_open_health() -> None:
    policy = AccessPolicy(token=TOKEN)
    args: dict[str, Any] = {"authorization": None, "origin": None, "host": "x.example"}
    assert policy.check("/health", local_addr="127.0.0.1", **args) is None
    assert policy.check("/health/?probe=1", local_addr="127.0.0.1", **args) is None
    refusal = policy.check("/metadata", local_addr="127.0.0.1", **args)
    assert refusal is not None
    assert refusal.status == 403
    refusal = policy.check("/metadata", local_addr="10.0.0.1", **args)
    assert refusal is UNAUTHORIZED


def test_header_values_and_loopback_names() -> None:
    raw = [(b"Host", b"a:1"), (b"origin", b"http://a:1"), (b"AUTHORIZATION", b"Bearer x")]
    assert header_values([*raw, (b"host", b"b")]) == ("Bearer x", "http://a:1", "a:1")
    assert header_values([]) == (None, None, None)
    for host in ("127.0.0.1", "127.8.9.1", "::1", "[::1]", "localhost", "::ffff:127.0.0.1"):
        assert is_loopback_host(host), host
    for host in ("0.0.0.0", "::", "", "10.0.0.1", "example.com", "localhost.example"):
        assert not is_loopback_host(host), host


def test_exposure_warnings() -> None:
    assert exposure_warnings("127.0.0.1", token=False, tls=False) == []
    assert exposure_warnings("localhost", token=False, tls=False) == []
    (open_,) = exposure_warnings("0.0.0.0", token=False, tls=False)
    assert "all interfaces" in open_
    assert "without authentication" in open_
    assert "--auth-token" in open_
    (clear,) = exposure_warnings("10.0.0.1", token=True, tls=False)
    assert "clear text" in clear
    assert "--tls-cert" in clear
    assert exposure_warnings("0.0.0.0", token=True, tls=True) == []


class _FakeSock:
    def __init__(self, host: str) -> None:
        self.host = host

    def getsockname(self) -> tuple[str, int]:
        return (self.host, 8123)


def test_announce_warns_when_exposed_and_names_the_host_env_var(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    monkeypatch.setenv("HOST", "0.0.0.0")
    with caplog.at_level(logging.WARNING, logger="stadium.server"):
        _announce(ServerConfig(target="echo", host="0.0.0.0"), _FakeSock("0.0.0.0"), "echo")  # type: ignore[arg-type]
    line = capsys.readouterr().out
    assert "bound to 0.0.0.0 (from the HOST environment variable)" in line
    assert "no authentication" in line
    (record,) = caplog.records
    assert "without authentication" in record.getMessage()
    assert "HOST environment variable" in record.getMessage()

    caplog.clear()
    monkeypatch.delenv("HOST")
    config = ServerConfig(target="echo", host="127.0.0.1", auth_token=TOKEN)
    with caplog.at_level(logging.WARNING, logger="stadium.server"):
        _announce(config, _FakeSock("127.0.0.1"), "echo")  # type: ignore[arg-type]
    line = capsys.readouterr().out
    assert "http://127.0.0.1:8123" in line
    assert "bearer token required" in line
    assert "HOST" not in line
    assert caplog.records == []
    assert TOKEN not in line


def test_announce_with_tenants_says_a_token_is_required_and_does_not_warn_of_none(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """--tenants authenticates every request (a tenant's token): the banner said "no
    authentication" and a non-loopback bind warned of a server open to anyone."""
    tenants = tmp_path / "tenants.toml"
    config = ServerConfig(target="echo", host="10.0.0.1", tenants=str(tenants))
    with caplog.at_level(logging.WARNING, logger="stadium.server"):
        _announce(config, _FakeSock("10.0.0.1"), "echo")  # type: ignore[arg-type]
    line = capsys.readouterr().out
    assert "no authentication" not in line
    assert f"bearer token required (tenants from {tenants})" in line
    (record,) = caplog.records  # the token travels in clear text: that warning stays
    assert "without TLS" in record.getMessage()
    assert "without authentication" not in record.getMessage()


# -- over the wire, both transports ----------------------------------------------------


async def _request(
    port: int,
    method: str,
    path: str,
    headers: dict[str, str] | None = None,
    body: bytes = b"",
    *,
    upgrade: bool = False,
) -> tuple[int, dict[str, str], bytes]:
    """One raw HTTP request (or WebSocket upgrade): status, lower-cased headers, body."""
    head = {"Host": f"127.0.0.1:{port}", "Connection": "close"}
    if upgrade:
        key = base64.b64encode(os.urandom(16)).decode()
        head |= {
            "Connection": "Upgrade",
            "Upgrade": "websocket",
            "Sec-WebSocket-Key": key,
            "Sec-WebSocket-Version": "13",
        }
    if body:
        head["Content-Length"] = str(len(body))
    head |= headers or {}
    lines = "".join(f"{k}: {v}\r\n" for k, v in head.items() if v is not None)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"{method} {path} HTTP/1.1\r\n{lines}\r\n".encode() + body)
        raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5 * UNIT)
        status_line, *header_lines = raw.decode("latin-1").split("\r\n")
        status = int(status_line.split()[1])
        got = {}
        for line in header_lines:
            if ":" in line:
                k, v = line.split(":", 1)
                got[k.strip().lower()] = v.strip()
        data = b""
        if status != 101 and method != "HEAD" and "content-length" in got:
            data = await asyncio.wait_for(reader.readexactly(int(got["content-length"])), 5 * UNIT)
        return status, got, data
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


def _port(server: Any) -> int:
    return int(server.url.rsplit(":", 1)[1])


def _nothing_taken(server: Any) -> None:
    assert Counted.made == 0, "an environment was built for a refused request"
    assert server.runtime.admission.slots.active() == 0
    assert not server.runtime.sessions


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_no_or_wrong_token_is_refused_before_any_env_or_slot(transport: str) -> None:
    Counted.made = 0
    async with serve(Counted, transport, auth_token=TOKEN) as server:
        port = _port(server)
        for auth in (None, "Bearer wrong-token-0123456789", f"Basic {TOKEN}"):
            headers = {"Authorization": auth} if auth else {}
            status, got, body = await _request(port, "GET", "/ws", headers, upgrade=True)
            assert status == 401, (auth, got, body)
            assert got.get("www-authenticate") == "Bearer"
            assert msgspec.json.decode(body)["code"] == "UNAUTHORIZED"
            reset = await _request(port, "POST", "/reset", headers, b"{}")
            assert reset[0] == 401
            assert reset[1].get("www-authenticate") == "Bearer"
            assert (await _request(port, "GET", "/metadata", headers))[0] == 401
            assert (await _request(port, "GET", "/state", headers))[0] == 401
            assert (await _request(port, "GET", "/schema", headers))[0] == 401
        _nothing_taken(server)
        # /health stays open for probes.
        status, _, body = await _request(port, "GET", "/health")
        assert status == 200
        assert b"healthy" in body


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_the_right_token_opens_sessions_and_endpoints(transport: str) -> None:
    async with serve("echo", transport, auth_token=TOKEN) as server:
        port = _port(server)
        auth = {"Authorization": f"Bearer {TOKEN}"}
        assert (await _request(port, "GET", "/ws", auth, upgrade=True))[0] == 101
        status, _, body = await _request(port, "POST", "/reset", auth, b"{}")
        assert status == 200, body
        assert (await _request(port, "GET", "/metadata", auth))[0] == 200
        async with AsyncClient(server.url, token=TOKEN) as env:
            await env.reset()
            assert (await env.step({"message": "hi"})).observation["echoed_message"] == "hi"


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_client_without_token_gets_a_connect_error_saying_what_to_do(
    transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("STADIUM_AUTH_TOKEN", raising=False)
    async with serve("echo", transport, auth_token=TOKEN) as server:
        client: AsyncClient[Any] = AsyncClient(server.url, max_retries=8)
        with pytest.raises(ConnectError, match=r"token=.*STADIUM_AUTH_TOKEN") as info:
            await client.connect()
        assert info.value.context["status"] == 401
        assert not client.connected
        monkeypatch.setenv("STADIUM_AUTH_TOKEN", TOKEN)  # the default token
        async with AsyncClient(server.url) as env:
            await env.reset()


def test_sync_client_and_pool_take_a_token() -> None:
    async def pool_run(url: str) -> None:
        async with stadium.SessionPool(url, 2, token=TOKEN) as pool:
            assert len(await pool.reset()) == 2

    async def main() -> None:
        async with serve("echo", auth_token=TOKEN) as server:
            await pool_run(server.url)
            client: stadium.Client[Any] = stadium.Client(server.url, token=TOKEN)
            await asyncio.to_thread(client.connect)
            try:
                await asyncio.to_thread(client.reset)
            finally:
                await asyncio.to_thread(client.close)

    asyncio.run(main())


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_origin_check(transport: str) -> None:
    Counted.made = 0
    async with serve(Counted, transport) as server:
        port = _port(server)
        evil = {"Origin": "https://evil.example"}
        status, _, body = await _request(port, "GET", "/ws", evil, upgrade=True)
        assert status == 403
        assert msgspec.json.decode(body)["code"] == "FORBIDDEN_ORIGIN"
        assert b"--allow-origin https://evil.example" in body
        assert (await _request(port, "POST", "/reset", evil, b"{}"))[0] == 403
        assert (await _request(port, "GET", "/state", evil))[0] == 403
        _nothing_taken(server)
        same = {"Origin": f"http://127.0.0.1:{port}"}
        assert (await _request(port, "GET", "/ws", same, upgrade=True))[0] == 101
        assert (await _request(port, "GET", "/ws", {}, upgrade=True))[0] == 101  # no Origin
    async with serve("echo", transport, allowed_origins=("https://app.example",)) as server:
        port = _port(server)
        listed = {"Origin": "https://app.example"}
        assert (await _request(port, "GET", "/ws", listed, upgrade=True))[0] == 101
        assert (await _request(port, "POST", "/reset", listed, b"{}"))[0] == 200
        other = {"Origin": "https://other.example"}
        assert (await _request(port, "GET", "/ws", other, upgrade=True))[0] == 403
    async with serve("echo", transport, allowed_origins=("*",)) as server:
        port = _port(server)
        assert (await _request(port, "GET", "/ws", evil, upgrade=True))[0] == 101


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_dns_rebinding_host_is_refused_on_loopback(transport: str) -> None:
    Counted.made = 0
    async with serve(Counted, transport) as server:
        port = _port(server)
        # A rebinding page: Origin and Host are both the attacker's name (same origin).
        rebound = {"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}"}
        status, _, body = await _request(port, "GET", "/ws", rebound, upgrade=True)
        assert status == 403
        assert msgspec.json.decode(body)["code"] == "FORBIDDEN_HOST"
        assert (await _request(port, "POST", "/reset", rebound, b"{}"))[0] == 403
        no_origin = {"Host": f"evil.example:{port}"}  # a same-origin GET carries no Origin
        assert (await _request(port, "GET", "/state", no_origin))[0] == 403
        assert (await _request(port, "GET", "/metadata", no_origin))[0] == 403
        _nothing_taken(server)
        assert (await _request(port, "GET", "/health", no_origin))[0] == 200
        local = {"Host": f"localhost:{port}", "Origin": f"http://localhost:{port}"}
        assert (await _request(port, "GET", "/ws", local, upgrade=True))[0] == 101
    allowed = ("http://evil.example:1",)  # behind a proxy passing that Host
    async with serve("echo", transport, allowed_origins=allowed) as server:
        port = _port(server)
        status, _, _ = await _request(port, "GET", "/metadata", {"Host": "evil.example"})
        assert status == 200


async def test_head_and_http_1_0_are_checked_too() -> None:
    async with serve("echo", auth_token=TOKEN) as server:
        port = _port(server)
        status, got, body = await _request(port, "HEAD", "/metadata")
        assert status == 401
        assert body == b""
        assert got.get("www-authenticate") == "Bearer"
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /metadata HTTP/1.0\r\n\r\n")
        data = await asyncio.wait_for(reader.read(), 5 * UNIT)
        writer.close()
        assert data.startswith(b"HTTP/1.1 401"), data


async def test_openenv_client_passes_the_token_through_its_headers_option() -> None:
    generic = pytest.importorskip("openenv.core.generic_client")
    async with serve("echo", auth_token=TOKEN) as server:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with generic.GenericEnvClient(base_url=server.url, headers=headers) as env:
            first = await env.reset()
            assert first.observation["echoed_message"] == "Echo environment ready!"
            assert (await env.step({"message": "hey"})).observation["echoed_message"] == "hey"
        with pytest.raises(ConnectionError, match="401"):
            async with generic.GenericEnvClient(base_url=server.url) as env:
                await env.reset()


def test_bind_warning_from_the_real_command(tmp_path: Any) -> None:
    """``stadium serve --host 0.0.0.0`` without a token says so at start (then exits on TERM)."""
    import signal
    import subprocess
    import sys
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "stadium", "serve", "echo", "--host", "0.0.0.0", "--port",
         str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "HOST": "0.0.0.0"},
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert "from the HOST environment variable" in line, line
        deadline = time.monotonic() + 30 * UNIT
        while time.monotonic() < deadline:  # serving: its signal handlers are in place
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                    break
            except OSError:
                time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30 * UNIT)
    assert "without authentication" in err.decode(), err


def test_the_local_address_is_read_only_when_the_host_is_a_name() -> None:
    # Reading a socket's address costs a system call and objects on every connection:
    # a Host that is an IP literal or localhost never needs it.
    policy = AccessPolicy()
    calls: list[int] = []

    def local() -> str:
        calls.append(1)
        return "127.0.0.1"

    assert policy.check_host("127.0.0.1:8000", local) is None
    assert policy.check_host("localhost:8000", local) is None
    assert calls == []
    refusal = policy.check_host("evil.example:8000", local)
    assert refusal is not None
    assert refusal.code == "FORBIDDEN_HOST"
    assert calls == [1]
