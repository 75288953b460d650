"""``stadium serve ENV_DIR --isolation sandbox --image build:BASE`` (issue #31 item 5): an
OpenEnv env directory's ``server/Dockerfile`` built with Podman, its sessions inside the
image it made; the build cached by the directory's content; a failing build's output and
an unreachable base in the error.

The recipe (tests/openenv_apps/recipe_env) builds ``FROM ${BASE_IMAGE}``, a registry image
by default (unreachable here), so the tests substitute the local test base. Skipped, with
the reason, without root, bubblewrap or Podman.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

import stadium
from stadium import ConfigError
from stadium._server.images.build import build_image
from tests.conftest import UNIT, serve
from tests.container.conftest import BASE, CACHE
from tests.isolation.test_images import _podman
from tests.isolation.test_images import images as images

pytest.importorskip("openenv.core.env_server.http_server")
pytestmark = pytest.mark.slow

RECIPE_ENV = Path(__file__).parents[1] / "openenv_apps" / "recipe_env"


def _image_id(ref: str) -> str:
    return subprocess.run(
        [_podman(), "image", "inspect", "--format", "{{.Id}}", ref],
        capture_output=True, text=True, check=True, timeout=60 * UNIT,
    ).stdout.strip()  # fmt: skip


def _host_has_no_recipe_file() -> None:
    assert not Path("/etc/stadium-recipe").exists()


async def _read(env: stadium.AsyncClient[Any], path: str) -> str:
    obs = (await env.step({"message": path})).observation
    return str(obs["text"] if isinstance(obs, dict) else obs.text)


async def test_an_openenv_recipe_is_built_and_served_inside_its_image(
    images: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STADIUM_IMAGE_CACHE_DIR", str(CACHE / "imgbox-store"))
    _host_has_no_recipe_file()
    async with (
        serve(str(RECIPE_ENV), isolation="sandbox", image=f"build:{BASE}") as server,
        stadium.AsyncClient(server.url) as env,
    ):
        await env.reset()
        assert await _read(env, "/etc/stadium-recipe") == "built by the recipe\n"
        assert "VERSION_CODENAME=trixie" in await _read(env, "/etc/os-release")
        assert "name: recipe_env" in await _read(env, "/app/env/openenv.yaml")  # COPY . /app/env
        assert await _read(env, "/proc/self/cwd/openenv.yaml") != ""  # WORKDIR /app/env


def test_a_rebuild_of_an_unchanged_directory_is_the_same_image(
    images: tuple[str, str], tmp_path: Path
) -> None:
    ref = build_image(str(RECIPE_ENV), BASE)
    assert ref.startswith("localhost/stadium-build-recipe_env:")
    assert build_image(str(RECIPE_ENV), BASE) == ref  # no build: the tag is the content's
    env = tmp_path / "recipe_env"
    shutil.copytree(RECIPE_ENV, env)
    assert build_image(str(env), BASE) == ref  # the same content, wherever it is
    (env / "notes.txt").write_text("a change\n")
    changed = build_image(str(env), BASE)
    try:
        assert changed != ref
        assert _image_id(changed) != _image_id(ref)
    finally:
        subprocess.run([_podman(), "rmi", "-f", changed], capture_output=True, timeout=60 * UNIT)


def test_a_failing_build_and_an_unreachable_base_are_clear_errors(
    images: tuple[str, str], tmp_path: Path
) -> None:
    with pytest.raises(ConfigError) as err:
        build_image(str(RECIPE_ENV))  # FROM ghcr.io/...: not here, and nothing is pulled
    assert "ghcr.io/meta-pytorch/openenv-base:latest" in err.value.message
    assert "--image build:BASE" in err.value.message
    with pytest.raises(ConfigError, match=r"build:localhost/nowhere:1: no such image"):
        build_image(str(RECIPE_ENV), "localhost/nowhere:1")
    (tmp_path / "Dockerfile").write_text(f"FROM {BASE}\nRUN echo step-output-marker; exit 7\n")
    with pytest.raises(ConfigError) as err:
        build_image(str(tmp_path))
    assert "failed (exit" in err.value.message
    assert "step-output-marker" in err.value.message
