"""Tool environments: typed tool methods, served over MCP and over ``step``.

A :class:`ToolEnvironment` is an :class:`~stadium.Environment` whose methods
marked :func:`tool` are its tools. Each tool's typed parameters become its input
JSON Schema (msgspec) and validate the arguments of a call::

    class Notes(stadium.ToolEnvironment):
        def __init__(self) -> None:
            self.notes: list[str] = []

        def reset(self, *, seed=None, options=None):
            self.notes.clear()
            return self.tools_observation()

        @stadium.tool
        def add_note(self, text: str) -> int:
            \"\"\"Add a note; returns how many there are.\"\"\"
            self.notes.append(text)
            return len(self.notes)

The same tools are reached three ways, all on the session's own instance:
``POST /mcp`` and the ``"mcp"`` WebSocket message (JSON-RPC ``tools/list``,
``tools/call``, handled by ``mcp``), and ``step`` with OpenEnv's actions
``{"type": "list_tools"}`` / ``{"type": "call_tool", "tool_name": ..., "arguments":
{...}}``, answered with OpenEnv's observations (``{"tools": [...]}``,
``{"tool_name": ..., "result": ..., "error": ...}``). A tool that returns a
:class:`~stadium.StepResult` sets the step's reward and done (its observation is
the tool's result).

Every tool env (this class, and OpenEnv ``MCPEnvironment`` subclasses through
their adapter) offers the two coroutine methods ``mcp`` calls:
``mcp_list_tools()`` and ``mcp_call_tool(name, arguments)``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import random
import typing
from collections.abc import Callable
from typing import Any, ClassVar

import msgspec

from stadium._env.codecs import enc_hook_default, validation_error
from stadium._env.contract import Environment, State, StepResult
from stadium._errors import ToolCallError, describe_exception

_MARK = "__stadium_tool__"
#: Names a tool may not take: they are the session's own requests (OpenEnv's rule).
RESERVED_TOOL_NAMES = frozenset({"reset", "step", "state", "close"})


def tool(
    fn: Callable[..., Any] | None = None, *, name: str | None = None, description: str | None = None
) -> Any:
    """Mark a method of a :class:`ToolEnvironment` as a tool (``@tool`` or ``@tool(name=...)``).

    The tool's name is the method's (or ``name``), its description the first
    paragraph of the docstring (or ``description``), its input schema the
    method's typed parameters (anything msgspec validates: ``int``, ``str``,
    ``Literal``, ``msgspec.Struct``, lists, ...; a parameter with a default is
    optional). ``def`` or ``async def``.
    """

    def mark(f: Callable[..., Any]) -> Callable[..., Any]:
        doc = inspect.getdoc(f) or ""
        setattr(
            f,
            _MARK,
            (name or f.__name__, description if description is not None else doc.split("\n\n")[0]),
        )
        return f

    return mark(fn) if fn is not None else mark


@dataclasses.dataclass(frozen=True, slots=True)
class ToolSpec:
    """One tool, compiled once per class: its schema and its argument validator."""

    name: str
    description: str
    method: str
    args_type: type[msgspec.Struct]
    input_schema: dict[str, Any]
    is_async: bool

    def describe(self) -> dict[str, Any]:
        """The MCP ``Tool`` of ``tools/list``."""
        return {
            "name": self.name,
            "description": self.description,
            "inputSchema": self.input_schema,
        }

    def arguments(self, arguments: Any) -> dict[str, Any]:
        """``arguments`` validated against the tool's parameters; raises :class:`ToolCallError`."""
        if arguments is None:
            arguments = {}
        try:
            args = msgspec.convert(arguments, self.args_type, strict=False)
        except msgspec.ValidationError as exc:
            err = validation_error(exc, f"arguments of tool {self.name!r}")
            raise ToolCallError(err.message, tool=self.name, **err.context) from None
        return {f: getattr(args, f) for f in self.args_type.__struct_fields__}


