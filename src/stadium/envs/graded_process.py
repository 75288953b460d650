"""The process a grader runs the judged code in, and its end: nothing it started outlives it.

A grader (the ``code`` env's :func:`~stadium.envs.code.run_tests`, the SWE env's
:func:`~stadium.envs.swe_grading.run_tests`) talks to the judged code's process on pipes of
its own: one it writes the requests on (the process's stdin, or a descriptor named in its
argv), one the answers come back on. :meth:`GradedProcess.start` starts it either

- under the session's :class:`~stadium.Workspace` (``workspace``): through its process
  supervisor, a child subreaper, so that whatever the judged code leaves running (a
  daemon in a session of its own, a double fork) stays in the supervisor's subtree, and
  :meth:`GradedProcess.end` ends all of it (:meth:`Workspace.stop_others`); the request
  pipe is its stdin (argv ``0``), the answer pipe is passed on (argv ``FD_MARK``);
- or, with no workspace, as a plain subprocess in a session of its own (its descriptors'
  numbers in its argv), whose process group is killed at the end: what left that group
  runs on.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

from stadium._env.workspace import Workspace
from stadium._env.workspace_supervisor import FD_MARK, Child
from stadium._errors import ExecutionError


class GradedProcess:
    """The judged code's process: ``argv`` plus the request and answer descriptors' numbers,
    its stdout and stderr on ``out`` (see the module docstring)."""

    def __init__(
        self, proc: subprocess.Popen[bytes] | None, child: Child | None, ws: Workspace | None
    ) -> None:
        self.proc, self.child, self.ws = proc, child, ws

    @classmethod
    def start(
        cls, argv: list[str], cwd: str, env: dict[str, str], requests: int, out: int,
        answers: int, workspace: Workspace | None,
    ) -> GradedProcess:  # fmt: skip
        """Start it (``OSError``/:class:`ExecutionError`: it could not start)."""
        if workspace is not None:
            child = workspace.start(
                [*argv, "0", FD_MARK], cwd=cwd, env=env, stdin=requests, stdout=out,
                stderr=out, extra=answers,
            )  # fmt: skip
            return cls(None, child, workspace)
        proc = subprocess.Popen(
            [*argv, str(requests), str(answers)], cwd=cwd, stdin=subprocess.DEVNULL,
            stdout=out, stderr=out, pass_fds=(requests, answers), start_new_session=True,
            env=env,
        )  # fmt: skip
        return cls(proc, None, None)

    def wait(self, timeout: float) -> int | None:
        """Its exit status (negative: the signal), or ``None`` if it did not end in time."""
        try:
            if self.child is not None:
                return self.child.wait(time.monotonic() + timeout)
            assert self.proc is not None
            return self.proc.wait(timeout)
        except (ExecutionError, subprocess.TimeoutExpired):
            return None

    def end(self) -> str | None:
        """Kill it and what it started; ``None``, or why the rest could not be vouched for
        (the workspace's supervisor was killed: then what the code started may run on)."""
        if self.proc is not None:
            self.proc.kill()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            return None
        assert self.child is not None
        assert self.ws is not None
        self.child.kill()
        with contextlib.suppress(ExecutionError):
            self.child.wait(time.monotonic() + 5.0)
        self.child.close()
        try:
            self.ws.stop_others()
        except ExecutionError as exc:
            return f"what the judged code started could not all be stopped: {exc.message}"
        return None


__all__ = ["GradedProcess"]
