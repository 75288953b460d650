"""`/schema` gives a type's own definition at the top, as pydantic (and so OpenEnv) does.

Clients read the top level's ``properties`` / ``required`` directly: verifiers' OpenEnv
taskset turns a bare model reply into ``{required[0]: reply}``.
"""

from __future__ import annotations

import msgspec

from stadium._env.codecs import _inline_top_ref, _schema
from stadium.envs.wordguess import Guess


class Inner(msgspec.Struct):
    n: int


class Outer(msgspec.Struct):
    inner: Inner
    label: str = ""


class Node(msgspec.Struct):
    value: int
    children: list[Node] = []


def resolve(schema: dict[str, object], ref: str) -> object:
    defs = schema["$defs"]
    assert isinstance(defs, dict)
    return defs[ref.removeprefix("#/$defs/")]


def test_a_struct_is_defined_at_the_top() -> None:
    schema = _schema(Guess)
    assert schema["required"] == ["word"]
    assert schema["properties"] == {"word": {"type": "string"}}
    assert "$ref" not in schema
    assert "$defs" not in schema


def test_nested_types_stay_in_defs_and_resolve() -> None:
    schema = _schema(Outer)
    assert schema["required"] == ["inner"]
    ref = schema["properties"]["inner"]["$ref"]
    assert resolve(schema, ref) == msgspec.json.schema(Inner)["$defs"]["Inner"]
    assert set(schema["$defs"]) == {"Inner"}


def test_a_recursive_type_keeps_its_own_definition() -> None:
    schema = _schema(Node)
    assert schema["required"] == ["value"]
    ref = schema["properties"]["children"]["items"]["$ref"]
    assert resolve(schema, ref)["required"] == ["value"]  # type: ignore[index]


def test_other_shapes_are_left_alone() -> None:
    union = msgspec.json.schema(int | str)
    assert _inline_top_ref(union) == union
    odd = {"$ref": "#/$defs/Missing", "$defs": {"Other": {"type": "object"}}}
    assert _inline_top_ref(odd) == odd