def compile_tools(cls: type[Any]) -> dict[str, ToolSpec]:
    """The tools of ``cls``: its methods marked :func:`tool` (inherited ones too)."""
    tools: dict[str, ToolSpec] = {}
    for attr in dir(cls):
        fn = getattr(cls, attr, None)
        mark = getattr(fn, _MARK, None)
        if mark is None or not callable(fn):
            continue
        name, description = mark
        if name in RESERVED_TOOL_NAMES:
            raise TypeError(
                f"{cls.__name__}.{attr}: a tool may not be named {name!r} (reserved: "
                f"{', '.join(sorted(RESERVED_TOOL_NAMES))})"
            )
        hints = typing.get_type_hints(fn, include_extras=True)
        fields: list[Any] = []
        for param in list(inspect.signature(fn).parameters.values())[1:]:  # after self
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                raise TypeError(f"{cls.__name__}.{attr}: a tool takes named parameters only")
            tp = hints.get(param.name, Any)
            if param.default is param.empty:
                fields.append((param.name, tp))
            else:
                fields.append((param.name, tp, param.default))
        args_type = msgspec.defstruct(f"{name}_arguments", fields, forbid_unknown_fields=True)
        schema = msgspec.json.schema(args_type)
        defs = schema.pop("$defs", {})
        top = dict(defs.pop(args_type.__name__, {"type": "object", "properties": {}}))
        top.pop("title", None)
        if defs:
            top["$defs"] = defs
        tools[name] = ToolSpec(
            name, description, attr, args_type, top, inspect.iscoroutinefunction(fn)
        )
    return tools


# -- OpenEnv's tool actions and observations (``step``) --------------------------


class ListToolsAction(
    msgspec.Struct, tag="list_tools", tag_field="type", forbid_unknown_fields=True
):
    """``{"type": "list_tools"}``: ask for the tools (OpenEnv's ``ListToolsAction``)."""


class CallToolAction(msgspec.Struct, tag="call_tool", tag_field="type", forbid_unknown_fields=True):
    """``{"type": "call_tool", "tool_name": ..., "arguments": {...}}`` (OpenEnv's)."""

    tool_name: str
    arguments: dict[str, Any] = {}


ToolAction = ListToolsAction | CallToolAction


class ToolInfo(msgspec.Struct):
    """One tool as a ``list_tools`` observation lists it (OpenEnv's ``Tool``)."""

    name: str
    description: str
    input_schema: dict[str, Any]


class ToolFailure(msgspec.Struct):
    """Why a ``call_tool`` step failed (OpenEnv's ``ToolError``): ``error_type`` is
    ``tool_not_found``, ``invalid_args`` or ``execution_error``."""

    error_type: str
    message: str


class ToolObservation(msgspec.Struct, omit_defaults=True):
    """A tool step's observation, in OpenEnv's shapes: ``{"tools": [...]}`` after
    ``list_tools``; ``{"tool_name", "result", "error"}`` after ``call_tool``."""

    tools: list[ToolInfo] | None = None
    tool_name: str | None = None
    result: Any = None
    error: ToolFailure | None = None


def tool_result(value: Any) -> dict[str, Any]:
    """A tool's return value as a call result (FastMCP's ``CallToolResult`` fields, as
    OpenEnv sends them): text content, structured content and ``data``."""
    data = msgspec.to_builtins(value, enc_hook=enc_hook_default)
    text = data if isinstance(data, str) else msgspec.json.encode(data).decode()
    return {
        "content": [{"type": "text", "text": text}],
        "structured_content": {"result": data},
        "meta": None,
        "data": data,
        "is_error": False,
    }


