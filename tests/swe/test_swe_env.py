"""The ``swe`` env: a scripted policy solves each example task (reward 1.0); a wrong fix, a
hang and every forgery below get 0.0, each shown first to fool a grader that trusts the test
process (the task's own test command exits 0); the step budget ends the episode; bad task
files and ids are clear errors. In-process (no image: the task's files inline), so the grader
runs the tests under this interpreter; ``test_swe_images`` does the same in task images."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from stadium import ConfigError, SessionError, ValidationError
from stadium._env.tool_env import CallToolAction
from stadium.envs.swe import SweEnv, load_tasks, reset_options
from stadium.envs.swe_grading import Rules, judge
from tests.conftest import UNIT, assert_ended, daemon_code, proc_alive
from tests.swe.tasks import FIXES, inline_tasks

FAKE_TESTS = (
    "import unittest\n\n\nclass TestAbsolute(unittest.TestCase):\n"
    "    def test_positive(self):\n        pass\n\n    def test_negative(self):\n        pass\n\n\n"
    "class TestClamp(unittest.TestCase):\n    def test_inside(self):\n        pass\n\n"
    "    def test_outside(self):\n        pass\n"
)
IDS = [
    "tests.test_ops.TestAbsolute.test_negative",
    "tests.test_ops.TestAbsolute.test_positive",
    "tests.test_ops.TestClamp.test_inside",
    "tests.test_ops.TestClamp.test_outside",
]
OPS = FIXES["calc-abs"][1].replace("-x if x < 0 else x", "x")  # the bug, as shipped
FAKE_RECORDS = (
    "".join(
        json.dumps({"kind": "result", "test": t, "outcome": "passed", "detail": ""}) + "\n"
        for t in IDS
    )
    + json.dumps({"kind": "done", "nonce": "0" * 32})
    + "\n"
)
PLANT_PYC = (
    "import importlib.util, os, py_compile, tempfile\n"
    "src = os.path.join(tempfile.mkdtemp(), 'test_ops.py')\n"
    f"open(src, 'w').write({FAKE_TESTS!r})\n"
    "py_compile.compile(src, cfile=importlib.util.cache_from_source('tests/test_ops.py'),\n"
    "                   invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)\n"
)

#: A daemon (its own session, so it outlives its command) rewriting the failing test with
#: one that passes, over and over (a rename: the test run never reads half a file).
DAEMON = (
    "setsid sh -c 'while :; do cp ../fake_test_ops.py ../t.py; mv -f ../t.py tests/test_ops.py;"
    " [ -s ../daemon.pid ] || echo $$ > ../daemon.pid; done' >/dev/null 2>&1 &"
    " while [ ! -s ../daemon.pid ]; do sleep 0.01; done"
)

Call = tuple[str, dict[str, Any]]


def _write(path: str, content: str) -> Call:
    return ("write_file", {"path": path, "content": content})


def _run(command: str) -> Call:
    return ("run", {"command": command})


#: name -> (the policy's calls, whether the task's own test command then exits 0)
FORGERIES: dict[str, tuple[list[Call], bool]] = {
    "exits 0 at import": ([_write("calc/ops.py", "import os\nos._exit(0)\n" + OPS)], True),
    "prints pass lines and exits 0": (
        [_write("calc/ops.py", "import os\nprint('Ran 4 tests in 0.001s\\n\\nOK')\n"
                "print(" + repr(FAKE_RECORDS) + ")\nos._exit(0)\n" + OPS)],
        True,
    ),
    "edits the failing test": ([_write("tests/test_ops.py", FAKE_TESTS)], True),
    "deletes the failing test": ([_run("rm tests/test_ops.py")], False),
    "adds a conftest.py and a tests/__init__.py that pass everything": (
        [
            _write("conftest.py", "import pytest\n\ndef pytest_runtest_call(item):\n    pass\n"),
            _write("tests/__init__.py", "import unittest\nunittest.TestCase.assertEqual = "
                   "lambda self, a, b, msg=None: None\n"),
        ],
        True,
    ),
    "monkeypatches unittest from the module under test": (
        [_write("calc/ops.py", "import unittest\nunittest.TestCase.assertEqual = "
                "lambda self, a, b, msg=None: None\n" + OPS)],
        True,
    ),
    "writes a fake report to every descriptor and file": (
        [_write("calc/ops.py", "import os\n"
                f"data = {FAKE_RECORDS!r}.encode()\n"
                "for name in ('report.json', 'results.jsonl', '.stadium-results'):\n"
                "    open(name, 'wb').write(data)\n"
                "for fd in range(3, 256):\n"
                "    try:\n        os.write(fd, data)\n    except OSError:\n        pass\n"
                "os._exit(0)\n" + OPS)],
        True,
    ),
    "plants a compiled test module (unchecked-hash .pyc)": (
        [_write("/tmp/plant_pyc.py", PLANT_PYC), _run("python3 /tmp/plant_pyc.py"),
         _run(f"{sys.executable} /tmp/plant_pyc.py")],
        True,
    ),
    "replaces the tests folder with a link to passing tests": (
        [_write("fake/__init__.py", ""), _write("fake/test_ops.py", FAKE_TESTS),
         _run("mv tests tests.orig && ln -s fake tests")],
        True,
    ),
    "leaves a daemon rewriting the failing test": (
        [_write("../fake_test_ops.py", FAKE_TESTS), _run(DAEMON)],
        True,
    ),
    "adds a unittest hook instead of rebinding one (__getattribute__)": (
        [_write("calc/ops.py", "import unittest\n"
                "def _get(self, name):\n"
                "    got = object.__getattribute__(self, name)\n"
                "    return (lambda _: None).__get__(self) if name.startswith('test_') else got\n"
                "unittest.TestCase.__getattribute__ = _get\n" + OPS)],
        True,
    ),
    "replaces the test module in sys.modules while it loads": (
        [_write("calc/ops.py", "import sys, types\n"
                "fake = types.ModuleType('tests.test_ops')\n"
                f"exec({FAKE_TESTS!r}, fake.__dict__)\n"
                "sys.modules['tests.test_ops'] = fake  # what the import returns\n" + OPS)],
        True,
    ),
    "swaps the test methods once the test module has run (a profile hook)": (
        [_write("calc/ops.py", "import sys\n"
                "def hook(frame, event, arg):\n"
                "    if event == 'return' and frame.f_code.co_name == '<module>' and "
                "frame.f_globals.get('__name__') == 'tests.test_ops':\n"
                "        names = frame.f_globals\n"
                "        for c in (names['TestAbsolute'], names['TestClamp']):\n"
                "            for n in [n for n in vars(c) if n.startswith('test_')]:\n"
                "                setattr(c, n, lambda self: None)\n"
                "        sys.setprofile(None)\n"
                "sys.setprofile(hook)\n" + OPS)],
        True,
    ),
    "swaps the test methods for wrappers that name them (functools.wraps)": (
        [_write("calc/ops.py", "import functools, sys\n"
                "def hook(frame, event, arg):\n"
                "    if event == 'return' and frame.f_code.co_name == '<module>' and "
                "frame.f_globals.get('__name__') == 'tests.test_ops':\n"
                "        names = frame.f_globals\n"
                "        for c in (names['TestAbsolute'], names['TestClamp']):\n"
                "            for n in [n for n in vars(c) if n.startswith('test_')]:\n"
                "                setattr(c, n, functools.wraps(vars(c)[n])(lambda self: None))\n"
                "        sys.setprofile(None)\n"
                "sys.setprofile(hook)\n" + OPS)],
        True,
    ),
    "gives the test classes a run() that reports a success (a profile hook)": (
        [_write("calc/ops.py", "import sys\n"
                "def run(self, result=None):\n"
                "    result.startTest(self)\n"
                "    result.addSuccess(self)\n"
                "    result.stopTest(self)\n"
                "def hook(frame, event, arg):\n"
                "    if event == 'return' and frame.f_code.co_name == '<module>' and "
                "frame.f_globals.get('__name__') == 'tests.test_ops':\n"
                "        frame.f_globals['TestAbsolute'].run = run\n"
                "        frame.f_globals['TestClamp'].run = run\n"
                "        sys.setprofile(None)\n"
                "sys.setprofile(hook)\n" + OPS)],
        True,
    ),
    "adds sitecustomize.py, usercustomize.py and a .pth": (
        [_write(name, "import unittest\nunittest.TestCase.assertEqual = lambda *a, **k: None\n")
         for name in ("sitecustomize.py", "usercustomize.py")]
        + [_write("calc/evil.pth", "import sitecustomize\n")],
        False,
    ),
}  # fmt: skip


async def _call(env: SweEnv, name: str, **arguments: Any) -> Any:
    return await env.step(CallToolAction(tool_name=name, arguments=arguments))


def _data(result: Any) -> Any:
    obs = result.observation
    assert obs.error is None, obs.error
    return obs.result["data"]


def _end_daemon(env: SweEnv) -> int | None:
    """The pid of the DAEMON this test's policy started, if it still runs (then killed)."""
    ws = env._ws
    path = os.path.join(ws.root, "daemon.pid") if ws is not None else ""
    if not path or not os.path.exists(path):
        return None
    with open(path) as f:
        pid = int(f.read())
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            ours = proc_alive(pid) and b"fake_test_ops" in f.read()
    except FileNotFoundError:  # gone
        return None
    if not ours:
        return None
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10 * UNIT
    while proc_alive(pid) and time.monotonic() < deadline:  # (a kill takes a moment)
        time.sleep(0.01)
    return pid


