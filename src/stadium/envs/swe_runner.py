"""The SWE env's test runner: runs named ``unittest`` tests and reports each outcome on a pipe.

This file is a *script*, never imported by Stadium: :mod:`stadium.envs.swe_grading` runs its
source with the task image's own ``python3 -I -c SOURCE CONTROL_FD RESULTS_FD`` in the
repository (so it must run on any Python 3.8+ and use the standard library only). It is
untrusted from the first test on (the tests import the repository's code, which may patch
anything in this process); the grader believes only what it decodes from the results pipe and
checks it against what it asked (see ``docs/SWE.md``).

Protocol. The grader writes one JSON line on CONTROL_FD (0: stdin, then ``/dev/null``),
``{"nonce": str, "tests": [id, ...]}``; the runner reads it before it imports any code of the
repository. On
RESULTS_FD it writes one JSON line per test, ``{"kind": "result", "test": id, "outcome":
"passed"|"failed"|"error"|"skipped", "detail": str, "sources": [path, ...]}`` (the files the
code of the test functions it ran came from), then ``{"kind": "done", "nonce": nonce}``,
and exits 0. If the unittest machinery, the builtins or this runner's own functions were
rebound while the tests ran (a module under test patching ``TestCase.assertEqual``), it
writes ``{"kind": "tampered", "what": name}`` instead and exits 3.

Test ids: unittest's dotted names (``tests.test_calc.TestAdd.test_neg``), pytest-style
node ids (``tests/test_calc.py::TestAdd::test_neg``, also a plain test function) or
Django's ``test_neg (tests.test_calc.TestAdd)``.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import json
import os
import sys
import types
import unittest
import unittest.case
import unittest.loader
import unittest.result
import unittest.suite
from collections.abc import Iterator
from typing import Any

with contextlib.suppress(ImportError):  # assertLogs' context (3.9+), else imported on first
    import unittest._log  # type: ignore[import-not-found,unused-ignore]  # use: unwatched

_write = os.write
_exit = os._exit
_dumps = json.dumps


def _unittest_modules() -> list[Any]:
    names = "unittest unittest.case unittest.result unittest.suite unittest.loader unittest.util"
    return [sys.modules[n] for n in (*names.split(), "unittest._log") if n in sys.modules]


_spaces: list[tuple[str, Any]] = []
_unittest_classes: set[int] = set()


def _watched() -> list[tuple[str, Any]]:
    """The namespaces whose bindings a forger would patch: the unittest modules and every
    class they define (an assertion's context manager included), the builtins, json, and
    this runner itself. A class's name ends with ``:`` (an attribute added to it counts:
    a ``__getattribute__`` or ``__init_subclass__`` it did not have changes its tests).
    Chosen once, before any repository code runs (a class unittest imports later is not
    one a forger could have patched before it existed)."""
    if _spaces:
        return _spaces
    spaces = _spaces
    spaces += [
        ("builtins", builtins.__dict__),
        ("json", json.__dict__),
        ("runner", globals()),
    ]
    classes: dict[int, Any] = {id(_Result): _Result}
    for mod in _unittest_modules():
        spaces.append((mod.__name__, mod.__dict__))
        for value in list(mod.__dict__.values()):
            if isinstance(value, type) and str(value.__module__).startswith("unittest"):
                classes[id(value)] = value
    for cls in classes.values():
        spaces.append((cls.__module__ + "." + cls.__qualname__ + ":", cls.__dict__))
    _unittest_classes.update(classes)
    return spaces


def _fingerprint() -> dict[str, tuple[int, ...]]:
    """Identity of every callable (and its code) bound in the watched namespaces."""
    marks: dict[str, tuple[int, ...]] = {}
    for space, names in _watched():
        for name, value in list(names.items()):
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if not callable(value) and name != "failureException":
                continue
            code = getattr(value, "__code__", None)
            defaults = getattr(value, "__defaults__", None)
            marks[space + "." + name] = (id(value), id(code), id(defaults))
    marks["modules"] = tuple(id(sys.modules.get(m)) for m in ("unittest", "json", "builtins"))
    return marks


def _changed(before: dict[str, tuple[int, ...]], after: dict[str, tuple[int, ...]]) -> str | None:
    for key, mark in before.items():
        if after.get(key) != mark:
            return key
    for key in after:  # a callable added to a class (a module may gain one: lazy imports)
        if key not in before and ":." in key:
            return key
    return None


class _Result(unittest.result.TestResult):
    """Everything that happened to one test id (several tests if the name was a class)."""

    def __init__(self) -> None:
        unittest.result.TestResult.__init__(self)
        self.bad: list[tuple[str, str]] = []
        self.passed_subtests = 0

    def addSubTest(self, test: Any, subtest: Any, err: Any) -> None:
        if err is not None:
            self.bad.append(("failed", f"subtest {subtest} failed"))
        else:
            self.passed_subtests += 1


def _name(test_id: str) -> str:
    """A test id as unittest's dotted name."""
    if "::" in test_id:
        path, _, rest = test_id.partition("::")
        if path.endswith(".py"):
            path = path[:-3]
        module = path.replace("\\", "/").strip("/").replace("/", ".")
        return module + "." + rest.split("[")[0].replace("::", ".")
    if test_id.endswith(")") and " (" in test_id:  # Django: "test_x (pkg.mod.Class)"
        method, _, owner = test_id[:-1].partition(" (")
        return owner + "." + method
    return test_id


