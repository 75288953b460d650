"""``swe``: fix a repository so that its failing tests pass (SWE-bench style), graded unforgeably.

A task is a repository with a failing test: in a task image (``image``, the repository at
``repo`` inside it), or, without images, a host directory copied into the session's work
directory at each reset. Tasks come from a JSONL file in SWE-bench's shape (``docs/SWE.md``)::

    stadium serve swe --isolation sandbox --images 'localhost/stadium-swe-*' \\
        --env-kwargs '{"tasks": "examples/swe/tasks.jsonl"}'

``reset(seed=..., options={"task": ID})`` picks a task (by id, else by seed; with images
the client also names the task's image: ``options={"task": ID, "image": IMAGE}``, what
:func:`reset_options` returns). The policy works with tools (MCP ``tools/list`` /
``tools/call``, or ``step`` with ``{"type": "call_tool", ...}``): ``task``, ``read_file``,
``write_file``, ``edit_file`` (replace one exact occurrence), ``list_dir``, ``run`` (a shell
line in the repository; output bounded, a timeout) and ``submit``. The episode ends on
``submit`` (reward 1.0 when every FAIL_TO_PASS and PASS_TO_PASS test passes, else 0.0) or
when ``max_steps`` tool calls were made (then the work is graded as if submitted and the
result is ``truncated``).

Grading (:mod:`stadium.envs.swe_grading`) restores every file the policy may not change
from the copy taken at reset, runs the named tests with Stadium's own runner and believes
only the per-test results it reads from a pipe made for that run; see ``docs/SWE.md`` for
what that stops and what it does not.
"""

from __future__ import annotations

import asyncio
import functools
import os
import random
import shutil
import sys
from collections.abc import Sequence
from typing import Any, ClassVar

import msgspec

from stadium._env.contract import StepResult
from stadium._env.tool_env import (
    CallToolAction,
    ToolAction,
    ToolEnvironment,
    ToolObservation,
    tool,
    tool_result,
)
from stadium._env.workspace import DirEntry, Workspace, current_image
from stadium._errors import ConfigError, ExecutionError, SessionError, ValidationError
from stadium.envs.swe_grading import (
    GradingError,
    GradingVerdict,
    Pristine,
    Rules,
    restore,
    run_tests,
)

#: The largest tasks file read.
MAX_TASKS_BYTES = 64 << 20
#: The most characters a tool's text result carries (the rest is cut, visibly).
MAX_TEXT = 16384


class SweTask(msgspec.Struct, frozen=True):
    """One task: SWE-bench's fields (others in a line are ignored) and Stadium's own.

    ``FAIL_TO_PASS``/``PASS_TO_PASS``: test ids (unittest dotted names, pytest node ids or
    Django's ``test (module.Class)``), as lists or as SWE-bench's JSON-encoded strings.
    ``image``: the task's image (``None``: ``repo`` is a host directory, copied into the
    session's work directory at reset; or ``files``, the repository inline, path -> text).
    ``src_paths``: if given, the only paths the policy
    may change. ``python``: the interpreter the tests run under (in the image).
    """

    instance_id: str
    problem_statement: str
    FAIL_TO_PASS: list[str]
    PASS_TO_PASS: list[str] = []
    image: str | None = None
    repo: str = "/repo"
    test_command: str = ""
    test_files: list[str] = []
    src_paths: list[str] = []
    base_commit: str | None = None
    python: str = "python3"
    files: dict[str, str] = {}

    @property
    def tests(self) -> list[str]:
        return [*self.FAIL_TO_PASS, *self.PASS_TO_PASS]


