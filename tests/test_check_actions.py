"""`stadium check` works on what users have: actions derived from the action schema when the
env gives none, actions from the command line, the README's examples and unmodified
OpenEnv envs passing as written."""

from __future__ import annotations

import asyncio
import enum
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import pytest

import stadium
from stadium import EnvCheckError, Environment, State, StepResult, check_env
from stadium._cli.check import check_server, load_actions
from stadium._cli.main import main
from stadium._env.checker import sample_value, schema_action
from stadium._env.spec import EnvSpec
from tests.conftest import serve

ROOT = Path(__file__).resolve().parents[1]


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Inner(msgspec.Struct):
    label: Annotated[str, msgspec.Meta(min_length=3)]
    weight: Annotated[float, msgspec.Meta(gt=0.5, le=2.0)]


class Rich(msgspec.Struct):
    count: Annotated[int, msgspec.Meta(ge=5, le=10)]
    even: Annotated[int, msgspec.Meta(gt=3, multiple_of=2)]
    negative: Annotated[int, msgspec.Meta(lt=-4)]
    mode: Literal["fast", "slow"]
    color: Color
    items: Annotated[list[Inner], msgspec.Meta(min_length=2)]
    pair: tuple[int, str]
    maybe: Inner | None
    table: dict[str, int]
    flag: bool
    anything: Any
    note: str = "kept"


class Out(msgspec.Struct):
    seen: str


class RichEnv(Environment[Rich, Out, State]):
    blocking = False

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Out:
        return Out("")

    def step(self, action: Rich) -> StepResult[Out]:
        return StepResult(Out(repr(action)), 0.0, False)


def test_a_valid_action_is_built_from_a_rich_schema() -> None:
    action = schema_action(EnvSpec.of(RichEnv))
    assert isinstance(action, Rich)
    assert 5 <= action.count <= 10
    assert action.even > 3
    assert action.even % 2 == 0
    assert action.negative < -4
    assert action.mode == "fast"
    assert isinstance(action.color, Color)
    assert len(action.items) == 2
    assert len(action.items[0].label) == 3
    assert 0.5 < action.items[0].weight <= 2.0
    assert action.note == "kept"  # defaults are left to the type
    assert check_env(RichEnv)


@pytest.mark.parametrize(
    ("schema", "value"),
    [
        ({"type": "integer", "exclusiveMinimum": 0}, 1),
        ({"type": "number", "minimum": 2.5}, 2.5),
        ({"type": "integer", "maximum": -3}, -4),
        ({"type": "string", "default": "x"}, "x"),
        ({"const": 7}, 7),
        ({"type": ["null", "string"], "minLength": 2}, "aa"),
        ({"anyOf": [{"type": "null"}, {"type": "boolean"}]}, False),
        ({"type": "array", "prefixItems": [{"type": "integer"}, {"enum": ["a"]}]}, [0, "a"]),
        ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": []}, {}),
        ({"$ref": "#/$defs/A", "$defs": {"A": {"type": "string", "minLength": 1}}}, "a"),
    ],
)
def test_the_schema_walker(schema: dict[str, Any], value: Any) -> None:
    assert sample_value(schema, schema) == value


def test_a_pydantic_action_is_built_from_its_schema() -> None:
    pydantic = pytest.importorskip("pydantic")

    class Move(pydantic.BaseModel):
        x: int = pydantic.Field(ge=3)
        name: str = pydantic.Field(min_length=2)
        tags: list[str] = pydantic.Field(min_length=1)

    class Board(Environment[Move, Out, State]):
        def reset(self, *, seed: int | None = None, options: Any = None) -> Out:
            return Out("")

        def step(self, action: Move) -> StepResult[Out]:
            return StepResult(Out(action.name), 0.0, True)

    action = schema_action(EnvSpec.of(Board))
    assert (action.x, action.name, action.tags) == (3, "aa", [""])


def test_an_unmodified_openenv_env_passes_stadium_check(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("openenv")
    main(["check", "tests/openenv_compat/openenv_echo_app.py:OpenEnvEcho"])
    assert "all 5 checks passed" in capsys.readouterr().out


def _readme_envs(tmp_path: Path) -> list[tuple[Path, str]]:
    """Every ```python block of the README that defines an Environment, as a file + class."""
    text = (ROOT / "README.md").read_text()
    out = []
    for i, block in enumerate(re.findall(r"```python\n(.*?)```", text, re.S)):
        for name in re.findall(r"^class (\w+)\((?:stadium\.)?Environment\b", block, re.M):
            path = tmp_path / f"readme_example_{i}.py"
            path.write_text(block)
            out.append((path, name))
    return out


def test_the_readme_examples_pass_stadium_check_as_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    examples = _readme_envs(tmp_path)
    assert examples, "the README shows an environment"
    for path, name in examples:
        main(["check", f"{path}:{name}"])
        assert "checks passed" in capsys.readouterr().out
        # The README's own example action, given on the command line.
        main(["check", f"{path}:{name}", "--action", '{"word": "pear"}'])
        assert "checks passed" in capsys.readouterr().out


class Word(msgspec.Struct):
    word: Annotated[str, msgspec.Meta(pattern="^[a-z]+$")]


class Words(Environment[Word, Out, State]):
    blocking = False

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Out:
        self.seen: list[str] = []
        return Out("")

    def step(self, action: Word) -> StepResult[Out]:
        self.seen.append(action.word)
        return StepResult(Out(",".join(self.seen)), 0.0, action.word == "stop")


def test_actions_from_the_command_line_and_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = f"{Path(__file__)}:Words"
    with pytest.raises(SystemExit) as exc:  # a pattern: no action can be derived
        main(["check", target])
    assert exc.value.code == 1
    assert "--action JSON" in capsys.readouterr().err
    main(["check", target, "--action", '{"word": "go"}', "--action", '{"word": "stop"}'])
    assert "(3 observations compared)" in capsys.readouterr().out
    array = tmp_path / "actions.json"
    array.write_text('[{"word": "a"}, {"word": "b"}]')
    lines = tmp_path / "actions.jsonl"
    lines.write_text('{"word": "c"}\n\n{"word": "stop"}\n')
    main(["check", target, "--actions-file", str(array), "--actions-file", str(lines)])
    assert "(5 observations compared)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["check", target, "--action", '{"word": "Bad!"}'])
    assert exc.value.code == 1
    assert "action #1 given is not a valid Word" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["check", target, "--action", "{nope"])
    assert exc.value.code == 2
    assert "is not valid JSON" in capsys.readouterr().err


def test_load_actions() -> None:
    assert load_actions((), ()) is None
    assert load_actions(('{"a": 1}', "2"), ()) == [{"a": 1}, 2]
    with pytest.raises(stadium.StadiumError, match="cannot read"):
        load_actions((), ("/nonexistent/actions.json",))


async def test_a_server_is_stepped_with_the_actions_given() -> None:
    async with serve(Words) as server:
        log = await asyncio.to_thread(check_server, server.url, actions=[{"word": "go"}])
        assert "step answers an observation with reward and done" in log
        with pytest.raises(EnvCheckError, match="action #1 failed"):
            await asyncio.to_thread(check_server, server.url, actions=[{"word": 3}])
