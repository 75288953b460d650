"""The optional integrations stay optional: the core imports none of their dependencies."""

from __future__ import annotations

import subprocess
import sys

import pytest

OPTIONAL = ("numpy", "gymnasium", "pydantic", "openenv")


@pytest.mark.slow
def test_core_and_builtin_targets_import_no_optional_dependency() -> None:
    code = (
        "import sys, stadium\n"
        "from stadium._server.loader import load_target\n"
        "from stadium._env.spec import EnvSpec\n"
        "EnvSpec.of(load_target('wordguess'))\n"
        f"print([m for m in {OPTIONAL!r} if m in sys.modules])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
def test_a_space_declared_without_the_gymnasium_integration_says_what_to_import() -> None:
    code = (
        "from typing import Any\n"
        "from gymnasium import spaces\n"
        "import stadium\n"
        "from stadium._env.spec import EnvSpec\n"
        "class E(stadium.Environment[Any, Any, stadium.State]):\n"
        "    action_type = spaces.Discrete(2)\n"
        "    observation_type = spaces.Discrete(2)\n"
        "    def reset(self, *, seed=None, options=None): return 0\n"
        "    def step(self, action): return 0\n"
        "try:\n"
        "    EnvSpec.of(E)\n"
        "except stadium.TargetError as exc:\n"
        "    print('refused:', exc)\n"
        "import stadium.integrations.gymnasium\n"
        "print('compiled:', EnvSpec.of(E).action.name)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    refused, compiled = out.stdout.strip().splitlines()
    assert "import stadium.integrations.gymnasium" in refused
    assert compiled == "compiled: Discrete"
