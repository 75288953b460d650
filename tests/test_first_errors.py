"""The errors a first-time user meets (a port in use, a typo in a target, an env that
raises under ``stadium check``) say what was wrong and what to do."""

from __future__ import annotations

import inspect
import socket
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from stadium import (
    AsyncClient,
    ConnectError,
    Environment,
    SessionPool,
    State,
    StepResult,
    check_env,
)
from stadium._cli.check import check_target
from stadium._cli.main import serve
from stadium._env.spec import EnvSpec
from stadium._errors import ConfigError, EnvCheckError, TargetError
from stadium._server.admission.tenants import load_tenants
from stadium._server.config import read_token_file
from stadium._server.loader import load_target
from stadium._server.server import _check_env_kwargs, listen_socket
from stadium.envs import BUILTIN


def test_a_port_in_use_says_how_to_pick_another() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ConfigError) as caught:
            listen_socket("127.0.0.1", port)
    message = str(caught.value)
    assert f"cannot listen on 127.0.0.1:{port}" in message
    assert "Address already in use" in message
    assert "--port 0 picks a free one" in message


GAME = """
import msgspec, stadium

class Guess(msgspec.Struct):
    word: str

class Game(stadium.Environment[Guess, Guess, stadium.State]):
    def reset(self, *, seed=None, options=None) -> Guess:
        return Guess("")

    def step(self, action: Guess) -> stadium.StepResult[Guess]:
        return stadium.StepResult(action, done=True)
"""


@pytest.mark.parametrize(
    ("target", "needle"),
    [
        (
            "{game}:Gme",
            "has no attribute 'Gme'; did you mean 'Game'? (its environment classes: Game)",
        ),
        ("{game}", "(a file target names its class: '{game}:ClassName')"),
        ("echoo", "(did you mean the built-in 'echo'?)"),
        ("wordgues", "(did you mean the built-in 'wordguess'?)"),
    ],
)
def test_a_typo_in_a_target_names_what_was_likely_meant(
    tmp_path: Path, target: str, needle: str
) -> None:
    game = tmp_path / "typo_game.py"
    game.write_text(GAME)
    with pytest.raises(TargetError) as caught:
        load_target(target.format(game=game))
    assert needle.format(game=game) in str(caught.value)


class Word(msgspec.Struct):
    word: str


class RaisesInReset(Environment[Word, Word, State]):
    def reset(self, *, seed: int | None = None, options: Any = None) -> Word:
        raise RuntimeError("dataset file missing")  # the line the message names

    def step(self, action: Word) -> StepResult[Word]:
        return StepResult(action, done=True)


class RaisesInInit(RaisesInReset):
    def __init__(self) -> None:
        raise RuntimeError("no GPU")


def test_check_names_the_env_call_that_raised_and_its_line() -> None:
    line = inspect.getsourcelines(RaisesInReset.reset)[1] + 1
    with pytest.raises(EnvCheckError) as caught:
        check_env(RaisesInReset)
    assert str(caught.value) == (
        "RaisesInReset.reset() raised RuntimeError: dataset file missing "
        f"(at test_first_errors.py:{line})"
    )
    with pytest.raises(EnvCheckError, match=r"^RaisesInInit\(\) raised RuntimeError: no GPU"):
        check_env(RaisesInInit)


def test_check_of_a_url_where_nothing_listens_says_so() -> None:
    with socket.socket() as free:  # a port nothing listens on once closed
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    with pytest.raises(EnvCheckError) as caught:
        check_target(f"http://127.0.0.1:{port}")
    assert "Connection refused" in str(caught.value)
    assert "nothing listens there: is the server running, on this port?" in str(caught.value)


class Sized(RaisesInReset):
    def __init__(self, size: int, name: str = "x") -> None:
        self.size = size


def test_env_kwargs_the_constructor_cannot_take_are_refused_at_start() -> None:
    """They failed every session's creation (1011 "environment could not be created") while
    the server started as if nothing were wrong."""
    with pytest.raises(ConfigError, match=r"do not fit Sized\(size, name='x'\): "):
        _check_env_kwargs(EnvSpec.of(Sized), {"sise": 3})
    with pytest.raises(ConfigError, match="missing a required argument: 'size'"):
        _check_env_kwargs(EnvSpec.of(Sized), {})
    _check_env_kwargs(EnvSpec.of(Sized), {"size": 3})
    _check_env_kwargs(EnvSpec.of(RaisesInReset), {})


class ResetWithoutOptions(RaisesInReset):
    def reset(self, seed: int | None = None) -> Word:  # type: ignore[override]
        return Word("")


class StepWithTwo(RaisesInReset):
    def step(self, action: Word, extra: int) -> StepResult[Word]:  # type: ignore[override]
        return StepResult(action, done=True)


def test_a_reset_or_step_the_server_cannot_call_is_refused_with_the_signature_to_write() -> None:
    """They passed the class checks and failed in every session (a TypeError per reset)."""
    with pytest.raises(TargetError) as caught:
        EnvSpec.of(ResetWithoutOptions)
    assert str(caught.value) == (
        "ResetWithoutOptions.reset(self, seed=None) cannot be called as the server calls it "
        "(got an unexpected keyword argument 'options'); "
        "write it as def reset(self, *, seed=None, options=None)"
    )
    with pytest.raises(TargetError, match=r"StepWithTwo.step\(self, action, extra\) cannot"):
        EnvSpec.of(StepWithTwo)


def test_a_missing_dependency_of_a_file_target_says_which_python_to_install_it_into(
    tmp_path: Path,
) -> None:
    """A dependency pip put into another Python than the one Stadium runs on is the usual
    cause; the message named the module only."""
    env = tmp_path / "needs_dep.py"
    env.write_text("import no_such_dependency_here\n")
    with pytest.raises(TargetError) as caught:
        load_target(f"{env}:Env")
    assert "No module named 'no_such_dependency_here'" in str(caught.value)
    assert f"({sys.executable} -m pip install ...)" in str(caught.value)


def test_an_unreadable_tenants_or_token_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "tenants.toml"
    with pytest.raises(ConfigError, match=f"cannot read --tenants {missing}: No such file"):
        load_tenants(str(missing))
    with pytest.raises(ConfigError, match=f"cannot read --auth-token-file {missing}: No such"):
        read_token_file(str(missing))


def test_serve_help_names_every_built_in_env() -> None:
    """It named three of the seven."""
    help_text = serve.help or ""
    assert [name for name in BUILTIN if name not in help_text] == []


async def test_a_client_where_nothing_listens_says_so() -> None:
    """A session and a batch connection to a port nothing listens on: the error says so
    (it gave the OS's "Connect call failed" only)."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(ConnectError, match="nothing listens there: is the server running"):
        await AsyncClient(url, max_retries=0).connect()
    with pytest.raises(ConnectError, match="nothing listens there: is the server running"):
        async with SessionPool(url, size=2, max_retries=0, batch=True):
            pass
