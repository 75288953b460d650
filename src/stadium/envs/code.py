"""``code``: the policy writes a Python function; it runs against the task's tests; the
reward is the share of tests passed.

Each step's code runs in a fresh ``python -I`` subprocess of the session (bounded by
``timeout_s``), in the session's :class:`~stadium.Workspace` (``--image REF``: the image's
``python3``, packages and working directory; else the server's interpreter in a work
directory of the session's own), started under the workspace's process supervisor:
everything it starts ends with the step. Served as it asks
(``isolation = "sandbox"``), that is the session's own sandbox: no network, its own
uid, memory, process and disk limits (docs/ISOLATION.md); so the policy's
code can do what it likes to it and nothing else.

Grading (:func:`run_tests`): nothing the submission writes counts as a result. The
grader (this env's process) keeps each test's expected value to itself and asks the
submission's process only for return values: one request per test on a pipe (the
call's arguments), one reply per request on another (``{"kind": "returned",
"value": ...}``, JSON, at most :data:`MAX_REPLY` bytes), decoded into the type the task
declares (``returns``: ``int`` accepts no ``true`` and no ``1.0``; a ``list[int]`` no
deeper list). The grader compares plain decoded values with the expected value as the same
decoder builds it, equal and of the same type at every depth (under a loose declared type,
``Any``, ``True`` is still no ``1``); so a printed results line, an
early ``exit(0)``, a patched harness or an object whose ``__eq__`` is always true pass
no test. Sandboxed, the grader is not dumpable (its process changed uid), so the
submission's process, of the same uid, can neither open its memory nor its
descriptors; what it can still do is kill the grader or stop it, which fails the step
with an error (no reward). Unsandboxed (``--isolation none``/``process``) the
submission runs as the server's user, which no grader can fence in: the env asks for
the sandbox for that. Tests whose expected values can be read (this module's are)
can still be matched by a lookup table; keep held-out tests where the code cannot
read them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import selectors
import shutil
import sys
import time
from typing import Any, ClassVar, Generic, TypeVar

import msgspec

from stadium._env.contract import Environment, State, StepResult
from stadium._env.workspace import Workspace, current_image
from stadium._errors import ConfigError, ExecutionError
from stadium.envs.graded_process import GradedProcess

#: The most bytes one reply of the submission's process may take (the rest: that test fails).
MAX_REPLY = 1 << 20
#: The most characters of the submission's output (stdout and stderr) kept, from the end.
MAX_OUTPUT = 2000
#: The most characters kept of a message the submission's process sends (an exception).
MAX_MESSAGE = 500

T = TypeVar("T")


class Task(msgspec.Struct, frozen=True):
    """A function to write, the calls that test it and the type its results have."""

    name: str
    prompt: str
    function: str
    tests: list[tuple[list[Any], Any]]
    returns: Any


TASKS: tuple[Task, ...] = (
    Task("add", "Write add(a, b) returning a + b.", "add",
         [([1, 2], 3), ([-1, 1], 0), ([10, 32], 42)], int),
    Task("reverse", "Write reverse(s) returning the string s reversed.", "reverse",
         [(["abc"], "cba"), ([""], ""), (["racecar"], "racecar")], str),
    Task("fizzbuzz", "Write fizzbuzz(n): 'Fizz' if n % 3 == 0, 'Buzz' if n % 5 == 0, "
         "'FizzBuzz' if both, else str(n).", "fizzbuzz",
         [([3], "Fizz"), ([5], "Buzz"), ([15], "FizzBuzz"), ([7], "7")], str),
    Task("primes", "Write primes(n) returning the list of primes below n.", "primes",
         [([10], [2, 3, 5, 7]), ([2], []), ([20], [2, 3, 5, 7, 11, 13, 17, 19])], list[int]),
)  # fmt: skip

# The submission's side: untrusted from its first line on (the submission may replace any
# of it); the grader believes nothing of what it sends but return values.
_HARNESS = """
import json, os, sys
function, requests, replies = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
out = os.fdopen(replies, "w")
def send(**reply):
    out.write(json.dumps(reply, allow_nan=False) + "\\n")
    out.flush()
try:
    scope = {"__name__": "submission"}
    exec(compile(open("submission.py").read(), "submission.py", "exec"), scope)
    fn = scope[function]
except BaseException as exc:
    send(kind="unloadable", message=f"{type(exc).__name__}: {exc}")
    sys.exit(0)
for line in os.fdopen(requests):
    try:
        got = fn(*json.loads(line))
    except BaseException as exc:
        send(kind="failed", message=f"raised {type(exc).__name__}: {exc}")
        continue
    try:
        send(kind="returned", value=got)
    except (TypeError, ValueError) as exc:
        send(kind="failed", message=f"returned a {type(got).__name__}, not plain data ({exc})")
