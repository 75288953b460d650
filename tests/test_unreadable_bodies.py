"""A request body msgspec cannot read — a string that is not UTF-8, values nested deeper
than it allows — is the client's error on every HTTP door (400/422 saying what was
wrong), never a 500: msgspec raises ``UnicodeDecodeError`` and ``RecursionError`` there,
not its ``DecodeError``, and each door caught only the latter."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Any

import pytest
import websockets

from tests.conftest import UNIT, serve

#: A JSON object whose string is not UTF-8, and an array nested 100,000 deep.
BODIES = {
    "not UTF-8": (b'{"seed": 1, "options": {"k": "\xff\xfe"}}', "not valid UTF-8"),
    "nested too deep": (b"[" * 100_000 + b"]" * 100_000, "nested more deeply"),
}


def _post(url: str, body: bytes) -> tuple[int, Any]:
    req = urllib.request.Request(
        url, data=body, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=10 * UNIT) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.asyncio
@pytest.mark.parametrize("what", sorted(BODIES))
@pytest.mark.parametrize(
    ("path", "status", "code"),
    [
        ("/reset", 400, "INVALID_JSON"),
        ("/step", 400, "INVALID_JSON"),
        ("/web/reset", 422, "VALIDATION_ERROR"),
        ("/web/step", 422, "VALIDATION_ERROR"),
    ],
)
async def test_an_unreadable_body_is_the_clients_error(
    what: str, path: str, status: int, code: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ENABLE_WEB_INTERFACE", "true")  # the /web/ JSON endpoints
    body, says = BODIES[what]
    async with serve("echo") as server:
        got, reply = await asyncio.to_thread(_post, server.url + path, body)
        assert got == status, reply
        text = json.dumps(reply)
        assert code in text, reply
        assert says in text, reply
        # and the server serves on
        ok, _ = await asyncio.to_thread(_post, server.url + "/reset", b"{}")
        assert ok == 200


@pytest.mark.asyncio
@pytest.mark.parametrize("what", sorted(BODIES))
async def test_an_unreadable_mcp_frame_is_a_parse_error(what: str) -> None:
    body, says = BODIES[what]
    async with serve("echo") as server:
        url = server.url.replace("http", "ws") + "/mcp"
        async with websockets.connect(url, max_size=None) as ws:
            await ws.send(body.decode("latin-1") if what == "nested too deep" else body)
            reply = json.loads(await asyncio.wait_for(ws.recv(), 10 * UNIT))
            assert reply["error"]["code"] == -32700, reply
            assert says in reply["error"]["message"], reply
            await ws.send(json.dumps({"jsonrpc": "2.0", "method": "tools/list", "id": 2}))
            listed = json.loads(await asyncio.wait_for(ws.recv(), 10 * UNIT))
            assert listed.get("id") == 2, listed
