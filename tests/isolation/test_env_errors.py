"""An isolated env's exception reaches the server's log: its process tells its output the
traceback, each distinct error once (then counted), and the worker logs that output tagged
with the session (docs/SERVING.md, "When an env raises"). Before, under ``--isolation`` the
client got the error and the server's log had nothing of it, even with ``--debug-errors``."""

from __future__ import annotations

import logging
import os

import pytest

import stadium
from tests.conftest import UNIT, serve, wait_until


class Picky(stadium.Environment[dict, dict, stadium.State]):  # type: ignore[type-arg]
    """Raises on a negative ``n``, from one line (one distinct error however often)."""

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> dict:  # type: ignore[type-arg]
        return {"n": 0}

    def step(self, action: dict) -> stadium.StepResult[dict]:  # type: ignore[type-arg]
        if action["n"] < 0:
            raise ValueError(f"n must be >= 0, got {action['n']}")
        return stadium.StepResult({"n": action["n"]})


@pytest.mark.slow
async def test_an_isolated_envs_exception_is_logged_once_with_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="stadium.env")
    async with serve(Picky, isolation="process") as server:
        async with stadium.AsyncClient(server.url) as env:
            await env.reset()
            for n in (-1, -2, -3):
                with pytest.raises(stadium.ExecutionError, match="n must be >= 0"):
                    await env.step({"n": n})
            assert (await env.step({"n": 1})).observation == {"n": 1}  # it serves on

            def said() -> list[str]:
                return [r.getMessage() for r in caplog.records if r.name == "stadium.env"]

            await wait_until(
                lambda: any("n must be >= 0, got -1" in line for line in said()),
                5 * UNIT,
                "the env's exception logged",
            )
    lines = said()
    raised = [line for line in lines if "the environment raised ValueError" in line]
    assert len(raised) == 1, lines  # one distinct error: its traceback once
    assert raised[0].startswith(f"[session {os.getpid()}."), raised[0]  # the session's tag
    assert any("test_env_errors.py" in line and "in step" in line for line in lines), lines
    assert not any("got -2" in line or "got -3" in line for line in lines), lines
