"""stadium.gym: remote sessions as gymnasium.Env / VectorEnv, identical to local rollouts."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

import stadium

gymnasium = pytest.importorskip("gymnasium")
np = pytest.importorskip("numpy")

from gymnasium.utils.env_checker import check_env  # noqa: E402

import stadium.gym  # noqa: E402
from tests.conftest import serve  # noqa: E402

CARTPOLE = ("gymnasium:CartPole-v1", "CartPole-v1")
FRAMES = (
    "gymnasium:tests.integrations.frames_env:Frames-v0",
    "tests.integrations.frames_env:Frames-v0",
)
ENVS = pytest.mark.parametrize(("target", "env_id"), [CARTPOLE, FRAMES], ids=["cartpole", "frames"])
ENCODINGS = pytest.mark.parametrize("msgpack", [False, True], ids=["json", "msgpack"])

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # gymnasium's passive checks


async def in_thread(fn: Callable[[], Any]) -> Any:
    """Run sync Gymnasium-style code off the loop that runs the server."""
    return await asyncio.to_thread(fn)


def same(a: Any, b: Any, strict: bool = True) -> bool:
    """Equal values; with ``strict``, also equal dtypes and shapes.

    Observations are always compared strictly (the spaces give their dtypes).
    ``info`` has no space: on JSON sessions its arrays are rebuilt from lists
    (dtype not carried), so infos are compared by value there and strictly on
    MessagePack.
    """
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k], strict) for k in a)
    if not strict:
        return bool(np.array_equal(np.asarray(a, np.float64), np.asarray(b, np.float64)))
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))


def rollout(env: Any, seed: int, actions: list[Any]) -> list[Any]:
    """The whole transcript of one episode (resetting once more if it ends early)."""
    obs, info = env.reset(seed=seed)
    out: list[Any] = [(obs, info)]
    for action in actions:
        step = env.step(action)
        out.append(step)
        if step[2] or step[3]:
            out.append(env.reset())
    return out


@ENVS
@ENCODINGS
async def test_make_passes_check_env_and_matches_local(
    target: str, env_id: str, msgpack: bool
) -> None:
    async with serve(target) as server:

        def work() -> None:
            remote = stadium.gym.make(server.url, msgpack=msgpack)
            local = gymnasium.make(env_id)
            try:
                assert remote.observation_space == local.observation_space
                assert remote.action_space == local.action_space
                check_env(remote, skip_render_check=True)
                local.action_space.seed(3)
                actions = [local.action_space.sample() for _ in range(40)]
                got, want = rollout(remote, 11, actions), rollout(local, 11, actions)
                assert len(got) == len(want)
                for g, w in zip(got, want, strict=True):
                    assert len(g) == len(w)
                    for x, y in zip(g[:-1], w[:-1], strict=True):
                        assert same(x, y), (x, y)
                    assert same(g[-1], w[-1], strict=msgpack)  # info
            finally:
                remote.close()
                local.close()

        await in_thread(work)


@ENVS
@ENCODINGS
async def test_make_vec_matches_gymnasium_sync_vector_env(
    target: str, env_id: str, msgpack: bool
) -> None:
    n = 4
    async with serve(target) as server:

        def work() -> None:
            remote = stadium.gym.make_vec(server.url, num_envs=n, msgpack=msgpack)
            local = gymnasium.make_vec(env_id, num_envs=n, vectorization_mode="sync")
            try:
                assert remote.metadata["autoreset_mode"] == gymnasium.vector.AutoresetMode.NEXT_STEP
                assert remote.observation_space == local.observation_space
                assert remote.action_space == local.action_space
                got, want = remote.reset(seed=5), local.reset(seed=5)
                assert same(got[0], want[0])
                assert same(got[1], want[1], strict=msgpack)
                local.action_space.seed(0)
                ended = 0
                for _ in range(60):  # long enough for episodes to end and autoreset
                    actions = local.action_space.sample()
                    got, want = remote.step(actions), local.step(actions)
                    for x, y in zip(got[:4], want[:4], strict=True):
                        assert same(x, y), (x, y)
                    assert same(got[4], want[4], strict=msgpack)
                    ended += int(np.sum(got[2] | got[3]))
                assert ended > 0
            finally:
                remote.close()
                local.close()

        await in_thread(work)


async def test_make_against_a_non_gymnasium_server_says_what_to_do() -> None:
    async with serve("echo") as server:
        with pytest.raises(stadium.ConfigError, match="gymnasium:ENV_ID"):
            await in_thread(lambda: stadium.gym.make(server.url))


async def test_vector_reset_mask_and_step_before_reset() -> None:
    async with serve(CARTPOLE[0]) as server:

        def work() -> None:
            envs = stadium.gym.make_vec(server.url, num_envs=3)
            try:
                with pytest.raises(stadium.SessionError, match="reset"):
                    envs.step(np.zeros(3, dtype=np.int64))
                first, _ = envs.reset(seed=1)
                again, _ = envs.reset(
                    seed=[None, 100, None], options={"reset_mask": np.array([False, True, False])}
                )
                assert np.array_equal(first[[0, 2]], again[[0, 2]])
                assert not np.array_equal(first[1], again[1])
            finally:
                envs.close()

        await in_thread(work)
