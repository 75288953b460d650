"""Rules of the codebase that the import contracts (``make lint``) do not cover."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

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


#: File names that may repeat in ``src/``: a package's own dunder modules, and parallel
#: implementations of one interface (as websockets' ``asyncio/client.py`` and
#: ``sync/client.py``). None of the latter today: a name added here says which interface
#: its copies implement.
SHARED_NAMES = frozenset({"__init__.py", "__main__.py"})


def test_no_two_modules_share_a_file_name() -> None:
    """A file's name says what lives in it, so a name found twice hides which one is meant."""
    where: dict[str, list[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        where.setdefault(path.name, []).append(str(path.relative_to(SRC)))
    assert len(where) > 100, "no modules found"
    repeated = {name: paths for name, paths in where.items() if len(paths) > 1}
    repeated = {name: paths for name, paths in repeated.items() if name not in SHARED_NAMES}
    assert repeated == {}, f"rename these by what lives in each: {repeated}"


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


@pytest.mark.slow
@pytest.mark.parametrize(
    ("where", "line", "broken"),
    [
        ("_client/_probe.py", "import stadium._server.sessions.runner", "Packages"),
        ("_core/_probe.py", "import asyncio", "The protocol core does no I/O"),
        ("_server/session_probe.py", "import picows", "only the transports speak picows"),
        ("_client/_probe.py", "import prometheus_client", "The client side never loads"),
        # A new file in a room is checked by the room it lands in (the `server` contract) ...
        ("_server/transports/_probe.py", "import stadium._server.server", "Server rooms"),
        ("_server/processes/_probe.py", "import stadium._server.transports", "Server rooms"),
        ("_server/http/_probe.py", "import stadium._server.processes.worker", "Server rooms"),
        ("_server/sessions/_probe.py", "import stadium._server.http.endpoints", "Server rooms"),
        ("_server/isolation/_probe.py", "import stadium._server.runtime", "Server rooms"),
        ("_server/admission/_probe.py", "import stadium._server.runtime", "Server rooms"),
        ("_server/durability/_probe.py", "import stadium._server.admission", "Server rooms"),
        ("_server/ledger/_probe.py", "import stadium._server.isolation", "Server rooms"),
        ("_server/images/_probe.py", "import stadium._server.ledger", "Server rooms"),
        # ... and a module of a room that imports upwards inside it, by the room's own contract.
        ("+_server/processes/watchdog.py", "import stadium._server.processes.worker", "Processes:"),
        ("+_server/http/endpoints.py", "import stadium._server.http.upgrade", "HTTP:"),
        ("+_server/sessions/resumable.py", "import stadium._server.sessions.runner", "Sessions:"),
        ("+_server/admission/slots.py", "import stadium._server.admission.fair", "Admission:"),
        ("+_server/durability/session_store.py", "import stadium._server.durability.records",
         "Durability:"),
        ("+_server/ledger/rows.py", "import stadium._server.ledger.record", "Ledger:"),
        ("+_server/images/refs.py", "import stadium._server.images.store", "Images:"),
        ("+_server/transports/h11.py", "import stadium._server.transports.picows", "Transports:"),
        # The isolation room's two sides never import each other, nor does what they share.
        ("_server/isolation/template/_probe.py", "import stadium._server.isolation.worker.proc",
         "Isolation: the worker's side and the env's side"),
        ("_server/isolation/worker/_probe.py", "import stadium._server.isolation.template.child",
         "Isolation: the worker's side and the env's side"),
        ("+_server/isolation/sandbox.py", "import stadium._server.isolation.template.rootfs",
         "Isolation: the worker's side and the env's side"),
        ("+_server/isolation/worker/proc.py", "import stadium._server.isolation.worker.proxy",
         "Isolation, the worker's side"),
        ("+_server/isolation/template/rootfs.py", "import stadium._server.isolation.template.child",
         "Isolation, the env's side"),
    ],
)  # fmt: skip
def test_the_contracts_catch_a_file_by_the_folder_it_lands_in(
    tmp_path: Path, where: str, line: str, broken: str
) -> None:
    """A new module breaking a rule fails ``make lint`` with no list to update: a copy of the
    package with one injected file (or, ``+`` before the path, one import appended to a module
    of a room) is checked against the same contracts."""
    import shutil
    import subprocess
    import sys

    copy = tmp_path / "src" / "stadium"
    shutil.copytree(SRC, copy, ignore=shutil.ignore_patterns("__pycache__"))
    if where.startswith("+"):
        target = copy / where[1:]
        target.write_text(f"{target.read_text()}\n{line}  # noqa: E402  (injected)\n")
    else:
        (copy / where).write_text(f'"""An injected import."""\n\n{line}\n')
    root = SRC.parents[1]
    lint = Path(sys.executable).with_name("lint-imports")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "src")}
    out = subprocess.run(
        [str(lint), "--no-logo", "--config", str(root / "pyproject.toml")],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert out.returncode != 0, out.stdout
    assert broken in out.stdout
    assert "BROKEN" in out.stdout
