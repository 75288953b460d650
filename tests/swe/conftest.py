"""The example SWE task images (``examples/swe/tasks/ID/Containerfile``), built once per machine.

Built FROM ``localhost/stadium-test-base:trixie`` (``tests/container/conftest.py`` makes it),
kept in Podman's storage as ``localhost/stadium-swe-ID:1`` (what ``examples/swe/tasks.jsonl``
names) and rebuilt only when the recipe changes (a label holds its hash); each is also
exported once to a root filesystem directory under ``/var/cache/stadium-tests/swe-rootfs``,
the ``dir:`` REF an image-backed sandbox takes.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import UNIT
from tests.container.conftest import CACHE, _locked, _must, _run, base_image, podman
from tests.swe.tasks import EXAMPLES, image_tasks

__all__ = ["base_image", "podman", "swe_images"]

_LABEL = "stadium.test.recipe"


def _recipe_key(folder: Path, base_id: str) -> str:
    digest = hashlib.sha256(base_id.encode())
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(folder)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _export(podman: str, image: str, dest: Path) -> None:
    """``image``'s root filesystem into ``dest`` (made beside it, then renamed into place)."""
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cid = _must([podman, "create", image, "true"], 120).strip()
    try:
        export = subprocess.Popen([podman, "export", cid], stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", str(tmp)], stdin=export.stdout, check=True,
                       timeout=300 * UNIT)  # fmt: skip
        assert export.stdout is not None
        export.stdout.close()
        assert export.wait(60 * UNIT) == 0
    finally:
        _run([podman, "rm", "-f", cid], 120)
    tmp.rename(dest)


@pytest.fixture(scope="session")
def swe_images(podman: str, base_image: str) -> dict[str, str]:
    """Each example task's image, built if missing: instance_id -> its ``dir:`` REF."""
    base_id = _must([podman, "image", "inspect", "--format", "{{.Id}}", base_image], 60).strip()
    refs = {}
    for task in image_tasks():
        name, image = task["instance_id"], task["image"]
        folder = EXAMPLES / "tasks" / name
        key = _recipe_key(folder, base_id)
        rootfs = CACHE / "swe-rootfs" / f"{name}-{key}"
        with _locked("swe-images"):
            labels = f'{{{{index .Labels "{_LABEL}"}}}}'
            label = _run([podman, "image", "inspect", "--format", labels, image], 60).stdout.strip()
            if label != key:
                _must([podman, "build", "--pull=never", "--network", "none", "--format", "oci",
                       "--label", f"{_LABEL}={key}", "-t", image, str(folder)], 600)  # fmt: skip
            if not rootfs.is_dir():
                rootfs.parent.mkdir(parents=True, exist_ok=True)
                _export(podman, image, rootfs)
        refs[name] = f"dir:{rootfs}"
    return refs
