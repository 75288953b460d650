"""The ``swe`` env in its task images (``--isolation sandbox``, each session's ``/`` the
task's image): a scripted policy solves both example tasks, choosing each task's image at
reset; forgeries get 0.0 (a daemon the policy left rewriting a test among them; a policy
that kills its commands' supervisor is not graded); a task whose image the session does
not run is a clear error.
Skipped, with the reason, without root, bubblewrap or Podman."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import stadium
from stadium._server.isolation import sandbox_unavailable
from tests.conftest import UNIT, serve
from tests.swe.tasks import FIXES, image_tasks
from tests.swe.test_swe_env import FORGERIES

pytestmark = pytest.mark.slow
WHY_NO_SANDBOX = sandbox_unavailable()


async def _call(env: stadium.AsyncClient[Any], name: str, **arguments: Any) -> Any:
    return await env.step({"type": "call_tool", "tool_name": name, "arguments": arguments})


def _data(result: Any) -> Any:
    assert result.observation.get("error") is None, result.observation
    return result.observation["result"]["data"]


@pytest.fixture
def tasks(swe_images: dict[str, str]) -> list[dict[str, Any]]:
    """The example tasks, each naming its image by the REF the sandbox takes."""
    if WHY_NO_SANDBOX is not None:
        pytest.skip(f"task images need --isolation sandbox: {WHY_NO_SANDBOX}")
    return [{**task, "image": swe_images[task["instance_id"]]} for task in image_tasks()]


async def test_the_env_solves_and_grades_in_task_images(tasks: list[dict[str, Any]]) -> None:
    calc, slug = (t["image"] for t in tasks)
    kwargs = {"tasks": tasks, "test_timeout_s": 30 * UNIT}
    async with (
        serve("swe", isolation="sandbox", image=calc, images=slug, env_kwargs=kwargs,
              sandbox_disk=32) as server,
        stadium.AsyncClient(server.url) as env,
    ):  # fmt: skip
        for task in tasks:
            name = task["instance_id"]
            first = await env.reset(options={"task": name, "image": task["image"]})
            info = first.observation["result"]["data"]
            assert (info["instance_id"], info["repo"]) == (name, "/repo")
            version = _data(
                await _call(
                    env, "run", command="python3 -c 'import sys; print(sys.version_info[:2])'"
                )
            )
            assert version["stdout"] == "(3, 13)\n"  # the image's python, not the server's
            before = _data(await _call(env, "run", command=info["test_command"]))
            assert before["exit_code"] != 0, before
            path, fixed = FIXES[name]
            _data(await _call(env, "write_file", path=path, content=fixed))
            done = await _call(env, "submit")
            assert (name, done.reward, done.done) == (name, 1.0, True), done.observation
        for attack in ("exits 0 at import", "edits the failing test",
                       "monkeypatches unittest from the module under test",
                       "replaces the tests folder with a link to passing tests",
                       "leaves a daemon rewriting the failing test"):  # fmt: skip
            await env.reset(options={"task": "calc-abs", "image": calc})
            for name, arguments in FORGERIES[attack][0]:
                if "plant_pyc" not in str(arguments):
                    _data(await _call(env, name, **arguments))
            done = await _call(env, "submit")
            assert (attack, done.reward) == (attack, 0.0), done.observation
        # The policy kills the supervisor of its commands (its daemon then escapes it):
        # not graded.
        await env.reset(options={"task": "calc-abs", "image": calc})
        for name, arguments in FORGERIES["leaves a daemon rewriting the failing test"][0]:
            _data(await _call(env, name, **arguments))
        killed = await _call(env, "run", command="kill -9 $PPID")
        assert "supervisor is gone" in killed.observation["error"]["message"], killed.observation
        path, fixed = FIXES["calc-abs"]
        _data(await _call(env, "write_file", path=path, content=fixed))
        done = await _call(env, "submit")
        assert done.reward == 0.0, done.observation
        problem = done.observation["result"]["data"]["problems"][0]
        assert problem.startswith("not graded: the workspace's process supervisor "), problem
        with pytest.raises(stadium.StadiumError, match="runs in image"):
            await env.reset(options={"task": "slug-case", "image": calc})


async def test_a_tasks_file_is_read_by_the_server_for_image_sessions(
    tasks: list[dict[str, Any]], tmp_path: Path
) -> None:
    """``tasks=PATH``: the file is on the server's filesystem, not in the task image the
    session's ``/`` is; the server reads it (``SweEnv.prepare_kwargs``) and the sessions
    get its rows."""
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(task) + "\n" for task in tasks))
    calc = tasks[0]["image"]
    kwargs = {"tasks": str(path), "test_timeout_s": 30 * UNIT}
    async with (
        serve("swe", isolation="sandbox", image=calc, env_kwargs=kwargs) as server,
        stadium.AsyncClient(server.url) as env,
    ):
        await env.reset(options={"task": "calc-abs"})
        _data(
            await _call(env, "write_file", path=FIXES["calc-abs"][0], content=FIXES["calc-abs"][1])
        )
        done = await _call(env, "submit")
        assert (done.reward, done.done) == (1.0, True), done.observation