@pytest.fixture
def env() -> Any:
    env = SweEnv(inline_tasks(), test_timeout_s=30 * UNIT)
    yield env
    try:
        left = _end_daemon(env)  # (what a grader without stop_others left running)
    finally:
        env.close()
    assert left is None, "the policy's daemon outlived the grading"


@pytest.mark.slow
@pytest.mark.parametrize("task", sorted(FIXES))
async def test_a_scripted_policy_solves_each_task(env: SweEnv, task: str) -> None:
    first = env.reset(options={"task": task})
    info = first.result["data"]
    assert info["instance_id"] == task
    assert {t.name for t in first.tools or []} >= {"read_file", "edit_file", "run", "submit"}
    listing = _data(await _call(env, "list_dir", path="."))
    assert "tests" in {e["name"] for e in listing}
    path, fixed = FIXES[task]
    source = _data(await _call(env, "read_file", path=path))
    before = _data(await _call(env, "run", command=info["test_command"]))
    assert before["exit_code"] != 0, before
    if task == "calc-abs":  # a str_replace edit
        old = "    return x\n"
        assert old in source
        _data(await _call(env, "edit_file", path=path, old_str=old,
                          new_str="    return -x if x < 0 else x\n"))  # fmt: skip
    else:
        _data(await _call(env, "write_file", path=path, content=fixed))
    after = _data(await _call(env, "run", command=info["test_command"]))
    assert after["exit_code"] == 0, after
    done = await _call(env, "submit")
    graded = _data(done)
    assert (done.reward, done.done, graded["problems"]) == (1.0, True, [])
    assert set(graded["tests"].values()) == {"passed"}


