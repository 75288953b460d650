"""The ``swe`` env served as it asks (``--isolation sandbox``, tasks inline in
``--env-kwargs``): a scripted policy over the wire gets 1.0, forgeries get 0.0, and a test
process that reaches for the grader's memory or descriptors is refused."""

from __future__ import annotations

from typing import Any

import pytest

import stadium
from tests.conftest import UNIT, serve
from tests.isolation.test_isolation import needs_sandbox
from tests.swe.tasks import FIXES, inline_tasks
from tests.swe.test_swe_env import FORGERIES

pytestmark = pytest.mark.slow

# The test process (the policy's code, imported by the tests) tries the grader's memory and
# descriptors: its parent is the grader (the env's process), of the same uid.
REACHES_FOR_THE_GRADER = (
    "import os\n"
    "for path in ('/proc/%d/mem' % os.getppid(), '/proc/%d/fd/0' % os.getppid()):\n"
    "    try:\n"
    "        open(path, 'r+b')\n"
    "        print('opened', path)\n"
    "    except OSError as exc:\n"
    "        print('refused', type(exc).__name__)\n"
    "def absolute(x):\n    return x\n"
)


async def _call(env: stadium.AsyncClient[Any], name: str, **arguments: Any) -> Any:
    return await env.step({"type": "call_tool", "tool_name": name, "arguments": arguments})


def _data(result: Any) -> Any:
    assert result.observation.get("error") is None, result.observation
    return result.observation["result"]["data"]


SERVED_FORGERIES = (
    "exits 0 at import",
    "monkeypatches unittest from the module under test",
    "edits the failing test",
    "writes a fake report to every descriptor and file",
)


@pytest.mark.parametrize("mode", ["process", pytest.param("sandbox", marks=needs_sandbox)])
async def test_served_the_env_grades_and_refuses_forgeries(mode: str) -> None:
    kwargs = {"tasks": inline_tasks(), "test_timeout_s": 30 * UNIT}
    async with serve("swe", isolation=mode, env_kwargs=kwargs) as server:
        async with stadium.AsyncClient(server.url) as env:
            for attack in SERVED_FORGERIES:
                await env.reset(options={"task": "calc-abs"})
                for name, arguments in FORGERIES[attack][0]:
                    _data(await _call(env, name, **arguments))
                done = await _call(env, "submit")
                assert (attack, done.reward, done.done) == (attack, 0.0, True)
            if mode == "sandbox":
                await env.reset(options={"task": "calc-abs"})
                _data(await _call(env, "write_file", path="calc/ops.py",
                                  content=REACHES_FOR_THE_GRADER))  # fmt: skip
                graded = _data(await _call(env, "submit"))
                lines = [
                    x
                    for x in graded["output"].splitlines()
                    if x.split()[0] in ("refused", "opened")
                ]
                assert [x.split()[0] for x in lines] == ["refused", "refused"], graded["output"]
            for task, (path, fixed) in FIXES.items():
                first = await env.reset(options={"task": task})
                assert first.observation["result"]["data"]["instance_id"] == task
                _data(await _call(env, "write_file", path=path, content=fixed))
                done = await _call(env, "submit")
                assert (task, done.reward, done.done) == (task, 1.0, True), done.observation
