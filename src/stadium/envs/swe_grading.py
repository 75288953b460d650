"""Grading a SWE task so that the code being judged cannot forge its reward.

The policy edits a repository; its tests import that repository's code, so the process that
runs them is the judged code's as much as the grader's. The grader takes nothing from that
process but a results stream it can check, and gives the judged code nothing to change but
the source files the task lets it change:

1. **Pristine capture** (:meth:`Pristine.capture`, at ``reset``, before the policy acts): every
   file, directory and link of the repository (but ``.git``), its bytes and mode, kept in the
   env process's memory (which the policy's processes cannot open when sandboxed).
2. **Restore** (:func:`restore`, at grading, after the env ended every process the policy
   started: :meth:`stadium.Workspace.stop_others`, called by ``SweEnv.grade``): every
   change outside the paths the policy may change (:class:`Rules`) is undone in place: test
   files and the files that configure a test run (``conftest.py``, ``setup.cfg``, ``*.pth``,
   ``sitecustomize.py``, a test package's ``__init__.py``, ``__pycache__``...) get their
   pristine bytes back, files added there are removed, and so is every link the policy made
   and anything not a file, directory or link, and anything added where Python would import
   it instead of a test module (:meth:`Rules.shadows`).
3. **Run** (:func:`run_tests`): the runner (:mod:`stadium.envs.swe_runner`, shipped with
   Stadium, run with the image's ``python3 -I``) gets the test ids and a fresh nonce on a pipe
   made for this run, before any repository code loads, and reports each test on another.
   Its stdout and stderr are output (a bounded tail for the policy), never parsed. Given the
   session's workspace, the run starts under its process supervisor, and everything it
   started is ended before the verdict is returned.
4. **Verdict** (:class:`GradingVerdict`): resolved only if every FAIL_TO_PASS and PASS_TO_PASS
   test is reported ``passed`` by name, once, the stream ends with the run's nonce, the runner
   saw no rebinding of unittest, the builtins or itself, and the process exited 0 in time.

What this does not stop (``docs/SWE.md``): code written against this runner, which finds the
nonce and the results pipe in its own process and writes a forged stream, or patches and
un-patches unittest within one test; changes outside
the repository (the image's system files, which a sandboxed session's uid cannot write when
the image's root owns them).
"""

from __future__ import annotations

import fnmatch
import importlib.resources
import os
import secrets
import selectors
import shutil
import stat
import time
from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple

import msgspec

from stadium._env.workspace import Workspace
from stadium._errors import ConfigError, ExecutionError
from stadium.envs.graded_process import GradedProcess

#: The runner's source, read once (the sandbox may not reach the file later).
RUNNER_SOURCE = importlib.resources.files("stadium.envs").joinpath("swe_runner.py").read_text()
#: The ``PATH`` of the test run when the caller gives no environment.
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
#: The most bytes one record of the runner may take.
MAX_RECORD = 1 << 16
#: The most characters of the test run's output kept (from the end).
MAX_OUTPUT = 4000
#: Files that configure a test run wherever they are (never the policy's to change).
CONFIG_NAMES = frozenset({
    "conftest.py", "pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml", "setup.py",
    "sitecustomize.py", "usercustomize.py", "noxfile.py", ".coveragerc", "manage.py",
})  # fmt: skip
#: Directory names whose contents are tests (or their data).
TEST_DIRS = frozenset({"test", "tests", "testing"})
#: File name patterns of tests, and of files no fix needs (compiled or path-changing ones).
TEST_PATTERNS = ("test_*.py", "*_test.py", "test.py", "tests.py")
NEVER_PATTERNS = ("*.pyc", "*.pyo", "*.pth")


class GradingError(ConfigError):
    """The task cannot be graded as given (its repository is over the limits, or missing)."""


class Entry(NamedTuple):
    """One path of the repository: ``kind`` file/dir/link, its mode, its bytes (a link's
    target for a link)."""

    kind: Literal["file", "dir", "link"]
    mode: int
    data: bytes


def _dotted(test_id: str) -> tuple[str, ...]:
    """A test id as the dotted parts the runner imports (``swe_runner._name``'s reading)."""
    if "::" in test_id:
        path, _, rest = test_id.partition("::")
        module = path[:-3] if path.endswith(".py") else path
        name = module.replace("\\", "/").strip("/").replace("/", ".")
        name += "." + rest.split("[")[0].replace("::", ".")
    elif test_id.endswith(")") and " (" in test_id:  # Django: "test_x (pkg.mod.Class)"
        method, _, owner = test_id[:-1].partition(" (")
        name = owner + "." + method
    else:
        name = test_id
    return tuple(name.split("."))


