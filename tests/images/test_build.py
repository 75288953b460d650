"""``--image build`` without Podman's builds: finding the recipe, its bases, the content key,
the substitution of a local base, and the errors (``stadium._server.images.build``)."""

from __future__ import annotations

import importlib.resources
import os
import shutil
from pathlib import Path

import pytest

from stadium import ConfigError, ServerConfig
from stadium._server.images import build
from stadium._server.processes.worker import isolation_config

RECIPE_ENV = Path(__file__).parents[1] / "openenv_apps" / "recipe_env"


def _template() -> str:
    """OpenEnv's own env template's Dockerfile (from the installed package)."""
    files = importlib.resources.files("openenv.cli").joinpath("templates/openenv_env/server")
    return files.joinpath("Dockerfile").read_text()


def test_the_spelling() -> None:
    assert build.build_spec("build") == (True, None)
    assert build.build_spec("build:localhost/base:trixie") == (True, "localhost/base:trixie")
    assert build.build_spec("localhost/build:1") == (False, None)
    assert build.build_spec(None) == (False, None)


def test_bases_and_their_substitution_in_openenvs_template() -> None:
    text = _template()
    assert build.recipe_bases(text) == ["ghcr.io/huggingface/openenv-base:latest"]
    rebased = build._rebase(text, "localhost/b:1")
    froms = [ln for ln in rebased.splitlines() if ln.startswith("FROM")]
    assert froms == ["FROM localhost/b:1 AS builder", "FROM localhost/b:1"]
    assert "COPY --from=builder /app/.venv /app/.venv" in rebased  # stages are not bases
    assert build.recipe_bases(rebased) == ["localhost/b:1"]


def test_stages_scratch_and_arg_defaults() -> None:
    text = (
        "ARG PY=3.12\nARG REG\nFROM --platform=linux/amd64 python:${PY}-slim AS deps\n"
        "FROM deps AS app\nFROM scratch\nCOPY --from=app / /\nFROM ${REG:-docker.io}/x:1\n"
    )
    assert build.recipe_bases(text) == ["python:3.12-slim", "docker.io/x:1"]
    assert "FROM --platform=linux/amd64 b AS deps" in build._rebase(text, "b")
    assert "FROM deps AS app\nFROM scratch\n" in build._rebase(text, "b")


def test_the_content_key_follows_the_directory(tmp_path: Path) -> None:
    env = tmp_path / "env"
    shutil.copytree(RECIPE_ENV, env)
    recipe = build.find_recipe(str(env))
    assert recipe == str(env / "server" / "Dockerfile")
    key = build.content_key(str(env), recipe, None)
    (env / "__pycache__").mkdir(exist_ok=True)
    (env / "__pycache__" / "x.pyc").write_bytes(b"junk")
    assert build.content_key(str(env), recipe, None) == key  # caches do not count
    assert build.content_key(str(env), recipe, "localhost/b:1") != key  # the base does
    (env / "data").symlink_to("server")
    linked = build.content_key(str(env), recipe, None)
    assert linked != key  # a link to a directory counts as its target's name
    (env / "data").unlink()
    (env / "data").symlink_to("elsewhere")
    assert build.content_key(str(env), recipe, None) not in (key, linked)
    (env / "models.py").write_text("changed\n")
    assert build.content_key(str(env), recipe, None) != key
    assert build._tag(str(env), key) == f"localhost/stadium-build-env:{key[:16]}"


def test_no_recipe_and_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"has no container recipe .*server/Dockerfile"):
        build.build_image(str(tmp_path))
    with pytest.raises(ConfigError, match="is not a directory"):
        build.build_image("echo")


def test_podman_missing_is_said(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigError, match=r"Podman, which is not installed .*container-deps"):
        build.build_image(str(RECIPE_ENV), "localhost/b:1")


def test_the_server_builds_before_it_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--image build:BASE`` reaches the builder with the target directory and the base;
    the sessions' image is what it returns."""
    asked: list[tuple[str, str | None]] = []

    def fake(env_dir: str, base: str | None = None) -> str:
        asked.append((env_dir, base))
        return "localhost/built:1"

    monkeypatch.setattr("stadium._server.processes.worker.build_image", fake)
    monkeypatch.setattr("stadium._server.processes.worker.sandbox_unavailable", lambda: None)
    monkeypatch.setattr("stadium._server.processes.worker.seccomp_unavailable", lambda: None)
    relative = os.path.relpath(RECIPE_ENV)
    cfg = ServerConfig(target=relative, isolation="sandbox", image="build:localhost/b:1")
    settings = isolation_config(cfg, None)
    assert settings is not None
    assert settings.image == "localhost/built:1"
    assert settings.target == str(RECIPE_ENV)  # absolute: the template has another cwd
    assert asked == [(relative, "localhost/b:1")]
