"""check_env: passes on every built-in env, and names each kind of violation."""

from __future__ import annotations

import random
from typing import Annotated, Any

import msgspec
import pytest

import stadium
from stadium import EnvCheckError, Environment, State, StepResult, check_env
from stadium._server.loader import load_target
from stadium.envs import BUILTIN


def test_check_env_lives_beside_the_env_contract() -> None:
    """Gymnasium keeps its checker beside the env; the old import path still works."""
    from stadium._cli import check as cli_check
    from stadium._env import checker

    assert check_env is checker.check_env is cli_check.check_env
    assert check_env.__module__ == "stadium._env.checker"


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_builtin_envs_pass(name: str) -> None:
    log = check_env(load_target(name))
    assert any("deterministic" in line for line in log)


class A(msgspec.Struct):
    x: int = 0


class O(msgspec.Struct):  # noqa: E742
    y: int


class Good(Environment[A, O, State]):
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> O:
        self.rng = random.Random(seed)
        return O(self.rng.randint(0, 100))

    def step(self, action: A) -> StepResult[O]:
        return StepResult(O(self.rng.randint(0, 100)), 0.0, False)


class Unseeded(Good):
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> O:
        self.rng = random.Random()
        return O(self.rng.randint(0, 10**9))


class WrongObs(Good):
    def step(self, action: A) -> StepResult[O]:
        return StepResult({"nope": 1}, 0.0, False)  # type: ignore[arg-type]


class BadReward(Good):
    def step(self, action: A) -> StepResult[O]:
        return StepResult(O(1), "high", False)  # type: ignore[arg-type]


class NoStep(Environment[A, O, State]):
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> O:
        return O(0)


class Untyped(Environment):  # type: ignore[type-arg]
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> O:
        return O(0)

    def step(self, action: Any) -> O:
        return O(0)


class Required(msgspec.Struct):
    needed: str


class NeedsActions(Environment[Required, O, State]):
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> O:
        return O(0)

    async def step(self, action: Required) -> StepResult[O]:  # type: ignore[override]
        return StepResult(O(len(action.needed)), 1.0, True)


class Patterned(msgspec.Struct):
    code: Annotated[str, msgspec.Meta(pattern="^[0-9]{4}$")]


class NeedsPatterned(Environment[Patterned, O, State]):
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> O:
        return O(0)

    def step(self, action: Patterned) -> StepResult[O]:
        return StepResult(O(0), 0.0, True)


def test_a_good_env_passes() -> None:
    assert len(check_env(Good)) >= 4


@pytest.mark.parametrize(
    ("cls", "needle"),
    [
        (Unseeded, "not deterministic"),
        (WrongObs, "not a valid O"),
        (BadReward, "reward must be a number"),
        (NoStep, "does not implement step()"),
        (Untyped, "does not declare action_type and observation_type"),
        (NeedsPatterned, "Pass actions=[...]"),
    ],
)
def test_violations_are_named(cls: type[Environment[Any, Any, Any]], needle: str) -> None:
    with pytest.raises(EnvCheckError) as info:
        check_env(cls)
    assert needle in str(info.value)


def test_explicit_actions_and_async_step() -> None:
    log = check_env(NeedsActions, actions=[Required("abc")])
    assert any("step()" in line for line in log)


def test_check_env_inside_a_running_loop() -> None:
    import asyncio

    async def inner() -> list[str]:
        return check_env(Good)

    assert asyncio.run(inner())


def test_exports_are_complete() -> None:
    """``__all__`` is every public name: those loaded at import and those loaded on first use."""
    import types

    public = {
        name
        for name in dir(stadium)
        if not name.startswith("_") and not isinstance(getattr(stadium, name), types.ModuleType)
    }
    assert set(stadium.__all__) - {"__version__"} == public
