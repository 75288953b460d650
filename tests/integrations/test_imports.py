"""The optional integrations stay optional: the core imports none of their dependencies."""

from __future__ import annotations

import subprocess
import sys

OPTIONAL = ("numpy", "gymnasium", "pydantic", "openenv")


def test_core_and_builtin_targets_import_no_optional_dependency() -> None:
    code = (
        "import sys, stadium\n"
        "from stadium._loader import load_target\n"
        "from stadium._spec import EnvSpec\n"
        "EnvSpec.of(load_target('wordguess'))\n"
        f"print([m for m in {OPTIONAL!r} if m in sys.modules])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]"
