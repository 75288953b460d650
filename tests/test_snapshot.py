"""Env snapshots (``stadium._env.snapshot``): every built-in env, CartPole and OpenEnv's echo env
continue exactly after a restore into a fresh instance; envs that cannot be snapshotted say
which attribute and why; a snapshot only restores into the class (and version) it came from."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest

import stadium
from stadium._env import snapshot
from stadium._env.snapshot import (
    restore_env,
    snapshot_class,
    snapshot_env,
    why_not_durable,
)
from stadium._errors import ErrorCode, SnapshotError, error_from_wire
from stadium.envs.benchmark import BenchmarkAction, BenchmarkEnv
from stadium.envs.echo import EchoAction, EchoEnv
from stadium.envs.tools import NotesEnv
from stadium.envs.wordguess import WORDS, Guess, WordGuessEnv


async def call(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def plain(value: Any) -> Any:
    """A comparable form of observations, results and infos (arrays, structs, models)."""
    if isinstance(value, stadium.StepResult):
        obs, info = plain(value.observation), plain(value.info)
        return (obs, value.reward, value.done, value.truncated, info)
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return value.tolist()
    if isinstance(value, msgspec.Struct):
        return msgspec.to_builtins(value)
    if hasattr(value, "model_dump"):
        return value.model_dump()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


async def outcome(step: Callable[[Any], Any], action: Any) -> Any:
    """What a step did: its result, or the error it raised (a finished game refuses guesses)."""
    try:
        return plain(await call(step(action)))
    except Exception as exc:
        return (type(exc), str(exc))


@dataclasses.dataclass
class Case:
    factory: Callable[[], Any]
    reset: dict[str, Any]
    before: list[Any]  # actions before the snapshot
    after: list[Any]  # actions then sent to both the original and the restored env


def tool_call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"type": "call_tool", "tool_name": name, "arguments": arguments}


def builtin_cases() -> dict[str, Case]:
    notes = NotesEnv.action_type

    def decode(value: Any) -> Any:
        return msgspec.convert(value, notes)

    return {
        "echo": Case(
            EchoEnv,
            {"seed": 1},
            [EchoAction("a"), EchoAction("bc")],
            [EchoAction("def"), EchoAction("")],
        ),
        "wordguess-seeded": Case(
            WordGuessEnv,
            {"seed": 7},
            [Guess("crane"), Guess("storm")],
            [Guess(w) for w in WORDS[:4]],
        ),
        # no seed: the secret comes from fresh entropy, so only the snapshot can carry it
        "wordguess-unseeded": Case(
            WordGuessEnv, {}, [Guess("apple")], [Guess(w) for w in WORDS[5:10]]
        ),
        "benchmark": Case(
            BenchmarkEnv,
            {"seed": 3, "options": {"state_kb": 4}},
            [BenchmarkAction()] * 3,
            [BenchmarkAction()] * 3,
        ),
        "benchmark-unseeded": Case(BenchmarkEnv, {}, [BenchmarkAction()], [BenchmarkAction()] * 2),
        "tools": Case(
            NotesEnv,
            {"seed": 0},
            [decode(tool_call("add_note", text="2")), decode(tool_call("add_note", text="x"))],
            [
                decode(tool_call("add_note", text="3")),
                decode(tool_call("list_notes")),
                decode(tool_call("submit", answer=5.0)),
            ],
        ),
    }


async def assert_continues_exactly(case: Case) -> None:
    env = case.factory()
    await call(env.reset(**case.reset))
    for action in case.before:
        await call(env.step(action))
    data = snapshot_env(env)
    restored = restore_env(case.factory, data)
    assert type(restored) is type(env)
    assert restored is not env
    assert plain(restored.state) == plain(env.state)
    for action in case.after:
        assert await outcome(restored.step, action) == await outcome(env.step, action)
        assert plain(restored.state) == plain(env.state)
    # A second snapshot of the restored env restores just as well.
    again = restore_env(case.factory, snapshot_env(restored))
    assert plain(again.state) == plain(restored.state)
    for env_ in (env, restored, again):
        await call(env_.close())


@pytest.mark.parametrize("name", list(builtin_cases()))
async def test_builtin_env_continues_exactly_after_restore(name: str) -> None:
    case = builtin_cases()[name]
    await assert_continues_exactly(case)
    assert why_not_durable(case.factory()) is None


async def test_step_count_comes_along() -> None:
    env = EchoEnv()
    env.reset()
    for _ in range(5):
        env.step(EchoAction("x"))
    restored = restore_env(EchoEnv, snapshot_env(env))
    assert restored.state.step_count == 5


async def test_benchmark_keeps_its_own_pid_and_the_snapshot_hash() -> None:
    env = BenchmarkEnv()
    await env.reset()
    env._pid = -1  # as if snapshotted in another worker
    restored = restore_env(BenchmarkEnv, snapshot_env(env))
    obs = (await restored.step(BenchmarkAction())).observation
    assert obs.pid > 0
    assert obs.session_hash == env._hash


async def test_cartpole_continues_exactly_with_its_rng() -> None:
    pytest.importorskip("gymnasium")
    np = pytest.importorskip("numpy")
    from stadium.integrations.gymnasium import gymnasium_environment

    cls = gymnasium_environment("CartPole-v1")
    before = [np.int64(a) for a in (0, 1, 1, 0)]
    case = Case(cls, {"seed": 11}, before, [np.int64(a) for a in (1, 1, 0, 1, 0, 0, 1)])
    await assert_continues_exactly(case)
    env = cls()
    env.reset(seed=5)
    env.step(np.int64(1))
    restored = restore_env(cls, snapshot_env(env))
    # The episode's RNG came along: both draw the same numbers from here on.
    a, b = env.env.unwrapped.np_random, restored.env.unwrapped.np_random
    assert a is not b
    assert a.random(4).tolist() == b.random(4).tolist()
    # So did the time limit's step count.
    assert restored.env._elapsed_steps == env.env._elapsed_steps == 1
    assert why_not_durable(env) is None
    env.close()
    restored.close()


def test_gymnasium_env_pickling_by_constructor_arguments_is_not_durable() -> None:
    gymnasium = pytest.importorskip("gymnasium")
    from gymnasium.utils import EzPickle

    from stadium.integrations.gymnasium import gymnasium_environment

    cls = gymnasium_environment(EzPickled)
    env = cls()
    why = why_not_durable(env)
    assert why is not None
    assert "EzPickle" in why
    assert "EzPickled" in why
    with pytest.raises(SnapshotError, match="EzPickle"):
        snapshot_env(env)
    assert issubclass(EzPickled, EzPickle)
    assert issubclass(EzPickled, gymnasium.Env)


try:
    import gymnasium as _gymnasium
    from gymnasium.utils import EzPickle as _EzPickle

    class EzPickled(_gymnasium.Env[Any, Any], _EzPickle):
        """A Gymnasium env that pickles by constructor arguments (as Box2D and MuJoCo envs do)."""

        observation_space = _gymnasium.spaces.Discrete(3)
        action_space = _gymnasium.spaces.Discrete(2)

        def __init__(self) -> None:
            _EzPickle.__init__(self)
            self.position = 0

        def reset(
            self, *, seed: int | None = None, options: Any = None
        ) -> tuple[int, dict[str, Any]]:
            super().reset(seed=seed)
            self.position = 0
            return 0, {}

        def step(self, action: Any) -> tuple[int, float, bool, bool, dict[str, Any]]:
            self.position = min(self.position + int(action), 2)
            return self.position, 0.0, False, False, {}

except ImportError:  # pragma: no cover - gymnasium is a test dependency
    pass


@pytest.fixture(scope="module")
def openenv_echo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The echo env of ``openenv init``, from openenv's own template, behind Stadium's adapter."""
    init = pytest.importorskip("openenv.cli.commands.init")
    from stadium.integrations.openenv import openenv_environment

    root = tmp_path_factory.mktemp("openenv_snapshot")
    init._copy_template_directory(
        "openenv.cli.templates.openenv_env",
        "",
        root / "snap_echo",
        init._create_template_replacements("snap_echo"),
        "snap_echo",
    )
    sys.path.insert(0, str(root))
    try:
        module = importlib.import_module("snap_echo.server.snap_echo_environment")
        yield openenv_environment(module.SnapEchoEnvironment)
    finally:
        sys.path.remove(str(root))
        for name in [m for m in sys.modules if m == "snap_echo" or m.startswith("snap_echo.")]:
            del sys.modules[name]


