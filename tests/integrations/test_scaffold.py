"""stadium init: the generated project passes its own tests as generated."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import stadium
from stadium._cli.main import main
from stadium._cli.scaffold import create_project, module_name

#: Process-level: servers, tools or interpreters in subprocesses (`make check` skips it).
pytestmark = pytest.mark.slow


def _run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_generated_project_passes_its_own_tests(tmp_path: Path) -> None:
    project = create_project("word-quest", tmp_path)
    assert project == tmp_path / "word-quest"
    files = {p.relative_to(project).as_posix() for p in project.rglob("*") if p.is_file()}
    assert files == {
        ".dockerignore",
        "Dockerfile",
        "README.md",
        "pyproject.toml",
        "src/word_quest/__init__.py",
        "src/word_quest/env.py",
        "tests/test_env.py",
    }
    dockerfile = (project / "Dockerfile").read_text()
    assert "STADIUM_TARGET=word_quest.env:Env" in dockerfile  # the image serves the env
    assert "HOST=0.0.0.0" in dockerfile
    out = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider"], project)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "4 passed" in out.stdout
    check = _run(["-m", "stadium", "check", "word_quest.env:Env"], project, PYTHONPATH="src")
    assert check.returncode == 0, check.stderr
    assert "all 5 checks passed" in check.stdout


def test_init_refuses_to_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["init", "game", "--dir", str(tmp_path)])
    assert "created" in capsys.readouterr().out
    (tmp_path / "game" / "README.md").write_text("mine")
    with pytest.raises(SystemExit) as exc:
        main(["init", "game", "--dir", str(tmp_path)])
    assert exc.value.code == 2
    assert "already exists" in capsys.readouterr().err
    assert (tmp_path / "game" / "README.md").read_text() == "mine"


@pytest.mark.parametrize("name", ["1env", "my env", "class", "json", "stadium", ""])
def test_bad_names_are_config_errors(name: str) -> None:
    with pytest.raises(stadium.ConfigError):
        module_name(name)


def test_names_map_to_modules() -> None:
    assert module_name("My-Env") == "my_env"
