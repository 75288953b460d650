"""``import stadium`` stays light: a trainer that only wants a client loads no server."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import stadium

#: Stadium's packages that only the server, the command or the harness load.
SERVER_SIDE = (["stadium", "_server"], ["stadium", "_cli"], ["stadium", "bench"])

#: Libraries only the server (or the CLI) needs.
SERVER_LIBRARIES = ("prometheus_client", "click", "rich", "uvicorn")


def _loaded_after(code: str) -> list[str]:
    """The modules a fresh interpreter holds after running ``code``."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    loaded = json.loads(out.stdout)
    assert isinstance(loaded, list)
    return loaded


@pytest.mark.parametrize(
    "code",
    [
        "import stadium",
        "import stadium; stadium.AsyncClient",
        "import stadium; stadium.Client; stadium.SessionPool",
        "import stadium; stadium.Environment; stadium.StepResult; stadium.StadiumError",
        "import stadium.gym",
    ],
)
@pytest.mark.slow
def test_a_client_loads_no_server_module(code: str) -> None:
    loaded = _loaded_after(code)
    assert "stadium" in loaded
    server = [m for m in loaded if m.split(".")[:2] in SERVER_SIDE]
    assert server == [], f"{code!r} loaded server-side modules: {server}"
    heavy = [m for m in loaded if m.split(".")[0] in SERVER_LIBRARIES]
    assert heavy == [], f"{code!r} loaded server libraries: {heavy}"


@pytest.mark.slow
def test_the_server_names_still_load_on_first_use() -> None:
    loaded = _loaded_after("import stadium; stadium.Server; stadium.ServerConfig")
    assert "stadium._server.server" in loaded
    assert "prometheus_client" in loaded  # the check above can see a server library when loaded


def test_every_public_name_resolves() -> None:
    for name in stadium.__all__:
        assert getattr(stadium, name) is not None, name
    assert set(stadium.__all__) <= set(dir(stadium))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        stadium.nope  # noqa: B018
