"""Real images from Podman's storage (tests/images/conftest.py builds them once per machine):
every REF kind of one image prepares to the same layers and config, layers are shared
between images, whiteouts work under overlayfs, a missing image says so."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from stadium import ConfigError
from stadium._server.images import ImageStore, PreparedImage
from tests.conftest import UNIT
from tests.images.conftest import TASK_A, TASK_B
from tests.images.layouts import overlay_reads

pytestmark = [pytest.mark.slow, pytest.mark.container, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def prepared(
    task_images: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> tuple[ImageStore, dict[str, PreparedImage]]:
    """One store with the three task images prepared from Podman's storage."""
    store = ImageStore(str(tmp_path_factory.mktemp("images") / "cache"))
    return store, {name: store.prepare(ref) for name, ref in task_images.items()}


def _tree(layer: str) -> list[tuple[str, int, int, int, int, str]]:
    """Every entry of a layer: path, mode, owner, size (files), link target."""
    out = []
    for dirpath, dirnames, filenames in os.walk(layer):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            size = st.st_size if os.path.isfile(path) and not os.path.islink(path) else 0
            link = os.readlink(path) if os.path.islink(path) else ""
            out.append((os.path.relpath(path, layer), st.st_mode, st.st_uid, st.st_gid, size,
                        link))  # fmt: skip
    return sorted(out)


def test_every_ref_kind_prepares_the_same_image(
    prepared: tuple[ImageStore, dict[str, PreparedImage]],
    task_a_oci: str,
    task_a_archive: str,
    task_a_rootfs: str,
    tmp_path: Path,
) -> None:
    store, images = prepared
    a = images["a"]
    assert a.config.env["STADIUM_TASK"] == "a"
    assert a.config.workdir == "/work/repo"
    assert len(a.layers) == 3
    # The archive into an empty store: the same layers, entry for entry.
    other = ImageStore(str(tmp_path / "cache"))
    from_archive = other.prepare(task_a_archive)
    assert (from_archive.digest, from_archive.config) == (a.digest, a.config)
    assert [Path(p).name for p in from_archive.layers] == [Path(p).name for p in a.layers]
    for mine, theirs in zip(a.layers, from_archive.layers, strict=True):
        assert _tree(mine) == _tree(theirs)
    from_dir = other.prepare(task_a_oci)
    assert (from_dir.digest, from_dir.layers, from_dir.config) == (
        from_archive.digest, from_archive.layers, from_archive.config)  # fmt: skip
    # The root filesystem: used in place, one layer, the same files.
    rootfs = store.prepare(task_a_rootfs)
    assert rootfs.layers == (os.path.realpath(task_a_rootfs.removeprefix("dir:")),)
    assert Path(rootfs.layers[0], "etc/stadium-image").read_text() == "a\n"
    assert Path(rootfs.layers[0], "work/repo/calc/__init__.py").is_file()
    assert store.prepare(task_a_rootfs) == rootfs


def test_layers_are_shared_between_images(
    prepared: tuple[ImageStore, dict[str, PreparedImage]],
) -> None:
    store, images = prepared
    a, b, wh = images["a"], images["b"], images["wh"]
    assert a.layers[0] == b.layers[0]  # the base, extracted once
    assert wh.layers[:3] == a.layers
    assert store.stats().layers == len({*a.layers, *b.layers, *wh.layers}) == 5
    assert Path(b.layers[1], "etc/stadium-image").read_text() == "b\n"


def test_whiteouts_delete_and_opaque_directories_hide_under_overlayfs(
    prepared: tuple[ImageStore, dict[str, PreparedImage]],
) -> None:
    _, images = prepared
    overlay_reads(images["a"].layers, {
        "etc/stadium-image": "a", "work/repo/pyproject.toml": "[project]",
        "work/repo/NEW": None,
    })  # fmt: skip
    os_release = Path(images["a"].layers[0], "usr/lib/os-release").read_text().split("\n")[0]
    overlay_reads(images["wh"].layers, {
        "etc/stadium-image": None, "work/repo/pyproject.toml": None, "work/repo/NEW": "fresh",
        "etc/os-release": os_release,
    })  # fmt: skip


def test_an_image_podman_does_not_have_says_so(
    prepared: tuple[ImageStore, dict[str, PreparedImage]],
) -> None:
    store, _ = prepared
    with pytest.raises(ConfigError, match="no such image in Podman's storage"):
        store.prepare("localhost/stadium-no-such-image:test")


def test_a_tag_moved_in_podman_is_followed(
    prepared: tuple[ImageStore, dict[str, PreparedImage]], podman: str
) -> None:
    store, images = prepared
    moving = "localhost/stadium-task-moving:test"
    try:
        subprocess.run([podman, "tag", TASK_A, moving], check=True, timeout=60 * UNIT)
        assert store.prepare(moving).digest == images["a"].digest
        subprocess.run([podman, "tag", TASK_B, moving], check=True, timeout=60 * UNIT)
        assert store.prepare(moving).digest == images["b"].digest
    finally:
        subprocess.run([podman, "untag", moving], check=False, timeout=60 * UNIT)
