"""``stadium.launch(..., on="slurm")`` on the emulated cluster: a batch job's servers
behind the same object every engine returns, sessions balanced over them, stop =
``scancel`` with the in-flight step answered."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import pytest

import stadium
from stadium import SessionPool
from stadium.deploy.launch import SlurmJob
from tests.cluster.harness import Cluster
from tests.conftest import UNIT
from tests.test_launch import _step_through_stop

pytestmark = pytest.mark.cluster

PORT = 8790
ROUTER_PORT = 8791


def test_launch_on_slurm(cluster: Cluster, tmp_path: Path) -> None:
    d = stadium.launch(
        "benchmark", replicas=2, on="slurm", port=PORT, router="haproxy",
        router_port=ROUTER_PORT, max_sessions=64, drain_timeout=2,
        deployment=tmp_path / "deployment.json", env=cluster.slurm_env(),
        timeout_s=60 * UNIT,
    )  # fmt: skip
    try:
        assert isinstance(d, SlurmJob)
        by_url = {n.url(PORT): n.name for n in cluster.nodes}
        assert len(set(d.endpoints)) == 2
        assert set(d.endpoints) <= set(by_url)
        assert d.router in {n.url(ROUTER_PORT) for n in cluster.nodes}
        assert d.job_id in cluster.jobs()

        async def hosts() -> set[str]:
            pool: SessionPool[Any] = SessionPool(d, size=6)
            async with pool:
                firsts = await pool.reset()
                return {str(r.observation["host"]) for r in firsts}

        # sessions balanced by the client over both nodes (not through the router)
        assert asyncio.run(hosts()) == {by_url[url] for url in d.endpoints}
        assert socket.gethostname() not in by_url.values()

        waited, ended = asyncio.run(_step_through_stop(d, lambda: d.stop(30 * UNIT)))
        assert waited == pytest.approx(1.5, abs=0.05)
        assert "1001" in ended, ended
        assert d.ended
        assert d.job_id not in cluster.jobs()
    finally:
        cluster.cancel_all_jobs()