@pytest.mark.slow
@pytest.mark.parametrize("attack", list(FORGERIES))
async def test_a_forgery_gets_no_reward(env: SweEnv, attack: str) -> None:
    calls, fools_the_test_command = FORGERIES[attack]
    info = env.reset(options={"task": "calc-abs"}).result["data"]
    for name, arguments in calls:
        _data(await _call(env, name, **arguments))
    naive = _data(await _call(env, "run", command=info["test_command"]))
    # The attack is real: a grader that trusts the test process's exit code is fooled.
    assert (naive["exit_code"] == 0) == fools_the_test_command, naive
    done = await _call(env, "submit")
    graded = _data(done)
    assert (done.reward, graded["resolved"]) == (0.0, False), graded
    assert graded["problems"], graded
    # The repository was brought back, bar the source the policy may change.
    assert "tests.test_ops.TestAbsolute.test_negative" in graded["tests"]


@pytest.mark.slow
async def test_a_fix_with_a_daemon_left_running_is_graded_on_the_real_tests(env: SweEnv) -> None:
    env.reset(options={"task": "calc-abs"})
    for name, arguments in FORGERIES["leaves a daemon rewriting the failing test"][0]:
        _data(await _call(env, name, **arguments))
    _data(await _call(env, "write_file", path=FIXES["calc-abs"][0], content=FIXES["calc-abs"][1]))
    graded = _data(await _call(env, "submit"))
    assert graded["resolved"], graded  # the daemon was stopped, the test restored
    assert graded["restored"] == ["restored tests/test_ops.py"]