"""


class Returned(
    msgspec.Struct, Generic[T], tag="returned", tag_field="kind", forbid_unknown_fields=True
):
    """The function returned ``value`` (of the task's declared type)."""

    value: T


class RunFailed(msgspec.Struct, tag="failed", tag_field="kind", forbid_unknown_fields=True):
    """The call raised, or returned what JSON cannot carry; ``message`` says which."""

    message: str


class Unloadable(msgspec.Struct, tag="unloadable", tag_field="kind", forbid_unknown_fields=True):
    """The submission did not load (a syntax error, an exception at import, no such function)."""

    message: str


@functools.cache
def _decoder(returns: Any) -> msgspec.json.Decoder[Any]:
    return msgspec.json.Decoder(Returned[returns] | RunFailed | Unloadable)


class Report(msgspec.Struct):
    """How a submission did: tests passed, the first failures, the tail of its output."""

    passed: int = 0
    failures: list[str] = msgspec.field(default_factory=list)
    output: str = ""


class _Ended(Exception):
    """The submission's process stopped answering: exited, closed its pipes, ran out of time
    or sent a reply over :data:`MAX_REPLY`; ``str()`` says which (for every test left)."""


class _Channel:
    """The grader's end: requests out, replies and output in, all bounded by one deadline.
    One selector over the three pipes, no thread; every read takes what is there."""

    def __init__(self, requests: int, replies: int, output: int, deadline: float, limit: float):
        self.requests, self.replies, self.output = requests, replies, output
        self.deadline, self.limit = deadline, limit
        self.inbox = bytearray()
        self.tail = bytearray()
        self.sel = selectors.DefaultSelector()
        for fd in (requests, replies, output):
            os.set_blocking(fd, False)
        self.sel.register(replies, selectors.EVENT_READ, "reply")
        self.sel.register(output, selectors.EVENT_READ, "output")

    def _wait(self) -> None:
        """One round: wait (to the deadline) until a pipe is ready; read what is there."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise _Ended(f"the code ran longer than {self.limit:g} s")
        for key, _ in self.sel.select(left):
            if key.data == "output":
                self.drain()
            elif key.data == "reply":
                self._read_reply()

    def send(self, data: bytes) -> None:
        """Write a request (to the deadline)."""
        view = memoryview(data)
        self.sel.register(self.requests, selectors.EVENT_WRITE, "request")
        try:
            while view:
                try:
                    view = view[os.write(self.requests, view) :]
                except BlockingIOError:
                    self._wait()
                except BrokenPipeError:
                    raise _Ended("the code exited before returning") from None
        finally:
            self.sel.unregister(self.requests)

    def _read_reply(self) -> None:
        try:
            chunk = os.read(self.replies, 65536)
        except BlockingIOError:
            return
        if not chunk:
            self.sel.unregister(self.replies)
            self.replies = -1
        self.inbox += chunk

    def receive(self) -> bytes:
        """The next reply line (without its newline), waited for to the deadline."""
        while True:
            end = self.inbox.find(b"\n", 0, MAX_REPLY + 1)
            if end >= 0:
                line = bytes(self.inbox[:end])
                del self.inbox[: end + 1]
                return line
            if len(self.inbox) > MAX_REPLY:
                raise _Ended(f"the code sent a reply over {MAX_REPLY} bytes")
            if self.replies < 0:
                raise _Ended("the code exited before returning")
            self._wait()

    def drain(self) -> None:
        """Read the output that is there (without waiting), keeping its tail."""
        for _ in range(64):  # at most 4 MiB a call: the rest waits for the next
            try:
                chunk = os.read(self.output, 65536)
            except (BlockingIOError, OSError):
                return
            if not chunk:
                if self.output >= 0:
                    self.sel.unregister(self.output)
                    self.output = -1
                return
            self.tail += chunk
            del self.tail[: -4 * MAX_OUTPUT]

    def text(self) -> str:
        return self.tail.decode("utf-8", "replace")[-MAX_OUTPUT:]

    def close(self) -> None:
        self.sel.close()


def _message(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE] + "..."


def run_tests(
    folder: str, function: str, tests: list[tuple[list[Any], Any]], returns: Any,
    timeout_s: float, python: str = sys.executable, path: str = "/usr/bin:/bin",
    workspace: Workspace | None = None,
) -> Report:  # fmt: skip
    """Run ``folder/submission.py``'s ``function`` on each test's arguments in a fresh
    ``python -I`` process (``python``; cwd ``folder``; ``PATH`` ``path``; at most
    ``timeout_s`` in all); compare what it returns, decoded as ``returns``, with each
    test's expected value, here. With the session's ``workspace`` the process starts under
    its supervisor, and nothing it started outlives the call
    (:mod:`stadium.envs.graded_process`)."""
    report = Report()
    decoder = _decoder(returns)
    wanted = [_canonical(decoder, function, returns, i, exp) for i, (_, exp) in enumerate(tests)]
    requests_r, requests_w = os.pipe()
    replies_r, replies_w = os.pipe()
    output_r, output_w = os.pipe()
    argv = [python, "-I", "-u", "-c", _HARNESS, function]
    try:
        proc = GradedProcess.start(
            argv, folder, {"PATH": path}, requests_r, output_w, replies_w, workspace
        )
    except (OSError, ExecutionError) as exc:
        for fd in (requests_r, requests_w, replies_r, replies_w, output_r, output_w):
            os.close(fd)
        report.failures = [f"the tests could not be run: {exc}"]
        return report
    for fd in (requests_r, replies_w, output_w):
        os.close(fd)
    channel = _Channel(requests_w, replies_r, output_r, time.monotonic() + timeout_s, timeout_s)
    try:
        for i, ((args, expected), want) in enumerate(zip(tests, wanted, strict=True)):
            call = f"{function}{tuple(args)!r}"
            try:
                channel.send(msgspec.json.encode(args) + b"\n")
                line = channel.receive()
            except _Ended as ended:
                report.failures += [str(ended)] if i == 0 else [f"{call}: {ended}"]
                break
            try:
                reply = decoder.decode(line)
            except (msgspec.DecodeError, RecursionError) as exc:
                report.failures.append(
                    f"{call}: its reply is no {_name(returns)} ({_message(str(exc))})"
                )
                continue
            if isinstance(reply, Unloadable):
                report.failures = [_message(reply.message)]
                break
            if isinstance(reply, RunFailed):
                report.failures.append(f"{call} {_message(reply.message)}")
            elif _same(reply.value, want):  # both built by the decoder: no __eq__ of theirs
                report.passed += 1
            else:
                got = _message(repr(reply.value))
                report.failures.append(
                    f"{call} returned {got}, expected {_message(repr(expected))}"
                )
    finally:
        stopped = proc.end()  # and what it started
        channel.drain()
        report.output = channel.text()
        channel.close()
        os.close(requests_w)
        os.close(replies_r)
        os.close(output_r)
    if stopped is not None:  # what it left may still answer: nothing it answered counts
        report.passed, report.failures = 0, [stopped]
    return report


def _canonical(decoder: msgspec.json.Decoder[Any], function: str, returns: Any, i: int,
               expected: Any) -> Any:  # fmt: skip
    """``expected`` as the decoder builds it from its JSON (a tuple: a list; ``3`` for a
    ``float``: ``3.0``): what a right reply decodes to, compared with :func:`_same`."""
    try:
        reply = decoder.decode(msgspec.json.encode(Returned(expected)))
    except (msgspec.DecodeError, msgspec.EncodeError, TypeError, ValueError) as exc:
        raise ConfigError(
            f"test {i} of {function}: its expected value {_message(repr(expected))} is no "
            f"{_name(returns)} as JSON ({exc}): no reply could equal it; fix the test or "
            "the declared return type"
        ) from None
    return reply.value


def _same(got: Any, want: Any) -> bool:
    """Equal and of the same type, at every depth (``True`` is no ``1``, ``1.0`` no ``1``;
    ``-0.0`` is ``0.0``, as ``==`` has it). Both come from the same decoder, so their depth
    is bounded by ``want``'s."""
    if type(got) is not type(want):
        return False
    if isinstance(want, (list, tuple)):
        return len(got) == len(want) and all(map(_same, got, want))
    if isinstance(want, dict):
        keys = {k: k for k in want}
        return len(got) == len(want) and all(
            k in want and _same(k, keys[k]) and _same(v, want[k]) for k, v in got.items()
        )
    if isinstance(want, msgspec.Struct):
        fields = want.__struct_fields__
        return all(_same(getattr(got, f), getattr(want, f)) for f in fields)
    return bool(got == want)


def _name(returns: Any) -> str:
    return returns.__name__ if isinstance(returns, type) else repr(returns)


def _clear(path: str) -> None:
    """Remove what the last submission left at ``path`` (a link, a folder: never written
    through, nor into)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


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
        self._ws: Workspace | None = None

    def _workspace(self) -> Workspace:
        if self._ws is None:
            self._ws = Workspace.current()
        return self._ws

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
        ws = self._workspace()
        _clear(os.path.join(ws.root, "submission.py"))
        ws.write_file("submission.py", action.code)
        path = ws.env.get("PATH", "/usr/bin:/bin")
        python = sys.executable  # the server's interpreter, without an image; else the image's
        if current_image() is not None:
            python = shutil.which("python3", path=path) or "python3"
        report = run_tests(
            ws.root, task.function, task.tests, task.returns, self.timeout_s, python, path, ws
        )
        obs = CodeObservation(
            task.name, task.prompt, passed=report.passed, total=len(task.tests),
            failures=report.failures[:5], output=report.output,
        )  # fmt: skip
        reward = obs.passed / obs.total if obs.total else 0.0
        done = obs.passed == obs.total or self.attempts >= self.max_attempts
        return StepResult(obs, reward=reward, done=done)

    def close(self) -> None:
        if self._ws is not None:
            self._ws.close()
            self._ws = None

    def sample_action(self, rng: random.Random) -> CodeAction:
        """A submission that is right for ``add`` and wrong for the rest (``check_env``)."""
        return CodeAction(code="def add(a, b):\n    return a + b\n")
