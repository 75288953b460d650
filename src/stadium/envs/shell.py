"""``shell``: a terminal session: a command in, its output and exit code out.

Each command runs with ``bash -c`` in the session's work directory (files persist
between steps; variables and ``cd`` do not), bounded by ``timeout_s``. Served as it
asks (``isolation = "sandbox"``), the session's own sandbox is all it can touch: no
network, its own uid, memory, process and disk limits (README, "Isolated sessions").
"""

from __future__ import annotations

import random
import shutil
import subprocess
import tempfile
from typing import Any, ClassVar

import msgspec

from stadium._env.contract import Environment, State, StepResult

#: The most output kept per stream (the rest is cut, from the start).
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
        self._dir: str | None = None

    def _workdir(self) -> str:
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="stadium-shell-")
        return self._dir

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> ShellObservation:
        self._workdir()
        return ShellObservation()

    def step(self, action: ShellAction) -> StepResult[ShellObservation]:
        cwd = self._workdir()
        try:
            run = subprocess.run(
                ["bash", "-c", action.command], cwd=cwd, capture_output=True,
                timeout=self.timeout_s, stdin=subprocess.DEVNULL,
            )  # fmt: skip
            obs = ShellObservation(
                run.stdout[-MAX_OUTPUT:].decode(errors="replace"),
                run.stderr[-MAX_OUTPUT:].decode(errors="replace"),
                run.returncode,
            )
        except subprocess.TimeoutExpired:
            obs = ShellObservation("", f"timed out after {self.timeout_s:g} s", -1)
        return StepResult(obs, reward=0.0)

    def close(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def sample_action(self, rng: random.Random) -> ShellAction:
        """A harmless command (``check_env``)."""
        return ShellAction(command=f"echo {rng.randint(0, 99)}")
