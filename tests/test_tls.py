"""TLS: ``stadium serve --tls-cert/--tls-key`` speaks wss:// and https:// (self-signed cert).

The connection's first bytes are read by ``_FrontProtocol`` and handed to picows
(a BufferedProtocol) or h11 over the SSL transport: checked on asyncio's and on
uvloop's SSL transports.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from stadium import AsyncClient, ConfigError, ConnectError, Server, ServerConfig
from stadium._util.process import new_event_loop
from tests.conftest import UNIT, serve

#: Process-level: servers, tools or interpreters in subprocesses (`make check` skips it).
pytestmark = pytest.mark.slow

TOKEN = "s3cret-token-0123456789"


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A self-signed certificate for localhost and 127.0.0.1: (cert path, key path)."""
    x509 = pytest.importorskip("cryptography.x509", reason="needs the cryptography package")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    directory = tmp_path_factory.mktemp("tls")
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(cert_path), str(key_path)


def _trusting(cert_path: str) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=cert_path)


async def _https(port: int, ctx: ssl.SSLContext, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=ctx, server_hostname="localhost"
    )
    writer.write(request)
    data = await asyncio.wait_for(reader.read(), 5 * UNIT)
    writer.close()
    return data


async def _round_trip(cert: tuple[str, str], **config: Any) -> None:
    cert_path, key_path = cert
    ctx = _trusting(cert_path)
    async with serve("echo", tls_cert=cert_path, tls_key=key_path, **config) as server:
        assert server.url.startswith("https://127.0.0.1:")
        port = server.port
        token = config.get("auth_token")
        async with AsyncClient(server.url, ssl=ctx, token=token) as env:  # wss://
            assert env.url.startswith("wss://")
            await env.reset()
            assert (await env.step({"message": "tls"})).observation["echoed_message"] == "tls"
            pipelined = await asyncio.gather(*(env.step({"message": "x" * i}) for i in range(50)))
            assert [r.observation["message_length"] for r in pipelined] == list(range(50))
        auth = f"Authorization: Bearer {token}\r\n" if token else ""
        reply = await _https(
            port,
            ctx,
            f"POST /reset HTTP/1.1\r\nHost: localhost\r\n{auth}Content-Length: 2\r\n"
            "Connection: close\r\n\r\n{}".encode(),
        )
        assert reply.startswith(b"HTTP/1.1 200"), reply
        body = msgspec.json.decode(reply.split(b"\r\n\r\n", 1)[1])
        assert body["observation"]["echoed_message"] == "Echo environment ready!"
        reply = await _https(
            port, ctx, f"GET /metadata HTTP/1.1\r\nHost: localhost\r\n{auth}\r\n".encode()
        )
        assert reply.startswith(b"HTTP/1.1 200"), reply


async def test_wss_and_https_round_trip(cert: tuple[str, str]) -> None:
    await _round_trip(cert)


async def test_tls_with_a_token(cert: tuple[str, str]) -> None:
    await _round_trip(cert, auth_token=TOKEN)


def test_tls_on_uvloop(cert: tuple[str, str]) -> None:
    """``stadium serve`` runs on uvloop, whose SSL transport is another implementation."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(_round_trip(cert))


async def test_a_client_that_does_not_trust_the_cert_is_refused(cert: tuple[str, str]) -> None:
    cert_path, key_path = cert
    async with serve("echo", tls_cert=cert_path, tls_key=key_path) as server:
        with pytest.raises(ConnectError, match="cafile"):  # at once: not retried
            async with AsyncClient(server.url, max_retries=100):
                pass
        # plain ws:// to a TLS port does not open a session either
        plain = server.url.replace("https://", "http://")
        with pytest.raises(ConnectError, match="TLS server"):
            async with AsyncClient(plain, max_retries=0, connect_timeout=2 * UNIT):
                pass


def test_unusable_tls_files_fail_at_start(tmp_path: Path, cert: tuple[str, str]) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match="--tls-cert/--tls-key"):
        Server(ServerConfig(target="echo", tls_cert=str(junk), tls_key=cert[1]))
    with pytest.raises(ConfigError, match="go together"):
        ServerConfig(target="echo", tls_cert=cert[0])


def test_stadium_serve_with_tls_token_file_and_workers(
    cert: tuple[str, str], tmp_path: Path
) -> None:
    """The command line: --tls-cert/--tls-key, --auth-token-file, forked workers."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time
    import urllib.error
    import urllib.request

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "stadium", "serve", "echo", "--port", str(port), "--workers", "2",
         "--tls-cert", cert[0], "--tls-key", cert[1], "--auth-token-file", str(token_file)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={k: v for k, v in os.environ.items() if k not in ("HOST", "STADIUM_AUTH_TOKEN")},
    )  # fmt: skip
    ctx = _trusting(cert[0])
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert f"https://127.0.0.1:{port}" in line, line
        assert f"wss://127.0.0.1:{port}/ws" in line
        assert "bearer token required" in line
        assert TOKEN not in line
        deadline = time.monotonic() + 30 * UNIT
        while True:
            try:
                with urllib.request.urlopen(
                    f"https://localhost:{port}/health", timeout=1, context=ctx
                ):
                    break
            except OSError:
                assert time.monotonic() < deadline, "server did not come up"
                assert proc.poll() is None, "server exited"
                time.sleep(0.05)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"https://localhost:{port}/metadata", timeout=5, context=ctx)
        assert refused.value.code == 401
        refused.value.close()  # the error holds the connection open

        async def session() -> None:
            async with AsyncClient(f"https://localhost:{port}", ssl=ctx, token=TOKEN) as env:
                await env.reset()
                assert (await env.step({"message": "ok"})).observation["echoed_message"] == "ok"

        asyncio.run(session())
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60 * UNIT)
    assert proc.returncode == 0, err
    assert TOKEN.encode() not in err


async def test_the_health_probe_speaks_https_and_checks_the_certificate(
    cert: tuple[str, str],
) -> None:
    from stadium._util.health import healthy, probe, probe_async

    cert_path, key_path = cert
    ctx = _trusting(cert_path)
    async with serve("echo", tls_cert=cert_path, tls_key=key_path, max_sessions=3) as server:
        assert (await probe_async(server.url, ssl=ctx)).data["max_sessions"] == 3
        health = await asyncio.to_thread(probe, server.url, 5 * UNIT, ssl=ctx)
        assert (health.status, health.data["max_sessions"]) == (200, 3)
        # The system's roots do not trust a self-signed certificate: no answer read.
        with pytest.raises(ssl.SSLCertVerificationError):
            await probe_async(server.url)
        assert not await asyncio.to_thread(healthy, server.url, 5 * UNIT)