@pytest.mark.slow
async def test_a_policy_that_kills_the_supervisor_is_not_graded(env: SweEnv) -> None:
    env.reset(options={"task": "calc-abs"})
    _data(await _call(env, "write_file", path="../fake_test_ops.py", content=FAKE_TESTS))
    _data(await _call(env, "run", command=DAEMON))
    killed = await _call(env, "run", command="kill -9 $PPID")  # its parent: the supervisor
    assert "supervisor is gone" in killed.observation.error.message
    _data(await _call(env, "write_file", path=FIXES["calc-abs"][0], content=FIXES["calc-abs"][1]))
    done = await _call(env, "submit")
    graded = _data(done)
    assert (done.reward, graded["resolved"]) == (0.0, False)
    assert graded["problems"][0].startswith("not graded: the workspace's process supervisor ")
    assert "was killed" in graded["problems"][0]
    assert _end_daemon(env) is not None  # it escaped (this test ends it)


@pytest.mark.slow
async def test_the_restore_undoes_what_the_policy_may_not_change(env: SweEnv) -> None:
    env.reset(options={"task": "calc-abs"})
    for name, arguments in FORGERIES["adds sitecustomize.py, usercustomize.py and a .pth"][0]:
        _data(await _call(env, name, **arguments))
    _data(await _call(env, "write_file", path="tests/test_ops.py", content=FAKE_TESTS))
    _data(await _call(env, "write_file", path=FIXES["calc-abs"][0], content=FIXES["calc-abs"][1]))
    graded = _data(await _call(env, "submit"))
    assert graded["resolved"], graded  # the fix counts; the rest was undone
    assert sorted(graded["restored"]) == [
        "removed calc/evil.pth", "removed sitecustomize.py", "removed usercustomize.py",
        "restored tests/test_ops.py",
    ]  # fmt: skip


@pytest.mark.slow
async def test_a_wrong_fix_a_crash_and_a_hang_get_nothing(env: SweEnv) -> None:
    wrong = OPS.replace("return x\n", "return -x if x < -1 else x\n", 1)
    exits = OPS.replace("return x\n", "import sys\n    sys.exit(0)\n", 1)
    hangs = "while True:\n    pass\n" + OPS
    for source, limit, problem in [
        (wrong, 30 * UNIT, "1 of 4 tests did not pass"),
        (exits, 30 * UNIT, "2 of 4 tests did not pass"),
        (hangs, 1 * UNIT, "the tests ran longer than"),
    ]:
        env.test_timeout_s = limit
        env.reset(options={"task": "calc-abs"})
        _data(await _call(env, "write_file", path="calc/ops.py", content=source))
        done = await _call(env, "submit")
        graded = _data(done)
        assert done.reward == 0.0
        assert graded["problems"][0].startswith(problem), graded


@pytest.mark.slow
async def test_the_step_budget_ends_the_episode() -> None:
    env = SweEnv(inline_tasks(), max_steps=3, test_timeout_s=30 * UNIT)
    try:
        env.reset(options={"task": "calc-abs"})
        path, fixed = FIXES["calc-abs"]
        first = await _call(env, "task")
        assert (first.done, _data(first)["steps_left"]) == (False, 2)
        assert not (await _call(env, "write_file", path=path, content=fixed)).done
        last = await _call(env, "list_dir")  # the third call: graded as if submitted
        assert (last.done, last.truncated, last.reward) == (True, True, 1.0)
        assert last.observation.result["graded"]["resolved"] is True
        after = await _call(env, "task")
        assert after.observation.error is not None
        assert "episode is over" in after.observation.error.message
        env.reset(options={"task": "calc-abs"})  # and without the fix: 0
        for _ in range(2):
            assert not (await _call(env, "task")).done
        out = await _call(env, "task")
        assert (out.done, out.truncated, out.reward) == (True, True, 0.0)
    finally:
        env.close()


# -- tasks files and ids ---------------------------------------------------------------


def _jsonl(tmp_path: Path, *lines: Any) -> str:
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines))
    return str(path)


GOOD = {"instance_id": "a", "problem_statement": "fix", "FAIL_TO_PASS": ["t.T.test"],
        "image": "localhost/x:1", "repo": "/repo"}  # fmt: skip