_DEMO_OPS = '''"""Small numeric helpers."""


def absolute(x):
    """The absolute value of ``x``."""
    return x
'''
_DEMO_TESTS = """import unittest

from calc.ops import absolute


class TestAbsolute(unittest.TestCase):
    def test_positive(self):
        self.assertEqual(absolute(3), 3)

    def test_negative(self):
        self.assertEqual(absolute(-4), 4)
"""
#: The task served when no tasks are given (``stadium serve swe``): a one-line bug, inline.
DEMO_TASK = SweTask(
    instance_id="demo-abs",
    problem_statement="calc.ops.absolute(x) returns negative numbers unchanged: fix it.",
    FAIL_TO_PASS=["tests.test_ops.TestAbsolute.test_negative"],
    PASS_TO_PASS=["tests.test_ops.TestAbsolute.test_positive"],
    repo="",
    test_command="python3 -m unittest -v tests.test_ops",
    test_files=["tests/test_ops.py"],
    files={
        "calc/__init__.py": "",
        "calc/ops.py": _DEMO_OPS,
        "tests/__init__.py": "",
        "tests/test_ops.py": _DEMO_TESTS,
    },
)


_TASK = msgspec.json.Decoder(SweTask)


def _listish(raw: dict[str, Any], key: str) -> None:
    """SWE-bench stores its test lists as JSON text: decode them in place."""
    value = raw.get(key)
    if isinstance(value, str):
        try:
            raw[key] = msgspec.json.decode(value)
        except msgspec.DecodeError:
            raw[key] = [value]


def parse_tasks(lines: Sequence[bytes | dict[str, Any]], where: str) -> tuple[SweTask, ...]:
    """Tasks from JSONL lines (or dicts); :class:`ConfigError` naming the line that is wrong."""
    tasks: dict[str, SweTask] = {}
    for number, line in enumerate(lines, 1):
        if isinstance(line, bytes) and not line.strip():
            continue
        try:
            raw = msgspec.json.decode(line) if isinstance(line, bytes) else dict(line)
            if not isinstance(raw, dict):
                raise ConfigError("is not a JSON object")
            _listish(raw, "FAIL_TO_PASS")
            _listish(raw, "PASS_TO_PASS")
            task = msgspec.convert(raw, SweTask)
        except (msgspec.DecodeError, msgspec.ValidationError, ConfigError) as exc:
            reason = exc.message if isinstance(exc, ConfigError) else str(exc)
            raise ConfigError(
                f"{where}, task {number}: {reason} (a task is a JSON object with instance_id, "
                "problem_statement, FAIL_TO_PASS, and image/repo: see docs/SWE.md)"
            ) from None
        if not task.FAIL_TO_PASS:
            raise ConfigError(f"{where}, task {number} ({task.instance_id}): FAIL_TO_PASS is empty")
        if task.instance_id in tasks:
            raise ConfigError(f"{where}, task {number}: instance_id {task.instance_id!r} twice")
        if task.image is None and not task.files and not os.path.isabs(task.repo):
            raise ConfigError(
                f"{where}, task {number} ({task.instance_id}): a task without an image needs "
                "repo as an absolute host directory (or its files inline)"
            )
        tasks[task.instance_id] = task
    if not tasks:
        raise ConfigError(f"{where} holds no task")
    return tuple(tasks.values())


def load_tasks(tasks: str | Sequence[dict[str, Any]] | None) -> tuple[SweTask, ...]:
    """The tasks of a JSONL file (a path) or of a list of task objects (``None``: the demo)."""
    if tasks is None:
        return (DEMO_TASK,)
    if not isinstance(tasks, str):
        return parse_tasks(list(tasks), "the tasks list")
    return parse_tasks(_read_tasks(tasks).split(b"\n"), tasks)


def task_rows(path: str) -> list[dict[str, Any]]:
    """A JSONL tasks file's rows as objects (checked as tasks first: the errors name the line)."""
    data = _read_tasks(path)
    parse_tasks(data.split(b"\n"), path)
    return [msgspec.json.decode(line) for line in data.split(b"\n") if line.strip()]


def _read_tasks(tasks: str) -> bytes:
    try:
        with open(tasks, "rb") as f:
            data = f.read(MAX_TASKS_BYTES + 1)
    except OSError as exc:
        raise ConfigError(
            f"cannot read the SWE tasks file {tasks!r}: {exc.strerror or exc} (pass "
            '--env-kwargs \'{"tasks": "PATH.jsonl"}\' with a path the server can read)'
        ) from None
    if len(data) > MAX_TASKS_BYTES:
        raise ConfigError(f"the SWE tasks file {tasks!r} is over {MAX_TASKS_BYTES} bytes")
    return data


