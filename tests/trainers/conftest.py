"""Trainer tests: `stadium serve` as a subprocess, a stand-in policy, the trainers' own venv.

The trainers run from ``.venv-trainers`` (made here from ``requirements-light.txt`` with
uv, from PyPI, and reused while that file is unchanged): verifiers pins ``openai<3``,
which Stadium's dev venv cannot share.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import UNIT

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = Path(__file__).with_name("requirements-light.txt")
VENV = ROOT / ".venv-trainers"


@pytest.fixture(scope="session")
def trainer_python() -> Path:
    """The Python of a venv holding the light trainers (verifiers, ART, OpenEnv)."""
    digest = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()
    marker = VENV / ".requirements-sha256"
    python = VENV / "bin" / "python"
    if not (python.exists() and marker.exists() and marker.read_text() == digest):
        uv = Path(sys.executable).parent / "uv"
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([str(uv), "venv", "-q", "--clear", "-p", base, str(VENV)], check=True)
        subprocess.run(
            [str(uv), "pip", "install", "-q", "-r", str(REQUIREMENTS)],
            check=True, env={**os.environ, "VIRTUAL_ENV": str(VENV)},
            timeout=600 * UNIT,
        )  # fmt: skip
        marker.write_text(digest)
    return python


@contextlib.contextmanager
def stadium_serve(target: str, *args: str) -> Iterator[str]:
    """``stadium serve TARGET --port 0 ARGS`` as a subprocess; yields its http URL.

    Stopped with SIGTERM afterwards; a non-zero exit fails the test.
    """
    proc = subprocess.Popen(
        [sys.executable, "-m", "stadium", "serve", target, "--host", "127.0.0.1", "--port", "0",
         *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        found = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
        assert found, f"stadium serve did not start: {line!r}"
        yield found.group(1)
    finally:
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=30 * UNIT)
    assert proc.returncode == 0, f"stadium serve exited {proc.returncode}: {err[-2000:]}"


def run_trainer(argv: list[str], cwd: Path, timeout_units: float = 240) -> str:
    """Run a trainer's command; its stdout, or a failure with its output."""
    proc = subprocess.run(
        argv, cwd=cwd, capture_output=True, text=True, timeout=timeout_units * UNIT,
        env={**os.environ, "STUB_KEY": "unused", "NO_COLOR": "1", "WANDB_MODE": "disabled"},
    )  # fmt: skip
    assert proc.returncode == 0, (
        f"{argv[:3]} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc.stdout