class ToolEnvironment(Environment[ToolAction, ToolObservation, State]):
    """An environment of tools (methods marked :func:`tool`); see the module docstring.

    ``blocking = False`` (the default here): sync tools run inline on the event
    loop, so they must be quick; set ``blocking = True`` to run them on a thread.
    Override :meth:`reset` to reset the instance's own state; the default returns
    the tool list.
    """

    blocking: ClassVar[bool] = False
    tools: ClassVar[dict[str, ToolSpec]] = {}
    schema_extra: ClassVar[dict[str, Any]] = {}
    """Extra ``GET /schema`` keys: ``tools`` (the tool list) is added to them."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.tools = compile_tools(cls)
        cls.schema_extra = {**cls.schema_extra, "tools": cls.tool_list()}

    @classmethod
    def tool_list(cls) -> list[dict[str, Any]]:
        """Every tool's MCP description (``tools/list``)."""
        return [spec.describe() for spec in cls.tools.values()]

    def tools_observation(self) -> ToolObservation:
        """The ``list_tools`` observation."""
        return ToolObservation(
            tools=[ToolInfo(t.name, t.description, t.input_schema) for t in self.tools.values()]
        )

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        return self.tools_observation()

    async def call_tool(self, name: str, arguments: Any) -> Any:
        """Run tool ``name`` on this instance; its return value (raises :class:`ToolCallError`
        for an unknown tool or bad arguments, else what the tool raises)."""
        spec = self.tools.get(name)
        if spec is None:
            raise ToolCallError(
                f"unknown tool {name!r}; the tools are: {', '.join(self.tools) or 'none'}",
                tool=name,
            )
        kwargs = spec.arguments(arguments)
        method = getattr(self, spec.method)
        if spec.is_async:
            return await method(**kwargs)
        if self.blocking:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(None, lambda: method(**kwargs))
        return method(**kwargs)

    async def step(self, action: ToolAction) -> StepResult[ToolObservation]:
        if isinstance(action, ListToolsAction):
            return StepResult(self.tools_observation())
        name = action.tool_name
        try:
            value = await self.call_tool(name, action.arguments)
        except ToolCallError as exc:
            kind = "invalid_args" if name in self.tools else "tool_not_found"
            return StepResult(ToolObservation(tool_name=name, error=ToolFailure(kind, exc.message)))
        except Exception as exc:
            failure = ToolFailure("execution_error", describe_exception(exc))
            return StepResult(ToolObservation(tool_name=name, error=failure))
        if isinstance(value, StepResult):
            obs = ToolObservation(tool_name=name, result=tool_result(value.observation))
            return StepResult(
                obs, value.reward, value.done, truncated=value.truncated, info=value.info
            )
        return StepResult(ToolObservation(tool_name=name, result=tool_result(value)))

    # -- what _mcp calls (POST /mcp, the "mcp" message) ------------------------

    async def mcp_list_tools(self) -> list[dict[str, Any]]:
        return self.tool_list()

    async def mcp_call_tool(self, name: str, arguments: Any) -> dict[str, Any]:
        value = await self.call_tool(name, arguments)
        if isinstance(value, StepResult):
            value = value.observation
        return tool_result(value)

    def sample_action(self, rng: random.Random) -> ToolAction:
        """``list_tools``, or a call of a random tool with random arguments of its schema's
        simple types (so ``stadium check`` exercises the tools). Tools whose required
        parameters are not strings, numbers, booleans or enums are left out."""
        calls: list[CallToolAction] = []
        for spec in self.tools.values():
            arguments = sample_arguments(spec.input_schema, rng)
            if arguments is not None:
                calls.append(CallToolAction(tool_name=spec.name, arguments=arguments))
        if not calls or rng.random() < 1 / (len(calls) + 1):
            return ListToolsAction()
        return calls[rng.randrange(len(calls))]


def sample_arguments(schema: dict[str, Any], rng: random.Random) -> dict[str, Any] | None:
    """Random values for the required parameters of ``schema`` (``None``: not simple)."""
    properties = schema.get("properties", {})
    arguments: dict[str, Any] = {}
    for name in schema.get("required", ()):
        prop = properties.get(name, {})
        kind = prop.get("type")
        if "enum" in prop:
            arguments[name] = rng.choice(prop["enum"])
        elif kind == "string":
            arguments[name] = str(rng.randint(0, 9))
        elif kind == "integer":
            arguments[name] = rng.randint(0, 9)
        elif kind == "number":
            arguments[name] = float(rng.randint(1, 9))
        elif kind == "boolean":
            arguments[name] = rng.random() < 0.5
        else:
            return None
    return arguments


__all__ = [
    "CallToolAction",
    "ListToolsAction",
    "ToolAction",
    "ToolEnvironment",
    "ToolObservation",
    "ToolSpec",
    "compile_tools",
    "sample_arguments",
    "tool",
    "tool_result",
]
