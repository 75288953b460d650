"""verifiers and OpenPipe ART drive `stadium serve` unchanged, with a stand-in policy.

Each episode's reward is checked against the same policy replayed in-process on the env
class: the trainer saw exactly the episodes the server played.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stadium.envs.wordguess import Guess, WordGuessEnv
from tests.conftest import UNIT
from tests.trainers.conftest import run_trainer, stadium_serve
from tests.trainers.stub_policy import serve_policy, solver_guess

# verifiers' CLI and ART import a lot; the first run also builds .venv-trainers.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600 * UNIT)]

SEEDS = (1, 2)


def replayed_reward(seed: int) -> float:
    """The total reward of the stand-in policy's wordguess episode under ``seed``."""
    env = WordGuessEnv()
    env.reset(seed=seed)
    history: list[tuple[str, str]] = []
    total, done = 0.0, False
    while not done:
        guess = solver_guess(history)
        result = env.step(Guess(guess))
        history.append((guess, result.observation.feedback))
        total += result.reward or 0.0
        done = result.done or result.truncated
    return total


def test_replayed_rewards_differ_by_seed() -> None:
    # The check below would be weak if every seed paid the same.
    assert replayed_reward(SEEDS[0]) != replayed_reward(SEEDS[1])


def test_verifiers_openenv_taskset_base_url(trainer_python: Path, tmp_path: Path) -> None:
    """verifiers' ``openenv`` taskset with ``base_url``: its ``eval`` CLI, unchanged."""
    eval_cli = trainer_python.parent / "eval"
    with stadium_serve("wordguess") as env_url, serve_policy() as policy:
        config = tmp_path / "eval.toml"
        resets = ", ".join(f"{{seed = {s}}}" for s in SEEDS)
        config.write_text(
            f'model = "stand-in"\nnum_tasks = {len(SEEDS)}\npush = false\n'
            f'[env.taskset]\nid = "openenv"\nbase_url = "{env_url}"\nresets = [{resets}]\n'
            f'[env.player.harness]\nid = "null"\n[env.player.runtime]\ntype = "subprocess"\n'
            f'[client]\nbase_url = "{policy.base_url}"\napi_key_var = "STUB_KEY"\n'
        )
        run_trainer([str(eval_cli), "@", str(config), "-o", str(tmp_path / "out")], tmp_path)
        assert policy.requests, "the policy was never asked"
    [traces] = list((tmp_path / "out").glob("*/traces.jsonl"))
    got: dict[int, float] = {}
    for line in traces.read_text().splitlines():
        record = json.loads(line)
        assert record["ok"], record["traces"][0]["errors"]
        trace = record["traces"][0]
        got[record["task"]["data"]["reset"]["seed"]] = trace["rewards"]["openenv_reward"]["score"]
    assert got == pytest.approx({s: replayed_reward(s) for s in SEEDS})


def test_art_rollout_with_openenv_client(trainer_python: Path, tmp_path: Path) -> None:
    """ART's ``gather_trajectory_groups`` over rollouts that step ``GenericEnvClient``."""
    script = Path(__file__).with_name("art_rollout.py")
    with stadium_serve("wordguess", "--workers", "2") as env_url, serve_policy() as policy:
        out = run_trainer(
            [str(trainer_python), str(script), env_url, policy.base_url, json.dumps(SEEDS), "3"],
            tmp_path,
        )
        assert policy.requests
    rewards = json.loads(out.strip().splitlines()[-1])["rewards"]
    assert rewards == [pytest.approx([replayed_reward(s)] * 3) for s in SEEDS]