def reset_options(task: SweTask) -> dict[str, Any]:
    """The ``reset`` options that start ``task``: its id, and its image if it has one."""
    options: dict[str, Any] = {"task": task.instance_id}
    if task.image is not None:
        options["image"] = task.image
    return options


class TaskInfo(msgspec.Struct):
    """What the policy is asked to do (the ``task`` tool, and the reset observation).
    ``repo``: where the repository is (``"."``: the session's work directory); tools take
    paths relative to it and commands run in it."""

    instance_id: str
    problem_statement: str
    repo: str
    test_command: str
    steps_left: int


class CommandOutput(msgspec.Struct):
    """A command's end: exit code (``None``: killed at its timeout) and its bounded output."""

    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool = False


class Graded(msgspec.Struct):
    """The result of grading: ``resolved`` (every test passed) and how each test did."""

    resolved: bool
    tests: dict[str, str]
    problems: list[str]
    restored: list[str]
    output: str


def _cut(text: str, limit: int = MAX_TEXT) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n[... cut: {len(text) - limit} more characters]"


class SweEnv(ToolEnvironment):
    """Fix a repository so that its failing tests pass; reward 1.0 if all its tests pass.

    Args:
        tasks: a JSONL file of tasks (SWE-bench's shape, ``docs/SWE.md``) or a list of them;
            ``None``: one small demo task (:data:`DEMO_TASK`, no image needed).
        max_steps: tool calls per episode; at the last one the work is graded and the
            episode ends (``truncated``).
        command_timeout_s: the longest a ``run`` may take (a call may ask for less).
        test_timeout_s: the longest the grading test run may take.
    """

    name = "swe"
    version = "1.0"
    description = "Fix a repository so that its failing tests pass (SWE-bench style tasks)"
    isolation: ClassVar[str] = "sandbox"
    blocking: ClassVar[bool] = True

    @classmethod
    def prepare_kwargs(cls, env_kwargs: dict[str, Any]) -> dict[str, Any]:
        """``tasks=PATH`` read by the server, before the sessions' processes (whose ``/``
        is a task image) are made: they get the rows inline."""
        tasks = env_kwargs.get("tasks")
        if isinstance(tasks, str):
            return {**env_kwargs, "tasks": task_rows(tasks)}
        return env_kwargs

    def __init__(
        self, tasks: str | Sequence[dict[str, Any]] | None = None, max_steps: int = 50,
        command_timeout_s: float = 60.0, test_timeout_s: float = 300.0,
    ) -> None:  # fmt: skip
        self.tasks = load_tasks(tasks)
        self.by_id = {t.instance_id: t for t in self.tasks}
        if max_steps < 1:
            raise ConfigError(f"max_steps must be at least 1, not {max_steps}")
        self.max_steps = max_steps
        self.command_timeout_s = command_timeout_s
        self.test_timeout_s = test_timeout_s
        self.current: SweTask | None = None
        self.repo = ""
        self.steps = 0
        self.done = False
        self.pristine: Pristine | None = None
        self._ws: Workspace | None = None

    # -- episodes ---------------------------------------------------------------------

    def _workspace(self) -> Workspace:
        if self._ws is None:
            self._ws = Workspace.current()
        return self._ws

    def _choose(self, seed: int | None, options: dict[str, Any]) -> SweTask:
        wanted = options.get("task")
        if wanted is not None:
            task = self.by_id.get(wanted) if isinstance(wanted, str) else None
            if task is None:
                shown = ", ".join(list(self.by_id)[:20])
                raise ValidationError(
                    f"no SWE task {wanted!r}: choose one of {shown}"
                    + (" ..." if len(self.by_id) > 20 else ""),
                    field="$.options.task",
                )
            return task
        image = options.get("image")
        pool = [t for t in self.tasks if image is None or t.image == image] or list(self.tasks)
        return random.Random(seed).choice(pool)

    def _place(self, task: SweTask, options: dict[str, Any]) -> str:
        """The repository's path in the session, ready for the episode."""
        ws = self._workspace()
        if task.image is None:
            target = os.path.join(ws.root, "repo")
            if os.path.islink(target) or os.path.isfile(target):
                os.unlink(target)  # (the policy's: never followed)
            elif os.path.lexists(target):
                shutil.rmtree(target)
            try:
                if task.files:
                    for rel, text in task.files.items():
                        ws.write_file(os.path.join(target, rel), text)
                else:
                    shutil.copytree(task.repo, target, symlinks=True)
            except OSError as exc:
                raise ConfigError(
                    f"task {task.instance_id}: cannot copy its repository {task.repo}: {exc}"
                ) from None
            return target
        chosen = options.get("image")
        if current_image() is None or (chosen is not None and chosen != task.image):
            runs = "no image" if current_image() is None else f"image {chosen}"
            raise SessionError(
                f"task {task.instance_id} runs in image {task.image}, but this session runs "
                f"{runs}: serve with --isolation sandbox --images allowing it and reset with "
                f"options={reset_options(task)!r}"
            )
        if not os.path.isdir(task.repo):
            raise SessionError(
                f"task {task.instance_id}: its repository {task.repo} is not in this session's "
                f"image: reset with options={reset_options(task)!r} (the server's --image may "
                "be another task's)"
            )
        return task.repo

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> ToolObservation:
        task = self._choose(seed, options or {})
        # Nothing the last episode started may run on: it could rewrite the fresh copy of
        # the repository before the pristine copy is read from it (an image's session
        # starts each episode in a fresh process; without one the workspace stays).
        self._workspace().stop_others()
        self.repo = self._place(task, options or {})
        self.pristine = Pristine.capture(self.repo)
        self.current, self.steps, self.done = task, 0, False
        obs = self.tools_observation()
        obs.tool_name = "task"
        obs.result = tool_result(self.task_info())
        return obs

    def _path(self, path: str) -> str:
        return path if os.path.isabs(path) else os.path.join(self.repo, path)

    async def call_tool(self, name: str, arguments: Any) -> Any:
        if self.current is None:
            raise SessionError("no task yet: reset first")
        if self.done:
            raise SessionError("the episode is over (submitted or out of steps): reset")
        if self.steps >= self.max_steps:  # (over MCP: step() grades at the last one)
            raise SessionError(f"out of steps: the episode's {self.max_steps} calls are used")
        self.steps += 1
        return await super().call_tool(name, arguments)

    async def step(self, action: ToolAction) -> StepResult[ToolObservation]:
        result = await super().step(action)
        if (
            isinstance(action, CallToolAction)
            and not self.done
            and self.current is not None
            and self.steps >= self.max_steps
        ):
            graded = await asyncio.get_running_loop().run_in_executor(None, self.grade)
            self.done = True
            result.observation.result = {
                "last_call": result.observation.result,
                "graded": msgspec.to_builtins(graded),
            }
            return StepResult(
                result.observation, reward=1.0 if graded.resolved else 0.0, done=True,
                truncated=True, info={"resolved": graded.resolved, "steps": self.steps},
            )  # fmt: skip
        return result

    def grade(self) -> Graded:
        """Grade the repository as it is now (restoring what the policy may not change)."""
        assert self.current is not None
        assert self.pristine is not None
        task, pristine = self.current, self.pristine
        rules = Rules(tuple(task.test_files), tuple(task.src_paths), tuple(task.tests))
        try:  # first, nothing the policy started may run on (and rewrite a test after this)
            self._workspace().stop_others()
        except ExecutionError as exc:
            problem = f"not graded: {exc.message}"
            return Graded(False, dict.fromkeys(task.tests, "missing"), [problem], [], "")
        try:
            restored = restore(self.pristine, rules)
        except GradingError as exc:
            return Graded(False, dict.fromkeys(task.tests, "missing"), [exc.message], [], "")
        if current_image() is None:
            python: str | None = sys.executable
        else:
            python = shutil.which(task.python, path=self._workspace().env.get("PATH"))
        if python is None:
            problem = f"no {task.python} in the image to run the tests with"
            return Graded(False, dict.fromkeys(task.tests, "missing"), [problem], restored, "")
        env = {
            "PATH": self._workspace().env.get("PATH", "/usr/bin:/bin"),
            "LANG": "C.UTF-8",
            "HOME": self.repo,
        }
        verdict: GradingVerdict = run_tests(
            self.repo, task.tests, python=python, timeout_s=self.test_timeout_s, env=env,
            workspace=self._workspace(), vouch=functools.cache(lambda p: pristine.vouch(p, rules)),
        )  # fmt: skip
        return Graded(verdict.resolved, verdict.tests, verdict.problems, restored, verdict.output)

    def task_info(self) -> TaskInfo:
        task = self.current
        assert task is not None
        return TaskInfo(
            task.instance_id, task.problem_statement, task.repo if task.image else ".",
            task.test_command,
            self.max_steps - self.steps,
        )  # fmt: skip

    # -- tools ------------------------------------------------------------------------

    @tool
    def task(self) -> TaskInfo:
        """The task: the problem to fix, where the repository is, how to run its tests."""
        return self.task_info()

    @tool
    def read_file(self, path: str, start_line: int = 1, max_lines: int = 400) -> str:
        """A file's text (path relative to the repository), from start_line (1-based), at
        most max_lines lines; a cut is marked."""
        text = self._workspace().read_file(self._path(path), max_bytes=8 << 20)
        lines = text.splitlines(keepends=True)
        first = max(start_line, 1) - 1
        part = lines[first : first + max(max_lines, 1)]
        out = "".join(part)
        if first + len(part) < len(lines):
            out += f"[... {len(lines) - first - len(part)} more lines: read from line "
            out += f"{first + len(part) + 1}]\n"
        return _cut(out)

    @tool
    def write_file(self, path: str, content: str) -> str:
        """Write a whole file (path relative to the repository), making its folders."""
        self._workspace().write_file(self._path(path), content)
        return f"wrote {len(content.encode())} bytes to {path}"

    @tool
    def edit_file(self, path: str, old_str: str, new_str: str) -> str:
        """Replace the one occurrence of old_str in a file by new_str (old_str must occur
        exactly once: include enough lines around the change)."""
        ws = self._workspace()
        full = self._path(path)
        text = ws.read_file(full, max_bytes=8 << 20)
        count = text.count(old_str) if old_str else 0
        if count != 1:
            raise ValidationError(
                f"old_str occurs {count} times in {path}: it must occur exactly once "
                "(copy it from read_file, with a line or two around it)"
            )
        ws.write_file(full, text.replace(old_str, new_str, 1))
        return f"edited {path}"

    @tool
    def list_dir(self, path: str = ".") -> list[DirEntry]:
        """The entries of a folder (relative to the repository): name, kind, size."""
        return self._workspace().list_dir(self._path(path))[:1000]

    @tool
    def run(self, command: str, timeout_s: float = 60.0) -> CommandOutput:
        """Run a shell line in the repository (e.g. its test command); output is bounded,
        the command is killed at timeout_s (at most the env's limit)."""
        limit = max(0.1, min(timeout_s, self.command_timeout_s))
        res = self._workspace().run(command, cwd=self.repo, timeout=limit, max_output=MAX_TEXT)
        return CommandOutput(res.exit_code, res.stdout, res.stderr, res.timed_out)

    @tool
    def submit(self) -> StepResult[Graded]:
        """End the episode: the task's tests are run on the repository as it is; reward 1.0
        if every one of them passes."""
        graded = self.grade()
        self.done = True
        return StepResult(
            graded, reward=1.0 if graded.resolved else 0.0, done=True,
            info={"resolved": graded.resolved, "steps": self.steps},
        )  # fmt: skip

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_ws"}

    def close(self) -> None:
        if self._ws is not None:
            self._ws.close()
            self._ws = None
