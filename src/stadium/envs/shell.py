"""``shell``: a terminal session: a command in, its output and exit code out.

Each command runs with ``bash -c`` (``sh`` where there is no bash) in the session's
:class:`~stadium.Workspace` (files persist between steps; variables and ``cd`` do not),
bounded by ``timeout_s``. Served as it asks (``isolation = "sandbox"``), the session's own
sandbox is all it can touch: no network, its own uid, memory, process and disk limits
(docs/ISOLATION.md). ``stadium serve shell --image REF`` is a terminal inside
the image: its tools, its environment, its working directory, a private copy of its files.
"""

from __future__ import annotations

import random
import shutil
from typing import Any, ClassVar

import msgspec

from stadium._env.contract import Environment, State, StepResult
from stadium._env.workspace import Workspace

#: The most output kept per stream (the rest is cut, visibly).
MAX_OUTPUT = 16384


class ShellAction(msgspec.Struct):
    """A bash command line."""

    command: str


class ShellObservation(msgspec.Struct):
    """What the command printed, and how it ended (``exit_code`` -1: timed out)."""

    stdout: str = ""
    stderr: str = ""
    exit_code: int = 0


class ShellEnv(Environment[ShellAction, ShellObservation, State]):
    """Runs each command in the session's work directory; no reward of its own."""

    name = "shell"
    version = "1.0"
    description = "A terminal: commands in, output out (run in a sandbox)"
    isolation: ClassVar[str] = "sandbox"

    def __init__(self, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self._ws: Workspace | None = None

    def _workspace(self) -> Workspace:
        if self._ws is None:
            self._ws = Workspace.current()
        return self._ws

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> ShellObservation:
        self._workspace()
        return ShellObservation()

    def step(self, action: ShellAction) -> StepResult[ShellObservation]:
        ws = self._workspace()
        shell = "bash" if shutil.which("bash", path=ws.env.get("PATH")) else "sh"
        run = ws.run([shell, "-c", action.command], timeout=self.timeout_s, max_output=MAX_OUTPUT)
        if run.timed_out:
            obs = ShellObservation(run.stdout, f"timed out after {self.timeout_s:g} s", -1)
        else:
            obs = ShellObservation(run.stdout, run.stderr, run.exit_code or 0)
        return StepResult(obs, reward=0.0)

    def close(self) -> None:
        if self._ws is not None:
            self._ws.close()
            self._ws = None

    def sample_action(self, rng: random.Random) -> ShellAction:
        """A harmless command (``check_env``)."""
        return ShellAction(command=f"echo {rng.randint(0, 99)}")
