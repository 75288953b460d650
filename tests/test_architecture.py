"""Rules of the codebase that the import contracts (``make lint``) do not cover."""

from __future__ import annotations

from pathlib import Path

import stadium

SRC = Path(stadium.__file__).resolve().parent

#: Modules stay readable: one job each, well under a click-sized core.py.
MAX_LINES = 800


def test_no_module_is_over_the_size_limit() -> None:
    sizes = {
        str(path.relative_to(SRC)): len(path.read_text().splitlines()) for path in SRC.rglob("*.py")
    }
    assert sizes, "no modules found"
    too_big = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert too_big == {}, f"split these modules by job (limit {MAX_LINES} lines): {too_big}"


def test_the_core_imports_no_integration_at_run_time() -> None:
    """Compiling a native env loads neither integration (the codecs' registry stays empty)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from stadium._env.spec import EnvSpec\n"
        "from stadium.envs import EchoEnv\n"
        "EnvSpec.of(EchoEnv)\n"
        "print(sorted(m for m in sys.modules if m.startswith('stadium.integrations')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]"
