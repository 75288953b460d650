"""Layers the store extracts: hostile tars refused or contained, whiteouts made overlayfs',
digests checked, compression told by content. Hand-made layouts (tests/images/layouts.py):
milliseconds each, no Podman. Root: extraction sets owners, makes whiteout devices and sets
``trusted.*`` attributes."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from stadium import ConfigError
from stadium._server.images import ImageStore
from tests.images.layouts import Entry, layer_tar, make_layout, overlay_reads

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="the image store extracts layers as root (owners, whiteouts)"
)


def _prepare(store: ImageStore, tmp_path: Path, layers: list[list[Entry]], **kw: object) -> str:
    layout = make_layout(tmp_path / "layout", layers, **kw)  # type: ignore[arg-type]
    return f"oci:{layout}"


def _nothing_published(store: ImageStore) -> None:
    root = Path(store.root)
    assert [p.name for p in (root / "layers").iterdir()] == []
    assert [p.name for p in (root / "tmp").iterdir()] == []
    assert store.images() == []


def test_a_dotdot_entry_is_refused_and_writes_nothing(
    image_store: ImageStore, tmp_path: Path
) -> None:
    victim = tmp_path / "victim"
    ref = _prepare(image_store, tmp_path, [[
        Entry("ok", data=b"fine"),
        Entry("../../../victim", data=b"pwned"),  # the layer is tmp_path/images/tmp/X
    ]])  # fmt: skip
    with pytest.raises(ConfigError, match=r"escapes the layer \(\.\.\)"):
        image_store.prepare(ref)
    assert not victim.exists()
    _nothing_published(image_store)


def test_an_absolute_entry_is_contained_in_the_layer(
    image_store: ImageStore, tmp_path: Path
) -> None:
    outside = tmp_path / "abs-target"
    ref = _prepare(image_store, tmp_path, [[Entry(str(outside), data=b"inside")]])
    image = image_store.prepare(ref)
    assert not outside.exists()
    inside = Path(image.layers[0], str(outside).lstrip("/"))
    assert inside.read_bytes() == b"inside"


def test_a_symlinked_parent_is_never_followed(image_store: ImageStore, tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.mkdir()
    ref = _prepare(image_store, tmp_path, [[
        Entry("lnk", kind="symlink", target=str(target)),
        Entry("lnk/pwned", data=b"x"),
    ]])  # fmt: skip
    with pytest.raises(ConfigError, match="symlink or a file in this layer: refused"):
        image_store.prepare(ref)
    assert list(target.iterdir()) == []
    _nothing_published(image_store)


@pytest.mark.parametrize("target", ["/etc/shadow", "etc/shadow", "../../../../etc/shadow"])
def test_a_hard_link_out_of_the_layer_is_refused(
    image_store: ImageStore, tmp_path: Path, target: str
) -> None:
    links_before = os.stat("/etc/shadow").st_nlink
    ref = _prepare(image_store, tmp_path, [[Entry("shadow", kind="hardlink", target=target)]])
    with pytest.raises(ConfigError, match="refused"):
        image_store.prepare(ref)
    assert os.stat("/etc/shadow").st_nlink == links_before
    _nothing_published(image_store)


def test_what_is_kept_and_what_is_dropped(image_store: ImageStore, tmp_path: Path) -> None:
    """Devices skipped, FIFOs made, setuid kept, owners kept, a hard link within the layer
    made, ``user.*`` kept and ``trusted.overlay.*`` (a redirect to another layer) dropped."""
    ref = _prepare(image_store, tmp_path, [[
        Entry("bin", kind="dir", mode=0o755),
        Entry("bin/su", data=b"#!/bin/sh\n", mode=0o4755, uid=0),
        Entry("bin/same", kind="hardlink", target="bin/su"),
        Entry("home/u/f", data=b"mine", uid=1234, gid=4321, mode=0o600,
              xattrs={"user.note": "kept", "trusted.overlay.redirect": "/etc"}),
        Entry("dev/mem", kind="chr", dev=(1, 1)),
        Entry("dev/null", kind="chr", dev=(1, 3)),
        Entry("run/fifo", kind="fifo", mode=0o600),
    ]])  # fmt: skip
    layer = Path(image_store.prepare(ref).layers[0])
    su = os.lstat(layer / "bin/su")
    assert stat.S_IMODE(su.st_mode) == 0o4755
    assert os.lstat(layer / "bin/same").st_ino == su.st_ino
    home = os.lstat(layer / "home/u/f")
    assert (home.st_uid, home.st_gid, stat.S_IMODE(home.st_mode)) == (1234, 4321, 0o600)
    assert os.getxattr(layer / "home/u/f", "user.note") == b"kept"
    assert "trusted.overlay.redirect" not in os.listxattr(layer / "home/u/f")
    assert sorted(os.listdir(layer / "dev")) == []
    assert stat.S_ISFIFO(os.lstat(layer / "run/fifo").st_mode)


def test_whiteouts_become_overlayfs_whiteouts(image_store: ImageStore, tmp_path: Path) -> None:
    ref = _prepare(image_store, tmp_path, [
        [Entry("etc/gone", data=b"lower"), Entry("etc/kept", data=b"lower"),
         Entry("opq/old", data=b"lower")],
        [Entry("etc/.wh.gone"), Entry("opq", kind="dir", mode=0o755),
         Entry("opq/.wh..wh..opq"), Entry("opq/new", data=b"upper")],
    ])  # fmt: skip
    image = image_store.prepare(ref)
    upper = Path(image.layers[1])
    st = os.lstat(upper / "etc/gone")
    assert stat.S_ISCHR(st.st_mode)
    assert st.st_rdev == os.makedev(0, 0)
    assert not (upper / "etc/.wh.gone").exists()
    assert os.getxattr(upper / "opq", "trusted.overlay.opaque") == b"y"
    assert not (upper / "opq/.wh..wh..opq").exists()
    overlay_reads(image.layers, {
        "etc/gone": None, "etc/kept": "lower", "opq/old": None, "opq/new": "upper",
    })  # fmt: skip


def test_a_layer_not_matching_its_diff_id_is_refused(
    image_store: ImageStore, tmp_path: Path
) -> None:
    liar = "sha256:" + "0" * 64
    ref = _prepare(image_store, tmp_path, [[Entry("f", data=b"x")]], diff_ids=[liar])
    with pytest.raises(ConfigError, match="image is corrupt or was changed"):
        image_store.prepare(ref)
    _nothing_published(image_store)


def test_gzip_layers_and_a_clear_error_for_zstd_without_a_library(
    image_store: ImageStore, tmp_path: Path
) -> None:
    gz = make_layout(tmp_path / "gz", [[Entry("f", data=b"gz")]], gzip_layers=True)
    image = image_store.prepare(f"oci:{gz}")
    assert Path(image.layers[0], "f").read_bytes() == b"gz"
    tar = layer_tar([Entry("f", data=b"z")])
    frame = b"\x28\xb5\x2f\xfd" + b"\x00" * 16  # a zstd magic: told by content, not media type
    import hashlib

    zs = make_layout(tmp_path / "zs", [], raw_layers=[frame],
                     diff_ids=[f"sha256:{hashlib.sha256(tar).hexdigest()}"])  # fmt: skip
    try:
        import zstandard  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="zstd-compressed and no zstd library"):
            image_store.prepare(f"oci:{zs}")
    else:
        with pytest.raises(ConfigError):
            image_store.prepare(f"oci:{zs}")


def test_an_entry_too_deep_is_refused(image_store: ImageStore, tmp_path: Path) -> None:
    ref = _prepare(image_store, tmp_path, [[Entry("d/" * 200 + "f", data=b"x")]])
    with pytest.raises(ConfigError, match="deep: refused"):
        image_store.prepare(ref)
    _nothing_published(image_store)


def test_a_later_entry_replaces_an_earlier_one(image_store: ImageStore, tmp_path: Path) -> None:
    ref = _prepare(image_store, tmp_path, [[
        Entry("a/b/c", data=b"deep"), Entry("a/b", kind="dir", mode=0o700),
        Entry("a", data=b"now a file"), Entry("x", kind="symlink", target="/nowhere"),
        Entry("x", kind="dir", mode=0o755), Entry("x/y", data=b"in x"),
    ]])  # fmt: skip
    layer = Path(image_store.prepare(ref).layers[0])
    assert (layer / "a").read_bytes() == b"now a file"
    assert (layer / "x/y").read_bytes() == b"in x"
