"""The ``code`` env's reward cannot be forged by the code it grades: submissions that print
a results line, exit early, write to every descriptor they hold, patch the harness or
return an object equal to everything pass no test, served as the env asks
(``isolation = "sandbox"``) and in-process; a right submission still gets 1.0."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import stadium
from stadium import ConfigError
from stadium.envs.code import MAX_MESSAGE, CodeAction, CodeEnv, run_tests
from tests.conftest import UNIT, assert_ended, daemon_code, serve
from tests.isolation.test_isolation import needs_sandbox

pytestmark = pytest.mark.slow
CODE_ENV = "code"  # the class asks for the sandbox itself

RESULTS = "{'results': [[True, None]] * 3}"  # the line the old runner printed, all passed

FORGERIES = {
    "prints a results line and exits": (
        "import json, os\n"
        "def add(a, b):\n"
        f"    print(json.dumps({RESULTS}), flush=True)\n"
        "    os._exit(0)\n"
    ),
    "prints a results line at import and exits": (
        f"import json, os\nprint(json.dumps({RESULTS}), flush=True)\nos._exit(0)\n"
    ),
    "writes a results line to every descriptor": (
        "import json, os\n"
        f"line = (json.dumps({RESULTS}) + '\\n').encode()\n"
        "for fd in range(256):\n"
        "    try:\n"
        "        os.write(fd, line)\n"
        "    except OSError:\n"
        "        pass\n"
        "os._exit(0)\n"
    ),
    "patches json.dumps": (
        "import json\n"
        f"json.dumps = (lambda real: lambda *a, **k: real({RESULTS}))(json.dumps)\n"
        "def add(a, b):\n    return -1\n"
    ),
    "returns an object equal to everything": (
        "class Same:\n"
        "    def __eq__(self, other):\n        return True\n"
        "class SameInt(int):\n"
        "    def __eq__(self, other):\n        return True\n"
        "answers = iter([Same(), SameInt(-7), Same()])\n"
        "def add(a, b):\n    return next(answers)\n"
    ),
    "exits 0 at import": "import sys\nsys.exit(0)\ndef add(a, b):\n    return a + b\n",
    "exits 0 before returning": "import os\ndef add(a, b):\n    os._exit(0)\n",
}

RIGHT = "def add(a, b):\n    return a + b\n"

# Sandboxed, the grader (the env's process, the submission's parent) is not dumpable: the
# submission, of the same uid, can neither open its memory nor its descriptors (its /proc
# entry is hidden: ``hidepid=2`` hides what the caller may not inspect).
REACHES_FOR_THE_GRADER = (
    "import os\n"
    "for path in ('/proc/%d/mem' % os.getppid(), '/proc/%d/fd/0' % os.getppid()):\n"
    "    try:\n"
    "        open(path, 'r+b')\n"
    "        print('opened', path)\n"
    "    except OSError as exc:\n"
    "        print('refused', type(exc).__name__)\n"
    "def add(a, b):\n    return -1\n"
)


async def _submit(env: stadium.AsyncClient[Any], code: str) -> Any:
    await env.reset(options={"task": "add"})
    return await env.step({"code": code})


@pytest.mark.parametrize("mode", ["none", pytest.param("sandbox", marks=needs_sandbox)])
async def test_a_submission_cannot_forge_its_reward(mode: str) -> None:
    async with serve(CODE_ENV, isolation=mode) as server:
        isolation = server.runtime.isolation
        assert (isolation is not None and isolation.sandbox) == (mode == "sandbox")
        async with stadium.AsyncClient(server.url) as env:
            for attack, code in FORGERIES.items():
                result = await _submit(env, code)
                assert (attack, result.reward, result.observation["passed"]) == (attack, 0.0, 0)
            if mode == "sandbox":
                reached = await _submit(env, REACHES_FOR_THE_GRADER)
                assert reached.reward == 0.0
                lines = reached.observation["output"].splitlines()
                assert [line.split()[0] for line in lines] == ["refused", "refused"], lines
            right = await _submit(env, RIGHT)
            assert (right.reward, right.observation["passed"], right.done) == (1.0, 3, True)


# The grader compares values its own decoder built, of the same type: a reply equal under
# Python's == but of another type (True for 1, 1.0 for 1, at any depth) passes no test,
# where the task declares a loose type (Any, a union). The first case of each is right.
@pytest.mark.parametrize(
    ("returns", "expected", "replies"),
    [
        (Any, 1, ["1", "True", "1.0"]),
        (int | bool, 1, ["1", "True"]),
        (int | float, 2, ["2", "2.0"]),
        (Any, [1, [2]], ["(1, [2])", "[True, [2]]", "[1, [2.0]]"]),  # a tuple is a JSON list
        (Any, {"a": 0}, ["{'a': 0}", "{'a': False}", "{'a': 0.0}"]),
        (Any, (1, 2), ["[1, 2]", "[1, True]"]),  # a tuple is sent as a JSON list
        (float, 3, ["3", "3.0", "True"]),  # the expected value, as the declared type: 3.0
    ],
)
def test_a_value_of_another_type_passes_no_test(
    tmp_path: Path, returns: Any, expected: Any, replies: list[str]
) -> None:
    source = "answers = iter([" + ", ".join(replies) + "])\ndef f():\n    return next(answers)\n"
    (tmp_path / "submission.py").write_text(source)
    tests = [([], expected)] * len(replies)
    report = run_tests(str(tmp_path), "f", tests, returns, timeout_s=30 * UNIT)
    right = 2 if returns is float else 1
    assert (report.passed, len(report.failures)) == (right, len(replies) - right), report


def test_a_huge_wrong_reply_is_cut_in_the_failure(tmp_path: Path) -> None:
    (tmp_path / "submission.py").write_text("def f():\n    return 'x' * 900_000\n")
    report = run_tests(str(tmp_path), "f", [([], "y")], str, timeout_s=30 * UNIT)
    assert report.passed == 0
    assert len(report.failures[0]) < 2 * MAX_MESSAGE, len(report.failures[0])


def test_an_expected_value_no_reply_could_equal_is_the_tasks_error(tmp_path: Path) -> None:
    (tmp_path / "submission.py").write_text("def f():\n    return 1\n")
    with pytest.raises(ConfigError, match="expected value"):
        run_tests(str(tmp_path), "f", [([], "1")], int, timeout_s=30 * UNIT)


DAEMON_AT_IMPORT = daemon_code("daemon.pid") + "def add(a, b):\n    return a + b\n"


def test_nothing_a_submission_started_outlives_its_step() -> None:
    # A daemon in a session of its own escaped the process group the grader killed, and
    # ran on through the session's later steps (writing, say, their submission.py).
    env = CodeEnv()
    try:
        env.reset(options={"task": "add"})
        result = env.step(CodeAction(code=DAEMON_AT_IMPORT))
        assert result.reward == 1.0, result.observation
        assert env._ws is not None
        assert_ended(int(env._ws.read_file("daemon.pid")), "a process the submission started")
    finally:
        env.close()


def test_the_next_submission_is_not_written_through_a_link(tmp_path: Path) -> None:
    # The grader wrote each step's code through a submission.py the last submission had
    # made a link: into any file the env's process may write (unsandboxed: the server's).
    target = tmp_path / "not-the-envs.txt"
    target.write_text("kept\n")
    env = CodeEnv()
    try:
        env.reset(options={"task": "add"})
        relink = (
            f"import os\nos.remove('submission.py')\nos.symlink({str(target)!r}, 'submission.py')\n"
        )
        env.step(CodeAction(code=relink + "def add(a, b):\n    return a + b\n"))
        result = env.step(CodeAction(code="def add(a, b):\n    return a + b\n"))
        assert result.reward == 1.0, result.observation
        assert target.read_text() == "kept\n"
    finally:
        env.close()
