"""``code``: the policy writes a Python function; it runs against the task's tests; the
reward is the share of tests passed.

Each step's code runs in a fresh ``python -I`` subprocess of the session (bounded by
``timeout_s``), in the session's work directory. Served as it asks
(``isolation = "sandbox"``), that is the session's own sandbox: no network, its own
uid, memory, process and disk limits (README, "Isolated sessions"); so the policy's
code can do what it likes to it and nothing else.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from typing import Any, ClassVar

import msgspec

from stadium._env.contract import Environment, State, StepResult


class Task(msgspec.Struct, frozen=True):
    """A function to write and the calls that test it."""

    name: str
    prompt: str
    function: str
    tests: list[tuple[list[Any], Any]]


TASKS: tuple[Task, ...] = (
    Task("add", "Write add(a, b) returning a + b.", "add",
         [([1, 2], 3), ([-1, 1], 0), ([10, 32], 42)]),
    Task("reverse", "Write reverse(s) returning the string s reversed.", "reverse",
         [(["abc"], "cba"), ([""], ""), (["racecar"], "racecar")]),
    Task("fizzbuzz", "Write fizzbuzz(n): 'Fizz' if n % 3 == 0, 'Buzz' if n % 5 == 0, "
         "'FizzBuzz' if both, else str(n).", "fizzbuzz",
         [([3], "Fizz"), ([5], "Buzz"), ([15], "FizzBuzz"), ([7], "7")]),
    Task("primes", "Write primes(n) returning the list of primes below n.", "primes",
         [([10], [2, 3, 5, 7]), ([2], []), ([20], [2, 3, 5, 7, 11, 13, 17, 19])]),
)  # fmt: skip

_RUNNER = """
import json, sys
spec = json.loads(sys.argv[1])
results = []
try:
    scope = {"__name__": "submission"}
    exec(compile(open("submission.py").read(), "submission.py", "exec"), scope)
    fn = scope[spec["function"]]
except BaseException as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
    sys.exit(0)
for args, expected in spec["tests"]:
    call = f"{spec['function']}{tuple(args)!r}"
    try:
        got = fn(*args)
        ok = got == expected
        results.append([ok, None if ok else f"{call} returned {got!r}, expected {expected!r}"])
    except BaseException as exc:
        results.append([False, f"{call} raised {type(exc).__name__}: {exc}"])
print(json.dumps({"results": results}))
"""


class CodeAction(msgspec.Struct):
    """Python source defining the task's function."""

    code: str


class CodeObservation(msgspec.Struct):
    """The task, and how the last submission did."""

    task: str
    prompt: str
    passed: int = 0
    total: int = 0
    failures: list[str] = msgspec.field(default_factory=list)
    output: str = ""


class CodeEnv(Environment[CodeAction, CodeObservation, State]):
    """Write the function the prompt asks for; reward = the share of its tests passed.

    ``reset(seed=..., options={"task": "primes"})`` picks the task (by name, else by
    seed); an episode ends when every test passes or after ``max_attempts`` steps.
    """

    name = "code"
    version = "1.0"
    description = "Write a Python function; reward = tests passed (run in a sandbox)"
    isolation: ClassVar[str] = "sandbox"
    max_attempts: ClassVar[int] = 5

    def __init__(self, timeout_s: float = 10.0) -> None:
        self.timeout_s = timeout_s
        self.task = TASKS[0]
        self.attempts = 0
        self._dir: str | None = None

    def _workdir(self) -> str:
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="stadium-code-")
        return self._dir

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> CodeObservation:
        wanted = (options or {}).get("task")
        by_name = {t.name: t for t in TASKS}
        if wanted is not None:
            if wanted not in by_name:
                raise ValueError(f"no task {wanted!r}: choose one of {', '.join(by_name)}")
            self.task = by_name[wanted]
        else:
            self.task = random.Random(seed).choice(TASKS)
        self.attempts = 0
        return CodeObservation(self.task.name, self.task.prompt, total=len(self.task.tests))

    def step(self, action: CodeAction) -> StepResult[CodeObservation]:
        self.attempts += 1
        task = self.task
        folder = self._workdir()
        with open(os.path.join(folder, "submission.py"), "w") as f:
            f.write(action.code)
        spec = json.dumps({"function": task.function, "tests": task.tests})
        obs = CodeObservation(task.name, task.prompt, total=len(task.tests))
        report: dict[str, Any]
        try:
            run = subprocess.run(
                [sys.executable, "-I", "-c", _RUNNER, spec], cwd=folder, capture_output=True,
                text=True, timeout=self.timeout_s, env={"PATH": "/usr/bin:/bin"},
            )  # fmt: skip
            lines = run.stdout.strip().splitlines()
            report = json.loads(lines[-1]) if lines else {"error": "no output"}
            obs.output = (run.stdout[:-1] if not lines else "\n".join(lines[:-1]))[-2000:]
            obs.output += run.stderr[-2000:]
        except subprocess.TimeoutExpired:
            report = {"error": f"the code ran longer than {self.timeout_s:g} s"}
        except (json.JSONDecodeError, OSError) as exc:
            report = {"error": f"the tests could not be run: {exc}"}
        if "error" in report:
            obs.failures = [str(report["error"])]
        else:
            results: list[tuple[bool, str]] = report["results"]
            obs.passed = sum(1 for ok, _ in results if ok)
            obs.failures = [msg for ok, msg in results if not ok][:5]
        reward = obs.passed / obs.total if obs.total else 0.0
        done = obs.passed == obs.total or self.attempts >= self.max_attempts
        return StepResult(obs, reward=reward, done=done)

    def close(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def sample_action(self, rng: random.Random) -> CodeAction:
        """A submission that is right for ``add`` and wrong for the rest (``check_env``)."""
        return CodeAction(code="def add(a, b):\n    return a + b\n")
