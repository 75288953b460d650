"""Unknown action fields are a VALIDATION_ERROR naming the field, on WebSocket (JSON and
MessagePack) and HTTP, on both transports; an env may opt into extras."""

from __future__ import annotations

import asyncio
import copy
import json
import pickle
from typing import Any

import msgspec
import pytest
import websockets

import stadium
from stadium import Environment, State, StepResult
from stadium._env.codecs import TypeCodec, strict_twin
from stadium._env.spec import EnvSpec
from tests.conftest import TRANSPORTS, serve
from tests.test_server import http


class Guess(msgspec.Struct):
    number: int


class Hint(msgspec.Struct):
    number: int
    same_type: bool


class Game(Environment[Guess, Hint, State]):
    blocking = False

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Hint:
        return Hint(0, True)

    def step(self, action: Guess) -> StepResult[Hint]:
        # The env sees a Guess: isinstance and == hold for the decoded action.
        assert isinstance(action, Guess)
        return StepResult(Hint(action.number, action == Guess(action.number)))


class Lenient(Game):
    allow_extra_fields = True


async def _ws_step(url: str, data: bytes) -> dict[str, Any]:
    async with websockets.connect(url.replace("http", "ws") + "/ws") as ws:
        await ws.send('{"type":"reset"}')
        await ws.recv()
        await ws.send(b'{"type":"step","data":' + data + b"}")
        reply: dict[str, Any] = json.loads(await ws.recv())
        return reply


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_an_unknown_field_is_named_on_websocket_and_http(transport: str) -> None:
    async with serve(Game, transport=transport) as server:
        bad = await _ws_step(server.url, b'{"number": 3, "extra": 1}')
        assert bad["type"] == "error"
        assert (bad["data"]["code"], bad["data"]["field"]) == ("VALIDATION_ERROR", "$.extra")
        assert "extra" in bad["data"]["message"]
        ok = await _ws_step(server.url, b'{"number": 3}')
        assert ok["data"]["observation"] == {"number": 3, "same_type": True}
        await asyncio.to_thread(http, server.url, "/reset", b"{}")
        status, body = await asyncio.to_thread(
            http, server.url, "/step", b'{"action": {"number": 3, "extra": 1}}'
        )
        assert (status, body["code"], body["field"]) == (422, "VALIDATION_ERROR", "$.extra")
        status, body = await asyncio.to_thread(
            http, server.url, "/step", b'{"action": {"number": 3}}'
        )
        assert (status, body["observation"]["same_type"]) == (200, True)


async def test_an_unknown_field_is_refused_on_messagepack_sessions() -> None:
    async with serve(Game) as server:
        async with stadium.AsyncClient(server.url, msgpack=True) as env:
            await env.reset()
            with pytest.raises(stadium.ValidationError) as info:
                await env.step({"number": 3, "extra": 1})
            assert info.value.context.get("field") == "$.extra"
            assert (await env.step({"number": 4})).observation["number"] == 4


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_an_env_may_accept_extra_fields(transport: str) -> None:
    async with serve(Lenient, transport=transport) as server:
        ok = await _ws_step(server.url, b'{"number": 3, "extra": 1}')
        assert ok["data"]["observation"] == {"number": 3, "same_type": True}


class Frozen(msgspec.Struct, frozen=True, kw_only=True):
    n: int = 0


def test_the_strict_twin_behaves_as_the_declared_struct() -> None:
    twin = strict_twin(Frozen)
    assert strict_twin(Frozen) is twin  # once per class
    value = msgspec.json.decode(b'{"n": 1}', type=twin)
    assert isinstance(value, Frozen)
    assert value == Frozen(n=1)
    assert Frozen(n=1) == value
    assert value != Frozen(n=2)
    assert (value != Frozen(n=1)) is False
    assert hash(value) == hash(Frozen(n=1))
    assert {value, Frozen(n=1)} == {Frozen(n=1)}
    assert repr(value) == "Frozen(n=1)"
    assert type(pickle.loads(pickle.dumps(value))) is Frozen
    assert copy.copy(value) == value
    assert msgspec.json.encode(value) == b'{"n":1}'
    # Types that forbid already, and types that are no Struct, are left as they are.
    strict = msgspec.defstruct("Strict", [("n", int)], forbid_unknown_fields=True)
    assert strict_twin(strict) is strict
    assert strict_twin(dict[str, int]) == dict[str, int]


def test_schema_and_name_are_the_declared_type() -> None:
    spec = EnvSpec.of(Game)
    assert spec.action.name == "Guess"
    assert spec.action.declared is Guess
    assert spec.schemas()["action"] == TypeCodec.of(Guess).schema()
    assert EnvSpec.of(Lenient).action.tp is Guess


def test_openenv_actions_forbid_extras_by_their_own_config() -> None:
    pytest.importorskip("openenv")
    from stadium._server.loader import load_target

    spec = EnvSpec.of(load_target("tests/openenv_compat/openenv_echo_app.py:OpenEnvEcho"))
    with pytest.raises(stadium.ValidationError) as info:
        spec.action.convert({"message": "hi", "extra": 1}, "action")
    assert info.value.context.get("field") == "$.extra"