def _module_key(rel: str) -> tuple[str, ...]:
    """The dotted name Python could import a path as (``a/b/c.abi3.so``: ``a.b.c``)."""
    parts = rel.split("/")
    parts[-1] = parts[-1].split(".", 1)[0]
    return tuple(parts)


class Rules(msgspec.Struct, frozen=True):
    """Which paths (relative to the repository, ``/``-separated) the policy may change.

    ``test_files``: the task's tests (and the ``__init__.py`` of their packages) are never
    the policy's; nor is anything under a ``test``/``tests``/``testing`` directory, a
    ``test_*.py``/``*_test.py`` file, a :data:`CONFIG_NAMES` file, ``__pycache__``,
    ``*.pyc`` or ``*.pth``. Nor may the policy add anything Python would import in place
    of a test module or of a package on its way (:meth:`shadows`; from ``test_ids``, the
    ids the runner imports, and ``test_files``): a package, an extension module (``.so``)
    or a module of any suffix with the test module's name or a namespace package's name
    on its dotted path, or an ``__init__`` (any suffix) in a folder on it. ``src_paths``
    (when not empty): the policy may change only paths under these.
    """

    test_files: tuple[str, ...] = ()
    src_paths: tuple[str, ...] = ()
    test_ids: tuple[str, ...] = ()

    def _chains(self) -> list[tuple[str, ...]]:
        chains = [_dotted(t) for t in self.test_ids]
        return chains + [_module_key(t) for t in self.test_files if t.endswith(".py")]

    def shadows(self, rel: str) -> bool:
        """Whether ``rel``, if the policy added it, would be imported in place of a test
        module or of a package on a test's dotted path (see the class docstring)."""
        key = _module_key(rel)
        for chain in self._chains():
            if chain[: len(key)] == key:  # the module itself, a package or module on its path
                return True
            if key[-1] == "__init__" and chain[: len(key) - 1] == key[:-1]:
                return True  # makes a namespace package on the path a package of its own
        return any(key[: len(c)] == c for c in map(_module_key, self.test_files))

    def protected(self, rel: str) -> bool:
        parts = rel.split("/")
        name = parts[-1]
        if rel in self.test_files or name in CONFIG_NAMES or "__pycache__" in parts:
            return True
        if any(part in TEST_DIRS for part in parts[:-1]) or name in TEST_DIRS:
            return True
        if any(fnmatch.fnmatchcase(name, p) for p in TEST_PATTERNS + NEVER_PATTERNS):
            return True
        if name == "__init__.py":
            folder = rel[: -len(name)]
            return any(t.startswith(folder) for t in self.test_files)
        return False

    def allowed(self, rel: str) -> bool:
        """Whether a change of ``rel`` by the policy counts (else it is undone)."""
        if self.protected(rel):
            return False
        if not self.src_paths:
            return True
        return any(rel == p or rel.startswith(p.rstrip("/") + "/") for p in self.src_paths)


def _walk(root: str, max_files: int, max_bytes: int, what: str) -> dict[str, Entry]:
    """Every path under ``root`` (not ``.git``), without following links, bounded."""
    entries: dict[str, Entry] = {}
    total = 0
    stack = [""]
    while stack:
        rel_dir = stack.pop()
        try:
            scan = list(os.scandir(os.path.join(root, rel_dir) if rel_dir else root))
        except OSError as exc:
            raise GradingError(f"cannot list {what} at {root}/{rel_dir}: {exc}") from None
        for item in scan:
            rel = f"{rel_dir}/{item.name}" if rel_dir else item.name
            if item.name == ".git":
                continue
            if len(entries) >= max_files:
                raise GradingError(f"{what} at {root} holds more than {max_files} files")
            info = item.stat(follow_symlinks=False)
            if stat.S_ISLNK(info.st_mode):
                entries[rel] = Entry("link", 0, os.fsencode(os.readlink(item.path)))
            elif stat.S_ISDIR(info.st_mode):
                entries[rel] = Entry("dir", stat.S_IMODE(info.st_mode), b"")
                stack.append(rel)
            elif stat.S_ISREG(info.st_mode):
                total += info.st_size
                if total > max_bytes:
                    raise GradingError(f"{what} at {root} holds more than {max_bytes} bytes")
                entries[rel] = Entry("file", stat.S_IMODE(info.st_mode), b"")
            else:
                entries[rel] = Entry("file", -1, b"")  # a fifo, socket or device: removed
    return entries