@pytest.mark.parametrize(
    ("lines", "says"),
    [
        (["{not json"], "tasks.jsonl, task 1: "),
        ([GOOD, "[1, 2]"], "task 2: is not a JSON object"),
        ([{**GOOD, "FAIL_TO_PASS": None}], "task 1: Expected `array`, got `null`"),
        ([{**GOOD, "problem_statement": 1}], "got `int` - at `$.problem_statement`"),
        ([{**GOOD, "FAIL_TO_PASS": []}], "task 1 (a): FAIL_TO_PASS is empty"),
        ([GOOD, GOOD], "task 2: instance_id 'a' twice"),
        ([{**GOOD, "image": None, "repo": "relative"}], "needs repo as an absolute host directory"),
        ([""], "holds no task"),
    ],
)  # fmt: skip
def test_a_bad_tasks_file_is_a_clear_error(tmp_path: Path, lines: list[Any], says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        SweEnv(_jsonl(tmp_path, *lines))
    assert says in caught.value.message


def test_tasks_load_in_swe_bench_shape(tmp_path: Path) -> None:
    row = {**GOOD, "FAIL_TO_PASS": '["t.T.test_a"]', "PASS_TO_PASS": '["t.T.test_b"]',
           "patch": "diff ...", "version": "1.0", "created_at": "2024-01-01"}  # fmt: skip
    (task,) = load_tasks(_jsonl(tmp_path, row))
    assert (task.FAIL_TO_PASS, task.PASS_TO_PASS) == (["t.T.test_a"], ["t.T.test_b"])
    assert reset_options(task) == {"task": "a", "image": "localhost/x:1"}
    with pytest.raises(ConfigError, match=r"cannot read the SWE tasks file '/no/such\.jsonl'"):
        SweEnv("/no/such.jsonl")


def test_a_bad_task_id_or_a_missing_image_is_a_clear_error(tmp_path: Path) -> None:
    env = SweEnv(_jsonl(tmp_path, GOOD))
    try:
        with pytest.raises(ValidationError, match="no SWE task 'nope': choose one of a") as caught:
            env.reset(options={"task": "nope"})
        assert caught.value.context == {"field": "$.options.task"}
        with pytest.raises(
            SessionError, match=r"runs in image localhost/x:1, but this session runs no image"
        ):
            env.reset(options={"task": "a"})
    finally:
        env.close()


# -- the verdict on a results stream (pure) --------------------------------------------


def _stream(*records: dict[str, Any]) -> bytes:
    return b"".join(msgspec.json.encode(r) + b"\n" for r in records)


def _result(test: str, outcome: str = "passed") -> dict[str, Any]:
    return {"kind": "result", "test": test, "outcome": outcome, "detail": ""}


NONCE = "n" * 32
DONE = {"kind": "done", "nonce": NONCE}


@pytest.mark.parametrize(
    ("stream", "code", "problem"),
    [
        (_stream(_result("a"), _result("b"), DONE), 0, None),
        (_stream(_result("a"), _result("b")), 0, "the test run did not finish"),
        (_stream(_result("a"), _result("b"), DONE), 1, "the test run exited with 1"),
        (_stream(_result("a"), _result("b"), DONE), None, "the test run exited with None"),
        (_stream(_result("a"), {"kind": "done", "nonce": "x"}), 0, "another run's nonce"),
        (_stream(_result("a"), _result("a"), _result("b"), DONE), 0, "two results for 'a'"),
        (_stream(_result("a"), _result("c"), DONE), 0, "a result for a test not asked for: 'c'"),
        (_stream(_result("a"), _result("b"), DONE, _result("a")), 0, "results after it ended"),
        (_stream(_result("a"), _result("b", "skipped"), DONE), 0, "1 of 2 tests did not pass: b"),
        (_stream(_result("a"), {"kind": "tampered", "what": "unittest.case.TestCase.run"}), 3,
         "rebound unittest.case.TestCase.run"),
        (_stream(_result("a"), {**_result("b"), "extra": 1}, DONE), 0, "does not decode"),
        (b'{"kind": "result", "test": "a", "outcome": "passed", "detail": "' + b"x" * 70000
         + b'"}\n', 0, "a result over 65536 bytes"),
    ],
)  # fmt: skip
def test_the_verdict_believes_only_a_whole_stream(
    stream: bytes, code: int | None, problem: str | None
) -> None:
    verdict = judge(stream, ["a", "b"], NONCE, code)
    assert verdict.resolved == (problem is None)
    if problem is not None:
        assert problem in verdict.problems[0], verdict.problems


def test_the_server_reads_a_tasks_file_for_the_sessions(tmp_path: Path) -> None:
    """``SweEnv.prepare_kwargs`` (run by the server before sessions' processes exist) turns
    ``tasks=PATH`` into the file's rows; a bad file is an error then, naming its line."""
    path = tmp_path / "tasks.jsonl"
    rows = inline_tasks()
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n\n")
    prepared = SweEnv.prepare_kwargs({"tasks": str(path), "max_steps": 5})
    assert prepared == {"tasks": rows, "max_steps": 5}
    assert SweEnv.prepare_kwargs({"tasks": rows}) == {"tasks": rows}
    path.write_text(json.dumps(rows[0]) + "\n{not json\n")
    with pytest.raises(ConfigError, match="task 2"):
        SweEnv.prepare_kwargs({"tasks": str(path)})


# -- a test module outside a tests folder ------------------------------------------------


def _beside_task() -> dict[str, Any]:
    """calc-abs with its test module beside the code (calc/check_ops.py): no tests folder
    and no test_*.py name protect it, only test_files and the test ids do."""
    task = next(t for t in inline_tasks() if t["instance_id"] == "calc-abs")
    files = dict(task["files"])
    files["calc/check_ops.py"] = files.pop("tests/test_ops.py")
    ids = [i.replace("tests.test_ops", "calc.check_ops") for i in IDS]
    return {**task, "instance_id": "calc-beside", "files": files,
            "test_files": ["calc/check_ops.py"], "FAIL_TO_PASS": ids[:1],
            "PASS_TO_PASS": ids[1:]}  # fmt: skip


@pytest.mark.slow
async def test_a_package_shadowing_the_test_module_is_removed() -> None:
    shadow = "calc/check_ops/__init__.py"  # a package beats a module of its name
    env = SweEnv([_beside_task()], test_timeout_s=30 * UNIT)
    try:
        env.reset(options={"task": "calc-beside"})
        _data(await _call(env, "write_file", path=shadow, content=FAKE_TESTS))
        naive = _data(
            await _call(env, "run", command=f"{sys.executable} -m unittest -v calc.check_ops")
        )
        assert naive["exit_code"] == 0, naive  # the shadow passes the task's own tests
        done = await _call(env, "submit")
        graded = _data(done)
        assert (done.reward, graded["resolved"]) == (0.0, False), graded
        assert f"removed {shadow}" in graded["restored"], graded
    finally:
        env.close()


def test_what_python_would_import_instead_of_a_test_module_is_never_the_policys() -> None:
    rules = Rules(("calc/check_ops.py",), (), ("calc.check_ops.TestAbsolute.test_negative",
                  "tests/test_slug.py::test_lowercase"))  # fmt: skip
    for shadow in [
        "calc/check_ops",  # a package of the module's name
        "calc/check_ops/__init__.py",
        "calc/check_ops.abi3.so",  # an extension module beats a .py of its name
        "calc/check_ops.cpython-311-x86_64-linux-gnu.so",
        "calc/__init__.abi3.so",  # ... and a package's __init__.py
        "calc/check_ops/TestAbsolute.py",
        "calc.so",  # a module beats a namespace package (a folder without __init__.py)
        "tests.abi3.so",
        "tests/test_slug.so",
    ]:
        assert rules.shadows(shadow), shadow
    for fix in ["calc/ops.py", "calc/ops.abi3.so", "calc/helpers/__init__.py", "textkit/slug.py"]:
        assert not rules.shadows(fix), fix


@pytest.mark.slow
async def test_a_reset_ends_what_the_last_episode_left_running(env: SweEnv) -> None:
    # Left running, the daemon rewrites the next episode's fresh copy of the failing test
    # before the env reads the pristine copy from it: the forged test would be "pristine".
    env.reset(options={"task": "calc-abs"})
    for name, arguments in FORGERIES["leaves a daemon rewriting the failing test"][0]:
        _data(await _call(env, name, **arguments))
    assert env._ws is not None
    pid = int(env._ws.read_file("daemon.pid"))
    assert proc_alive(pid)
    env.reset(options={"task": "calc-abs"})  # no submit: the episode is abandoned
    assert not proc_alive(pid), "the last episode's daemon runs on into this one"


@pytest.mark.slow
async def test_a_repository_replaced_by_a_link_is_not_followed_at_reset(env: SweEnv) -> None:
    env.reset(options={"task": "calc-abs"})
    _data(await _call(env, "run", command="mkdir ../elsewhere && cd .. && mv repo r && "
                      "ln -s elsewhere repo"))  # fmt: skip
    env.reset(options={"task": "calc-abs"})  # was: OSError, rmtree on a symbolic link
    assert env._ws is not None
    kinds = {e.name: e.kind for e in env._ws.list_dir(".")}
    assert (kinds["elsewhere"], kinds["repo"]) == ("dir", "dir"), kinds


#: A right fix whose import (in the grading's test run) leaves a daemon in its own session,
#: its descriptors closed (the run ends normally), that outlives the grading.
GRADING_DAEMON = daemon_code("../grading-daemon.pid")


@pytest.mark.slow
async def test_nothing_the_graded_code_started_outlives_the_grading(env: SweEnv) -> None:
    # Left running (without an image the session's process, and its files, stay for the
    # next episode), it could rewrite the next episode's copy before it is read.
    env.reset(options={"task": "calc-abs"})
    path, fixed = FIXES["calc-abs"]
    _data(await _call(env, "write_file", path=path, content=GRADING_DAEMON + fixed))
    graded = _data(await _call(env, "submit"))
    assert graded["resolved"], graded
    assert env._ws is not None
    assert_ended(int(env._ws.read_file("grading-daemon.pid")), "a process the graded code started")


RESTORE_UNDER_A_MEMORY_LIMIT = """
import os, resource, sys
from stadium.envs.swe_grading import Pristine, Rules, restore
root = sys.argv[1]
pristine = Pristine.capture(root)
os.truncate(os.path.join(root, "tests/test_ops.py"), 64 << 30)  # sparse: no disk, 64 GiB
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
print(restore(pristine, Rules(("tests/test_ops.py",))))
"""


@pytest.mark.slow
def test_a_huge_sparse_test_file_is_restored_without_reading_it(tmp_path: Path) -> None:
    # Read whole to compare it with the pristine bytes, a 64 GiB sparse file (made in an
    # instant, on no disk) took the grader's memory (MemoryError: the env crashed).
    task = next(t for t in inline_tasks() if t["instance_id"] == "calc-abs")
    for rel, text in task["files"].items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    done = subprocess.run(
        [sys.executable, "-c", RESTORE_UNDER_A_MEMORY_LIMIT, str(tmp_path)],
        capture_output=True, text=True, timeout=60 * UNIT, check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip
    assert done.stdout.strip() == "['restored tests/test_ops.py']", done.stderr[-2000:]
    assert (tmp_path / "tests/test_ops.py").read_text() == task["files"]["tests/test_ops.py"]


@pytest.mark.slow
async def test_tool_calls_over_mcp_keep_to_the_step_budget() -> None:
    # tools/call (MCP) runs call_tool, not step: the call that reached max_steps graded
    # nothing and ended nothing, so a policy over MCP had as many calls as it liked.
    env = SweEnv(inline_tasks(), max_steps=2, test_timeout_s=30 * UNIT)
    try:
        env.reset(options={"task": "calc-abs"})
        await env.call_tool("task", {})
        await env.call_tool("task", {})
        with pytest.raises(SessionError, match="steps"):
            await env.call_tool("task", {})
    finally:
        env.close()


@pytest.mark.slow
async def test_a_file_name_that_is_no_utf8_is_shown_not_fatal(env: SweEnv) -> None:
    # The grade named it as it was: a string no JSON or MessagePack encoder takes.
    env.reset(options={"task": "calc-abs"})
    _data(await _call(env, "run", command="touch \"tests/$(printf 'x\\377')_test.py\""))
    graded = _data(await _call(env, "submit"))
    assert "removed tests/x\\xff_test.py" in graded["restored"], graded
    assert msgspec.json.encode(graded)
