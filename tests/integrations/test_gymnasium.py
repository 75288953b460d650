"""Gymnasium envs served by Stadium: spaces, codecs, validation, and the wire."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from typing import Any

import msgspec
import pytest

import stadium
from stadium._env.spec import EnvSpec
from stadium._server.loader import load_target
from tests.conftest import UNIT, serve

gymnasium = pytest.importorskip("gymnasium")
np = pytest.importorskip("numpy")

from gymnasium import spaces  # noqa: E402

from stadium.integrations.gymnasium import (  # noqa: E402
    decode_arrays,
    from_wire,
    space_from_dict,
    space_schema,
    space_to_dict,
)

FRAMES = "gymnasium:tests.integrations.frames_env:Frames-v0"

SPACES = [
    spaces.Box(-1.0, 1.0, (3,), np.float32),
    spaces.Box(np.array([-np.inf, 0.0]), np.array([np.inf, 5.0]), dtype=np.float64),
    spaces.Box(0, 255, (4, 5, 3), np.uint8),
    spaces.Discrete(3),
    spaces.Discrete(4, start=-2),
    spaces.MultiDiscrete([2, 3, 4]),
    spaces.MultiBinary(5),
    spaces.MultiBinary([2, 3]),
    spaces.Dict({"pos": spaces.Box(-1, 1, (2,)), "mode": spaces.Discrete(2)}),
    spaces.Tuple((spaces.Discrete(2), spaces.Box(0, 1, (1,)))),
    spaces.Text(8, min_length=1),
]


def _post(req: urllib.request.Request) -> Any:
    with urllib.request.urlopen(req, timeout=10 * UNIT) as resp:
        return json.loads(resp.read())


def _get(url: str, path: str) -> Any:
    with urllib.request.urlopen(url + path, timeout=10 * UNIT) as resp:
        return json.loads(resp.read())


@pytest.mark.parametrize("space", SPACES, ids=lambda s: type(s).__name__)
def test_space_round_trips_through_json(space: Any) -> None:
    data = json.loads(json.dumps(space_to_dict(space)))  # must be plain JSON (no inf)
    assert space_from_dict(data) == space
    schema = space_schema(space)
    json.dumps(schema)
    sample = space.sample()
    wire = json.loads(msgspec.json.encode(sample, enc_hook=lambda v: v.tolist()))
    assert space.contains(from_wire(space, wire, "action"))


def test_from_wire_names_the_bad_field() -> None:
    space = spaces.Dict({"pos": spaces.Box(-1, 1, (2,)), "mode": spaces.Discrete(2)})
    with pytest.raises(stadium.ValidationError) as err:
        from_wire(space, {"pos": [0.0, 0.0, 0.0], "mode": 1}, "action")
    assert err.value.context["field"] == "$.pos"
    assert "shape" in err.value.message
    with pytest.raises(stadium.ValidationError) as err:
        from_wire(space, {"pos": [0.0, 0.0], "mode": True}, "action")
    assert err.value.context["field"] == "$.mode"
    with pytest.raises(stadium.ValidationError, match="is not in"):
        from_wire(spaces.Box(0, 1, (2,)), [2.0, 0.0], "action")
    with pytest.raises(stadium.ValidationError, match="integers"):
        from_wire(spaces.MultiDiscrete([3, 3]), [1.5, 0], "action")


def test_cartpole_class_passes_check_env_and_exports_spaces() -> None:
    cls = load_target("gymnasium:CartPole-v1")
    stadium.check_env(cls)
    schemas = EnvSpec.of(cls).schemas()
    assert schemas["action"] == {"type": "integer", "minimum": 0, "maximum": 1}
    assert schemas["observation"]["maxItems"] == 4
    gym_info = schemas["gymnasium"]
    assert gym_info["id"] == "CartPole-v1"
    assert gym_info["max_episode_steps"] == 500
    assert (
        space_from_dict(gym_info["observation_space"])
        == gymnasium.make("CartPole-v1").observation_space
    )


def test_gymnasium_env_subclass_target_is_served() -> None:
    cls = load_target("tests.integrations.frames_env:FramesEnv")
    stadium.check_env(cls)
    assert EnvSpec.of(cls).schemas()["gymnasium"]["observation_space"]["dtype"] == "uint8"


def test_unknown_gymnasium_id_is_a_target_error() -> None:
    with pytest.raises(stadium.TargetError, match="NoSuchEnv-v0"):
        load_target("gymnasium:NoSuchEnv-v0")
    with pytest.raises(stadium.TargetError, match="needs an environment id"):
        load_target("gymnasium:")


async def test_cartpole_over_the_wire_json_and_msgpack() -> None:
    local = gymnasium.make("CartPole-v1")
    async with serve("gymnasium:CartPole-v1") as server:
        assert "gymnasium" in await asyncio.to_thread(_get, server.url, "/schema")
        for msgpack in (False, True):
            async with stadium.AsyncClient(server.url, msgpack=msgpack) as env:
                first = await env.reset(seed=7)
                obs, _ = local.reset(seed=7)
                assert np.asarray(decode_arrays(first.observation), np.float32).tolist() == (
                    obs.tolist()
                )
                result = await env.step(1)
                obs, reward, terminated, truncated, _ = local.step(1)
                assert result.reward == reward
                assert (result.done, result.truncated) == (terminated or truncated, truncated)
                with pytest.raises(stadium.ValidationError) as err:
                    await env.step(2)
                assert err.value.context["field"] == "$"
                with pytest.raises(stadium.ValidationError):
                    await env.step({"not": "an int"})
                assert (await env.step(0)).reward == 1.0  # the session survived


async def test_env_kwargs_reach_gymnasium_make() -> None:
    async with serve("gymnasium:CartPole-v1", env_kwargs={"max_episode_steps": 3}) as server:
        async with stadium.AsyncClient(server.url) as env:
            await env.reset(seed=0)
            results = [await env.step(i % 2) for i in range(3)]
    assert [r.truncated for r in results] == [False, False, True]
    assert results[-1].done


async def test_image_frames_are_binary_on_msgpack_and_lists_on_json() -> None:
    async with serve(FRAMES) as server:
        async with stadium.AsyncClient(server.url, msgpack=True) as env:
            first = await env.reset(seed=1)
            assert isinstance(first.observation, msgspec.msgpack.Ext)
            frame = decode_arrays(first.observation)
            assert frame.dtype == np.uint8
            assert frame.shape == (32, 32, 3)
            assert first.info is not None
            assert decode_arrays(first.info)["target"].shape == (2,)
            step = await env.step([0.5, -0.5])  # lists are fine on MessagePack too
            assert decode_arrays(step.observation).shape == (32, 32, 3)
            assert decode_arrays(step.info)["distance"] > 0
        async with stadium.AsyncClient(server.url) as env:
            first = await env.reset(seed=1)
            assert np.array_equal(np.asarray(first.observation, np.uint8), frame)
            with pytest.raises(stadium.ValidationError, match="shape"):
                await env.step([0.5])
            await env.step([0.5, -0.5])
        # OpenEnv's stateless POST /step also validates and converts the action
        req = urllib.request.Request(
            server.url + "/step", data=b'{"action": [0.1, 0.2]}', method="POST"
        )
        body = await asyncio.to_thread(_post, req)
        assert len(body["observation"]) == 32