def _shown(path: str) -> str:
    """A path as the grade shows it: a name that is no UTF-8 (``os.fsdecode``'s surrogates,
    which no encoder of the reply takes) escaped, at most 200 characters."""
    text = os.fsencode(path).decode("utf-8", "backslashreplace")
    return text if len(text) <= 200 else text[:200] + "..."


def _read(path: str, limit: int) -> bytes:
    """At most ``limit + 1`` bytes of the file (never its whole, if the policy made it huge:
    a sparse file of any size costs it nothing)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        return f.read(limit + 1)


class Pristine:
    """The repository as the task image had it, in memory (see the module docstring)."""

    def __init__(self, root: str, entries: dict[str, Entry]) -> None:
        self.root = root
        self.entries = entries

    @classmethod
    def capture(cls, root: str, *, max_files: int = 20000, max_bytes: int = 64 << 20) -> Pristine:
        """Read every path under ``root`` (raises :class:`GradingError` over the limits)."""
        if not os.path.isdir(root):
            raise GradingError(f"the task's repository {root} is not a directory")
        entries = _walk(root, max_files, max_bytes, "the repository")
        for rel, entry in entries.items():
            if entry.kind == "file" and entry.mode >= 0:
                data = _read(os.path.join(root, rel), max_bytes)
                if len(data) > max_bytes:
                    raise GradingError(f"the repository at {root} grew while it was read: {rel}")
                entries[rel] = entry._replace(data=data)
        return cls(root, {k: v for k, v in entries.items() if v.mode >= 0 or v.kind != "file"})

    def vouch(self, path: str, rules: Rules) -> str | None:
        """Why the code of a passed test, from the file ``path`` (as the test run reported
        it), may not be the task's test (``None``: it is). In the repository it must be a
        file of the pristine copy the policy may not change (restored before the run) with
        its pristine bytes still; outside, a file neither the session nor the tests could
        write (the image's). A test module replaced in ``sys.modules``, or test methods
        swapped, by the code under test come from elsewhere."""
        if not path or not os.path.isabs(path):
            return f"its code comes from no file ({path[:200]!r})"
        norm = os.path.normpath(path)
        for root in {os.path.normpath(self.root), os.path.realpath(self.root)}:
            if norm.startswith(root + os.sep):
                rel = norm[len(root) + 1 :]
                was = self.entries.get(rel)
                if was is None or was.kind != "file" or rules.allowed(rel):
                    return f"its code comes from {_shown(rel)}, which is no test file of the task"
                try:
                    same = _read(norm, len(was.data)) == was.data
                except OSError:
                    same = False
                if not same:
                    return f"its code comes from {_shown(rel)}, changed while the tests ran"
                return None
        if os.access(norm, os.W_OK) or os.access(os.path.dirname(norm), os.W_OK):
            return (
                f"its code comes from {_shown(norm)}, outside the repository, a file it could write"
            )
        return None


def restore(pristine: Pristine, rules: Rules, *, max_files: int = 50000) -> list[str]:
    """Undo, in the live repository, every change the policy may not make; returns what was
    undone (``restored PATH`` / ``removed PATH``). Raises :class:`GradingError` if the
    repository cannot be brought back (then nothing may be graded)."""
    root = pristine.root
    undone: list[str] = []
    try:
        live = _walk(root, max_files, 1 << 62, "the repository")
        for rel in sorted(live, key=lambda r: r.count("/"), reverse=True):  # contents first
            if not _keep(rel, live[rel], pristine.entries.get(rel), rules, root):
                _remove(os.path.join(root, rel))
                if rel not in pristine.entries:
                    undone.append(f"removed {_shown(rel)}")
        for rel in sorted(pristine.entries, key=lambda r: r.count("/")):  # folders first
            was = pristine.entries[rel]
            path = os.path.join(root, rel)
            if os.path.lexists(path):
                continue
            if was.kind == "dir":
                os.mkdir(path, was.mode | 0o700)
            elif was.kind == "file" and rel not in live and rules.allowed(rel):
                continue  # the policy deleted a file it may change: its change
            elif was.kind == "link":
                os.symlink(os.fsdecode(was.data), path)
                undone.append(f"restored {_shown(rel)}")
            else:
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                with os.fdopen(os.open(path, flags, 0o600), "wb") as f:
                    f.write(was.data)
                os.chmod(path, was.mode)
                undone.append(f"restored {_shown(rel)}")
    except OSError as exc:
        raise GradingError(f"the repository could not be restored for grading: {exc}") from None
    return undone


def _keep(rel: str, entry: Entry, was: Entry | None, rules: Rules, root: str) -> bool:
    """Whether a live path stays as the policy left it."""
    if was is not None and was.kind != entry.kind:
        return False  # a type change is never kept (nor followed)
    if was is None and rules.shadows(rel):
        return False  # added where Python would import it instead of a test's module
    if entry.kind == "link":
        return entry == was  # links the policy made or changed: never followed, never kept
    if entry.kind == "dir":
        return was is not None or rules.allowed(rel)  # its contents are judged one by one
    if entry.mode < 0:
        return False  # a fifo, socket or device
    if rules.allowed(rel):
        return True
    if was is None or entry.mode != was.mode:
        return False
    return _read(os.path.join(root, rel), len(was.data)) == was.data


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


# -- the run -------------------------------------------------------------------------------


class Reported(msgspec.Struct, tag="result", tag_field="kind", forbid_unknown_fields=True):
    test: str
    outcome: Literal["passed", "failed", "error", "skipped"]
    detail: str = ""
    sources: list[str] = []


class GradingDone(msgspec.Struct, tag="done", tag_field="kind", forbid_unknown_fields=True):
    nonce: str


class Tampered(msgspec.Struct, tag="tampered", tag_field="kind", forbid_unknown_fields=True):
    what: str


_RECORD = msgspec.json.Decoder(Reported | GradingDone | Tampered)


class GradingVerdict(msgspec.Struct):
    """How the task's tests did: ``resolved`` only if every one passed (module docstring).

    ``tests``: each test id's outcome (``missing``: not reported); ``problems``: why the run
    does not count, if it does not; ``restored``: the changes undone before it; ``output``:
    the tail of what the run printed."""

    resolved: bool
    tests: dict[str, str]
    problems: list[str] = msgspec.field(default_factory=list)
    restored: list[str] = msgspec.field(default_factory=list)
    output: str = ""


class _Pipes:
    """The grader's ends of one run: the request out, records and output in, to a deadline."""

    def __init__(self, control: int, results: int, output: int, request: bytes) -> None:
        self.sel = selectors.DefaultSelector()
        self.pending = memoryview(request)
        self.inbox = bytearray()
        self.tail = bytearray()
        self.open = {control: "control", results: "results", output: "output"}
        for fd, role in self.open.items():
            os.set_blocking(fd, False)
            self.sel.register(
                fd, selectors.EVENT_WRITE if role == "control" else selectors.EVENT_READ, role
            )
        self.overflow = False

    def pump(self, deadline: float) -> bool:
        """Move bytes until the results and output pipes close; ``False`` at the deadline."""
        while any(role != "control" for role in self.open.values()):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            for key, _ in self.sel.select(left):
                fd, role = key.fd, key.data
                if role == "control":
                    try:
                        self.pending = self.pending[os.write(fd, self.pending) :]
                    except BlockingIOError:
                        continue
                    except OSError:
                        self.pending = self.pending[:0]
                    if not self.pending:
                        self.sel.unregister(fd)
                        del self.open[fd]
                        os.close(fd)
                    continue
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    self.sel.unregister(fd)
                    del self.open[fd]
                elif role == "results":
                    self.inbox += chunk
                    if len(self.inbox) > 64 * MAX_RECORD:  # more than any honest report
                        self.overflow = True
                        return True
                else:
                    self.tail += chunk
                    del self.tail[: -4 * MAX_OUTPUT]
        return True

    def close(self) -> None:
        for fd in list(self.open):
            self.sel.unregister(fd)
            if self.open[fd] == "control":
                os.close(fd)
        self.sel.close()


def run_tests(
    root: str, tests: Sequence[str], *, python: str, timeout_s: float,
    env: dict[str, str] | None = None, workspace: Workspace | None = None,
    vouch: Callable[[str], str | None] | None = None,
) -> GradingVerdict:  # fmt: skip
    """Run ``tests`` (unittest ids) with the runner in ``root`` and judge the stream.

    With ``workspace`` the run starts under its supervisor, and everything it started is
    ended (:meth:`Workspace.stop_others`) before this returns; a supervisor that cannot
    vouch for that (killed by the tests) fails the run. ``vouch``: see :func:`judge`."""
    nonce = secrets.token_hex(16)
    request = msgspec.json.encode({"nonce": nonce, "tests": list(tests)}) + b"\n"
    control_r, control_w = os.pipe()
    results_r, results_w = os.pipe()
    output_r, output_w = os.pipe()
    argv = [python, "-I", "-B", "-c", RUNNER_SOURCE]
    run_env = env if env is not None else {"PATH": DEFAULT_PATH, "LANG": "C.UTF-8"}
    try:
        run = GradedProcess.start(argv, root, run_env, control_r, output_w, results_w, workspace)
    except (OSError, ExecutionError) as exc:
        for fd in (control_r, control_w, results_r, results_w, output_r, output_w):
            os.close(fd)
        return GradingVerdict(
            False, dict.fromkeys(tests, "missing"), [f"the tests could not start: {exc}"]
        )
    for fd in (control_r, results_w, output_w):
        os.close(fd)
    pipes = _Pipes(control_w, results_r, output_r, request)
    stopped: str | None = None
    try:
        finished = pipes.pump(time.monotonic() + timeout_s)
        code = None
        if finished and not pipes.overflow:
            code = run.wait(max(0.1, min(5.0, timeout_s)))
    finally:
        stopped = run.end()
        pipes.close()
        os.close(results_r)
        os.close(output_r)
    verdict = judge(bytes(pipes.inbox), tests, nonce, code, vouch)
    if not finished:
        verdict.problems.insert(0, f"the tests ran longer than {timeout_s:g} s")
    if pipes.overflow:
        verdict.problems.insert(0, "the test run wrote more results than it was asked for")
    if stopped is not None:
        verdict.problems.insert(0, stopped)
        verdict.resolved = False
    verdict.output = pipes.tail.decode("utf-8", "replace")[-MAX_OUTPUT:]
    return verdict


def judge(
    stream: bytes, tests: Sequence[str], nonce: str, exit_code: int | None,
    vouch: Callable[[str], str | None] | None = None,
) -> GradingVerdict:  # fmt: skip
    """The verdict on a results stream (pure: the tests feed it literal streams). With
    ``vouch``, a passed test counts only if every source its record names is vouched for
    (:meth:`Pristine.vouch`)."""
    wanted = set(tests)
    outcomes: dict[str, str] = {}
    problems: list[str] = []
    done = False
    for raw in stream.split(b"\n"):
        if not raw:
            continue
        if done:
            problems.append("the run wrote results after it ended")
            break
        if len(raw) > MAX_RECORD:
            problems.append(f"a result over {MAX_RECORD} bytes")
            break
        try:
            record = _RECORD.decode(raw)
        except (msgspec.DecodeError, RecursionError):
            problems.append("a result that does not decode")
            break
        if isinstance(record, Tampered):
            problems.append(f"the tests' process rebound {record.what}")
            break
        if isinstance(record, GradingDone):
            if record.nonce != nonce:
                problems.append("the run ended with another run's nonce")
                break
            done = True
            continue
        if record.test not in wanted:
            problems.append(f"a result for a test not asked for: {record.test[:200]!r}")
            break
        if record.test in outcomes:
            problems.append(f"two results for {record.test[:200]!r}")
            break
        if vouch is not None and record.outcome == "passed":
            why = next(filter(None, map(vouch, record.sources or [""])), None)
            if why is not None:
                problems.append(f"{record.test[:200]} passed, but {why}")
                break
        outcomes[record.test] = record.outcome
    if not done and not problems:
        problems.append("the test run did not finish (it exited or was killed before the end)")
    if exit_code != 0 and not problems:
        problems.append(f"the test run exited with {exit_code}")
    table = {t: outcomes.get(t, "missing") for t in tests}
    failing = [t for t, o in table.items() if o != "passed"]
    if failing and not problems:
        problems.append(f"{len(failing)} of {len(tests)} tests did not pass: {failing[0]}")
    return GradingVerdict(not problems, table, problems)


__all__ = [
    "GradingError",
    "GradingVerdict",
    "Pristine",
    "Rules",
    "judge",
    "restore",
    "run_tests",
]