async def test_openenv_echo_continues_exactly(openenv_echo: Any) -> None:
    actions = [{"message": m} for m in ("hi", "there", "x" * 12, "", "end")]
    case = Case(openenv_echo, {"seed": 2}, actions[:2], actions[2:])
    await assert_continues_exactly(case)
    env = openenv_echo()
    env.reset()
    env.step({"message": "abc"})
    restored = restore_env(openenv_echo, snapshot_env(env))
    assert restored.state.episode_id == env.state.episode_id  # a uuid4: carried, not redrawn
    assert restored.state.step_count == 1
    assert why_not_durable(env) is None


def test_openenv_mcp_env_is_not_durable_and_says_where() -> None:
    pytest.importorskip("fastmcp")
    from stadium.integrations.openenv import openenv_environment
    from tests.openenv_compat.mcp_notes import OpenEnvNotes

    why = why_not_durable(openenv_environment(OpenEnvNotes)())
    assert why is not None
    assert why.startswith("pickle failed:")
    assert '(attribute "env.mcp_server.' in why  # the path into the wrapped env


# -- envs that cannot be snapshotted ------------------------------------------------------


class Connection:
    def __init__(self) -> None:
        self._lock = threading.Lock()


class HoldsALock(EchoEnv):
    def __init__(self) -> None:
        super().__init__()
        self.conn = Connection()