def _load(test_id: str) -> list[Any]:
    """The test cases a test id names (a plain module-level function: one FunctionTestCase)."""
    name = _name(test_id)
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:-1]:
            owner = getattr(owner, attr, None)
        fn = getattr(owner, parts[-1], None)
        if isinstance(owner, types.ModuleType) and isinstance(fn, types.FunctionType):
            return [unittest.case.FunctionTestCase(fn)]
        break
    return list(_flatten(unittest.defaultTestLoader.loadTestsFromName(name)))


def _flatten(suite: Any) -> Iterator[Any]:
    for item in suite:
        if isinstance(item, unittest.suite.BaseTestSuite):
            yield from _flatten(item)
        else:
            yield item


def _code_files(fn: Any) -> list[str]:
    """The files the code of a test's function comes from: its own and each decorator's
    wrapper's (through ``__wrapped__``: a wrapper decides whether the test runs at all);
    ``""`` for a callable that is no function."""
    files: list[str] = []
    for _ in range(50):
        fn = getattr(fn, "__func__", fn)
        code = getattr(fn, "__code__", None)
        files.append(str(getattr(code, "co_filename", "")) if code is not None else "")
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            break
    return files


def _class_files(test: Any) -> list[str]:
    """The files the functions of the test's own classes come from (every class of its MRO
    but unittest's, which the fingerprint watches, and ``object``): a ``run``, ``__call__``
    or ``setUp`` given to the test class by code under test is code of another file."""
    files: list[str] = []
    for klass in type(test).__mro__:
        if id(klass) in _unittest_classes or klass is object:
            continue
        for value in list(vars(klass).values()):
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            parts = [value]
            if isinstance(value, property):
                parts = [value.fget, value.fset, value.fdel]
            for part in parts:
                if isinstance(part, types.FunctionType):
                    files.extend(f for f in _code_files(part) if f not in files)
    return files


def _sources(test: Any) -> list[str]:
    """Where the code this test case is about to run comes from (the grader vouches for it:
    a test module replaced in ``sys.modules``, a method swapped or a ``run`` given to the
    test's class by code under test, comes from another file)."""
    try:
        if isinstance(test, unittest.case.FunctionTestCase):
            return _code_files(test._testFunc)  # type: ignore[attr-defined]
        files = _code_files(getattr(test, test._testMethodName))
        return files + [f for f in _class_files(test) if f not in files]
    except BaseException:
        return [""]


def _outcome(tests: list[Any], sources: list[str]) -> tuple[str, str]:
    if not tests:
        return "error", "no such test"
    result = _Result()
    for test in tests:
        sources.extend(f for f in _sources(test) if f not in sources)
        test(result)
    if result.errors:
        return "error", result.errors[0][1][-1500:]
    if result.failures:
        return "failed", result.failures[0][1][-1500:]
    if result.bad:
        return result.bad[0]
    if result.unexpectedSuccesses:
        return "failed", "an expected failure passed"
    if result.skipped or result.expectedFailures:
        return "skipped", "skipped or expected to fail"
    if result.testsRun != len(tests):
        return "error", f"ran {result.testsRun} of {len(tests)} tests"
    return "passed", ""


def main() -> None:
    control, results = int(sys.argv[1]), int(sys.argv[2])
    data = b""
    while not data.endswith(b"\n") and len(data) < 1 << 20:  # one line (then EOF)
        chunk = os.read(control, 1 << 16)
        if not chunk:
            break
        data += chunk
    if control == 0:  # the request came on stdin: the tests read nothing from it
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
    else:
        os.close(control)
    request = json.loads(data.decode("utf-8"))
    nonce, wanted = request["nonce"], request["tests"]
    del request, data

    def send(record: dict[str, Any]) -> None:
        data = (_dumps(record) + "\n").encode("utf-8")
        while data:
            data = data[_write(results, data) :]

    sys.path.insert(0, os.getcwd())
    before = _fingerprint()
    for test_id in wanted:
        sources: list[str] = []
        try:
            outcome, detail = _outcome(_load(test_id), sources)
        except BaseException as exc:  # a test may raise anything, even SystemExit
            outcome, detail = "error", f"{type(exc).__name__}: {exc}"
        changed = _changed(before, _fingerprint())
        if changed is not None:
            send({"kind": "tampered", "what": changed})
            _exit(3)
        record = {"kind": "result", "test": test_id, "outcome": outcome}
        send({**record, "detail": str(detail)[-1500:], "sources": sources[:200]})
    send({"kind": "done", "nonce": nonce})
    sys.stdout.flush()
    sys.stderr.flush()
    _exit(0)


if __name__ == "__main__":
    main()
