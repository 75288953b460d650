"""Task images for tests, built here without a registry, and an empty image store per test.

Built once per machine FROM ``localhost/stadium-test-base:trixie`` (tests/container/conftest.py
makes it) and kept in Podman's storage; rebuilt only when their recipe changes (a label holds
its hash):

* ``localhost/stadium-task-a:test``: ``/etc/stadium-image`` says ``a``; a tiny Python project
  in ``/work/repo`` (``calc.add`` and its unittest), ``WORKDIR /work/repo``, ``ENV STADIUM_TASK=a``;
* ``localhost/stadium-task-b:test``: ``/etc/stadium-image`` says ``b``;
* ``localhost/stadium-task-wh:test``: FROM task-a, one layer deleting ``/etc/stadium-image``
  (a whiteout) and replacing ``/work/repo`` by a directory holding only ``NEW`` (opaque).

Task A also as an OCI layout, an OCI archive and a root filesystem directory, cached under
``/var/cache/stadium-tests/task-images/ID`` (``podman save``, ``podman export | tar x``).
Every fixture returns REFs (``ImageStore.prepare`` takes them). Reuse them from another test
folder with ``from tests.images.conftest import *  # noqa: F403``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from stadium._server.images import ImageStore
from tests.container.conftest import CACHE, _locked, _must, _run, base_image, podman

__all__ = [
    "TASK_A",
    "TASK_B",
    "TASK_WH",
    "base_image",
    "image_store",
    "podman",
    "task_a_archive",
    "task_a_oci",
    "task_a_rootfs",
    "task_images",
]

TASK_A = "localhost/stadium-task-a:test"
TASK_B = "localhost/stadium-task-b:test"
TASK_WH = "localhost/stadium-task-wh:test"
_LABEL = "stadium.test.recipe"

_CALC = '''"""A tiny project for task images."""


def add(a: int, b: int) -> int:
    return a + b
'''
_TEST_CALC = """import unittest

from calc import add


class AddTest(unittest.TestCase):
    def test_add(self) -> None:
        self.assertEqual(add(2, 3), 5)


if __name__ == "__main__":
    unittest.main()
"""
_PYPROJECT = '[project]\nname = "calc"\nversion = "0.1.0"\n'


def _recipes(base: str) -> dict[str, tuple[str, dict[str, str]]]:
    """Each image: its Containerfile and the files of its build context."""
    return {
        TASK_A: (
            f"FROM {base}\nCOPY stadium-image /etc/stadium-image\nCOPY repo /work/repo\n"
            "WORKDIR /work/repo\nENV STADIUM_TASK=a\n",
            {
                "stadium-image": "a\n",
                "repo/pyproject.toml": _PYPROJECT,
                "repo/calc/__init__.py": _CALC,
                "repo/tests/test_calc.py": _TEST_CALC,
            },
        ),
        TASK_B: (
            f"FROM {base}\nCOPY stadium-image /etc/stadium-image\nENV STADIUM_TASK=b\n",
            {"stadium-image": "b\n"},
        ),
        TASK_WH: (
            f"FROM {TASK_A}\nRUN rm /etc/stadium-image && rm -rf /work/repo && "
            "mkdir /work/repo && echo fresh > /work/repo/NEW\n",
            {},
        ),
    }


def _label(podman: str, image: str) -> str:
    out = _run([podman, "image", "inspect", "--format", f'{{{{index .Labels "{_LABEL}"}}}}',
                image], 60)  # fmt: skip
    return out.stdout.strip() if out.returncode == 0 else ""


def _build(podman: str, image: str, recipe: tuple[str, dict[str, str]], key: str) -> None:
    containerfile, files = recipe
    with tempfile.TemporaryDirectory(prefix="stadium-task-", dir="/var/tmp") as ctx:
        for rel, text in files.items():
            path = Path(ctx, rel)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        Path(ctx, "Containerfile").write_text(f"{containerfile}LABEL {_LABEL}={key}\n")
        _must([podman, "build", "--pull=never", "--network", "none", "--format", "oci",
               "-t", image, "-f", str(Path(ctx, "Containerfile")), ctx], 600)  # fmt: skip


@pytest.fixture(scope="session")
def task_images(podman: str, base_image: str) -> dict[str, str]:
    """The three task images' REFs, by name (``a``, ``b``, ``wh``), built if missing."""
    recipes = _recipes(base_image)
    base_id = _must([podman, "image", "inspect", "--format", "{{.Id}}", base_image], 60).strip()
    keys: dict[str, str] = {}
    for image, recipe in recipes.items():  # in order: task-wh is FROM task-a (its key too)
        keys[image] = hashlib.sha256(repr((base_id, recipe, keys)).encode()).hexdigest()[:16]
        if _label(podman, image) == keys[image]:
            continue
        with _locked("task-images"):
            if _label(podman, image) != keys[image]:
                _build(podman, image, recipe, keys[image])
    return {"a": TASK_A, "b": TASK_B, "wh": TASK_WH}


def _variant(podman: str, image: str, name: str) -> Path:
    """Task A's export ``name`` (oci, archive.tar, rootfs), cached per image ID."""
    image_id = _must([podman, "image", "inspect", "--format", "{{.Id}}", image], 60).strip()
    final = CACHE / "task-images" / image_id[:16] / name
    if final.exists():
        return final
    with _locked("task-images"):
        if final.exists():
            return final
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=final.parent))
        out = tmp / name
        try:
            if name == "oci":
                _must(
                    [podman, "save", "--quiet", "--format", "oci-dir", "-o", str(out), image], 600
                )
            elif name == "archive.tar":
                _must([podman, "save", "--quiet", "--format", "oci-archive", "-o", str(out),
                       image], 600)  # fmt: skip
            else:
                _export(podman, image, out)
            os.rename(out, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _export(podman: str, image: str, out: Path) -> None:
    container = _must([podman, "create", "--network", "none", image, "true"], 120).strip()
    try:
        out.mkdir(mode=0o755)
        export = subprocess.Popen([podman, "export", container], stdout=subprocess.PIPE)
        assert export.stdout is not None
        try:
            subprocess.run(["tar", "-C", str(out), "--numeric-owner", "-xpf", "-"],
                           stdin=export.stdout, check=True, timeout=600)  # fmt: skip
        finally:
            export.stdout.close()
            assert export.wait(600) == 0, "podman export failed"
    finally:
        _run([podman, "rm", "--force", container], 120)


@pytest.fixture(scope="session")
def task_a_oci(podman: str, task_images: dict[str, str]) -> str:
    """Task A as an OCI layout directory: ``oci:DIR``."""
    return f"oci:{_variant(podman, TASK_A, 'oci')}"


@pytest.fixture(scope="session")
def task_a_archive(podman: str, task_images: dict[str, str]) -> str:
    """Task A as an OCI archive: ``oci-archive:FILE``."""
    return f"oci-archive:{_variant(podman, TASK_A, 'archive.tar')}"


@pytest.fixture(scope="session")
def task_a_rootfs(podman: str, task_images: dict[str, str]) -> str:
    """Task A's root filesystem as a directory: ``dir:DIR``."""
    return f"dir:{_variant(podman, TASK_A, 'rootfs')}"


@pytest.fixture
def image_store(tmp_path: Path) -> ImageStore:
    """An empty store in the test's temporary directory (0700, as the store wants it)."""
    root = tmp_path / "images"
    return ImageStore(str(root))