class HoldsASocket(EchoEnv):
    def __init__(self) -> None:
        super().__init__()
        self.sock, self.peer = socket.socketpair()

    def close(self) -> None:
        self.sock.close()
        self.peer.close()


class HoldsAGenerator(EchoEnv):
    def __init__(self) -> None:
        super().__init__()
        self.queues = {"pending": [1, (i for i in range(3))]}


@pytest.mark.parametrize(
    ("cls", "what", "where"),
    [
        (HoldsALock, "_thread.lock", "conn._lock"),
        (HoldsASocket, "socket", "sock"),
        (HoldsAGenerator, "generator", "queues['pending'][1]"),
    ],
)
def test_why_not_durable_names_the_attribute(cls: Any, what: str, where: str) -> None:
    env = cls()
    try:
        why = why_not_durable(env)
        assert why is not None
        assert why.startswith("pickle failed:"), why
        assert what in why, why
        assert repr(where) in why, why
        with pytest.raises(SnapshotError) as info:
            snapshot_env(env)
        message = info.value.message
        assert cls.__qualname__ in message
        assert where in message
        assert "implement snapshot() and restore()" in message
        assert "--durable" in message
        assert info.value.code is ErrorCode.SNAPSHOT_FAILED
    finally:
        env.close()


class Replayed(EchoEnv):
    """Holds a lock, but snapshots its own way: what it needs is the step count."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    def snapshot(self) -> bytes:
        return str(self.state.step_count).encode()

    def restore(self, data: bytes) -> None:
        self._state = stadium.State(step_count=int(data))


def test_an_env_with_its_own_snapshot_is_durable() -> None:
    env = Replayed()
    env.reset()
    env.step(EchoAction("a"))
    assert why_not_durable(env) is None
    restored = restore_env(Replayed, snapshot_env(env))
    assert restored.state.step_count == 1
    assert restored.lock is not env.lock


class Parent(EchoEnv):
    def __init__(self) -> None:
        super().__init__()
        self.callback = self.step
        self.children = [Child(self)]


class Child:
    def __init__(self, parent: Parent) -> None:
        self.parent = parent


def test_references_to_the_instance_come_back_as_the_restored_instance() -> None:
    env = Parent()
    env.reset()
    restored = restore_env(Parent, snapshot_env(env))
    assert restored.callback.__self__ is restored
    assert restored.children[0].parent is restored
    restored.callback(EchoAction("abc"))
    assert restored.state.step_count == 1
    assert env.state.step_count == 0


class Slotted(EchoEnv):
    __slots__ = ("counter",)

    def __init__(self) -> None:
        super().__init__()
        self.counter = 0


def test_slots_come_along() -> None:
    env = Slotted()
    env.counter = 41
    restored = restore_env(Slotted, snapshot_env(env))
    assert restored.counter == 41


class KeepsACache(EchoEnv):
    """Leaves its per-process cache out of snapshots with ``__getstate__``."""

    def __init__(self) -> None:
        super().__init__()
        self.cache: dict[str, int] = {}
        self.lock = threading.Lock()  # the process's: left out too

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["cache"], state["lock"]
        return state


def test_getstate_leaves_out_what_belongs_to_the_process() -> None:
    env = KeepsACache()
    env.reset()
    env.step(EchoAction("ab"))
    env.cache["warm"] = 1
    assert why_not_durable(env) is None
    restored = restore_env(KeepsACache, snapshot_env(env))
    assert restored.cache == {}
    assert restored.lock is not env.lock
    assert restored.state.step_count == 1


class NotAnEnvironment:
    """An env object without snapshot()/restore(): pickled whole."""

    def __init__(self) -> None:
        self.steps = 0


def test_an_object_without_snapshot_is_pickled_whole() -> None:
    env = NotAnEnvironment()
    env.steps = 3
    restored = restore_env(NotAnEnvironment, snapshot_env(env))
    assert isinstance(restored, NotAnEnvironment)
    assert restored.steps == 3
    with pytest.raises(SnapshotError, match="cannot be restored into"):
        restore_env(EchoEnv, snapshot_env(env))


# -- identity: class, version, format --------------------------------------------------


def test_restoring_into_another_class_fails_clearly() -> None:
    data = snapshot_env(EchoEnv())
    assert snapshot_class(data) == "stadium.envs.echo:EchoEnv"
    with pytest.raises(SnapshotError) as info:
        restore_env(WordGuessEnv, data)
    message = info.value.message
    assert "stadium.envs.echo:EchoEnv" in message
    assert "WordGuessEnv" in message
    assert info.value.context["reason"] == "wrong class"
    # The default restore checks too, when called directly.
    with pytest.raises(SnapshotError, match="EchoEnv cannot be restored into"):
        WordGuessEnv().restore(EchoEnv().snapshot())
    # And so does a factory that is not a class.
    with pytest.raises(SnapshotError, match=r"wrong class|cannot be restored"):
        restore_env(lambda: WordGuessEnv(), data)


class EchoV2(EchoEnv):
    version = "2.0"


def test_restoring_into_another_version_fails_clearly() -> None:
    data = snapshot_env(EchoV2())
    namespace = {"version": "1.0", "__module__": __name__, "__qualname__": "EchoV2"}
    old = type("EchoV2", (EchoEnv,), namespace)
    with pytest.raises(SnapshotError, match=r"version '2.0' cannot be restored into version '1.0'"):
        restore_env(old, data)


def test_bytes_that_are_not_a_snapshot_are_refused() -> None:
    with pytest.raises(SnapshotError, match="not a Stadium snapshot"):
        restore_env(EchoEnv, b"\x80\x05garbage")
    data = bytearray(snapshot_env(EchoEnv()))
    data[8] = 99  # the format byte
    with pytest.raises(SnapshotError, match="format 99"):
        restore_env(EchoEnv, bytes(data))
    with pytest.raises(SnapshotError, match="no state prefix"):
        EchoEnv().restore(b"nonsense")
    head = b"\x93\xa3env\xa2\xff\xfe\xa11"  # a header whose class name is not UTF-8
    damaged = bytes(data[:8]) + bytes((snapshot.FORMAT,)) + snapshot._LENGTH.pack(len(head)) + head
    with pytest.raises(SnapshotError, match="header is damaged: a string is not valid UTF-8"):
        restore_env(EchoEnv, damaged)  # was UnicodeDecodeError, out of msgspec


class FailsToRestore(EchoEnv):
    closed = 0

    def restore(self, data: bytes) -> None:
        raise RuntimeError("disk on fire")

    def close(self) -> None:
        type(self).closed += 1


def test_a_failing_restore_is_a_snapshot_error_and_the_fresh_env_is_closed() -> None:
    data = snapshot_env(FailsToRestore())
    with pytest.raises(SnapshotError, match="RuntimeError: disk on fire"):
        restore_env(FailsToRestore, data)
    assert FailsToRestore.closed == 1


def test_snapshot_error_travels_the_wire() -> None:
    err = SnapshotError("x cannot be snapshotted", env="X", reason="why")
    back = error_from_wire(err.to_wire())
    assert isinstance(back, SnapshotError)
    assert back.context["reason"] == "why"
    assert stadium.SnapshotError is SnapshotError
