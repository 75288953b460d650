"""Every script in examples/ runs to completion."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

#: Process-level: servers, tools or interpreters in subprocesses (`make check` skips it).
pytestmark = pytest.mark.slow

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(path: Path) -> None:
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
