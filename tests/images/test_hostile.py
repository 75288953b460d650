"""A hostile image's author against the store, and another user of the node against its
cache: memory and disk bombs, names no file system holds, configs no process can take, a
cache below a folder others may write. Then the attacks the design already stops, kept as
cheap regressions (index chains, lying media types, deep JSON, links through whiteouts and
replaced symlinks). Hand-made layouts: milliseconds each, no Podman."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import signal
import tarfile
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from stadium import ConfigError
from stadium._server.images import ImageStore
from stadium._server.images import store as store_module
from stadium._server.images.extract import extract_layer
from tests.conftest import UNIT
from tests.images.layouts import Entry, make_layout, overlay_reads

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="the image store extracts layers as root (owners, whiteouts)"
)
MIB = 1 << 20


def _raw(tmp_path: Path, tar: bytes, *, gz: bool = False, **kw: Any) -> str:
    """A layout of one layer given as its tar bytes (gzip-compressed when ``gz``)."""
    diff_id = f"sha256:{hashlib.sha256(tar).hexdigest()}"
    blob = gzip.compress(tar, compresslevel=1, mtime=0) if gz else tar
    layout = make_layout(tmp_path / "layout", [], raw_layers=[blob], diff_ids=[diff_id], **kw)
    return f"oci:{layout}"


def _tar(*members: tuple[tarfile.TarInfo, bytes], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for info, data in members:
            info.size = len(data) if info.isreg() else 0
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return buf.getvalue()


def _info(name: str, kind: bytes = tarfile.REGTYPE, **pax: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mtime, info.pax_headers = kind, 1_700_000_000, dict(pax)
    return info


def _nothing_published(store: ImageStore) -> None:
    root = Path(store.root)
    assert list((root / "layers").iterdir()) == []
    assert list((root / "tmp").iterdir()) == []


# ------------------------------------------------------------------ found and fixed


@pytest.mark.parametrize("kind", ["pax", "gnu-longname", "trailing"])
def test_a_tar_whose_headers_or_tail_expand_without_end_is_refused(
    image_store: ImageStore, tmp_path: Path, kind: str
) -> None:
    # A 2 MiB PAX record (or GNU long name) is held whole in memory by tarfile: a few KiB of
    # gzip could make GiB. Before the fix the first two were extracted (the memory spent).
    big = "x" * (2 * MIB)
    if kind == "pax":
        tar = _tar((_info("f", comment=big), b"ok"))
    elif kind == "gnu-longname":
        tar = _tar((_info("d/" * (MIB // 2) + "f"), b"ok"), fmt=tarfile.GNU_FORMAT)
    else:  # gigabytes of zeros after the end-of-archive, hashed for minutes before
        tar = _tar((_info("f"), b"ok")) + bytes(2 * MIB)
    ref = _raw(tmp_path, tar, gz=True)
    says = "data after the tar's end" if kind == "trailing" else "a tar header .* is over 1024 KiB"
    with pytest.raises(ConfigError, match=says):
        image_store.prepare(ref)
    _nothing_published(image_store)


@pytest.mark.parametrize(
    ("info", "says"),
    [
        (_info("a", path="x\0y"), r"the entry 'x\\x00y' holds a NUL byte"),
        (_info("s", tarfile.SYMTYPE, linkpath="/x\0y"), "the symlink's target .* a NUL byte"),
        (_info("f", **{"SCHILY.xattr.user.a\0b": "v"}), "the attribute .* a NUL byte"),
        (_info("a" * 256), r"longer than Linux allows \(255 bytes a name"),
        (_info("a/" * 2100 + "f"), "longer than Linux allows"),
    ],
    ids=["nul-name", "nul-symlink", "nul-xattr", "name-max", "path-max"],
)
def test_names_no_file_system_holds_are_refused_with_what_is_wrong(
    image_store: ImageStore, tmp_path: Path, info: tarfile.TarInfo, says: str
) -> None:
    # Before: a NUL was a ValueError escaping the store (not a ConfigError: a worker's reset
    # failed with a traceback); a long name was said to be "a symlink or a file".
    with pytest.raises(ConfigError, match=says):
        image_store.prepare(_raw(tmp_path, _tar((info, b""))))
    _nothing_published(image_store)


@pytest.mark.parametrize(
    ("env", "workdir"), [(("A=x\0y",), "/work"), (("A=1",), "/wo\0rk")], ids=["env", "workdir"]
)
def test_a_config_no_process_can_take_is_refused_when_prepared(
    image_store: ImageStore, tmp_path: Path, env: tuple[str, ...], workdir: str
) -> None:
    # Before: prepared; each session of the image then died in its sandbox (os.environ and
    # chdir raise ValueError on a NUL) with nothing saying why.
    layout = make_layout(tmp_path / "layout", [[Entry("f")]], env=env, workdir=workdir)
    with pytest.raises(ConfigError, match=r"holds a NUL byte.*ENV/WORKDIR"):
        image_store.prepare(f"oci:{layout}")


def test_a_cache_below_a_folder_others_may_write_is_refused(tmp_path: Path) -> None:
    # Another user could rename the cache away and plant one whose records name any host
    # folder as a layer (sessions would mount it). Before: accepted.
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(ConfigError, match="another user could replace the cache"):
        ImageStore(str(shared / "cache")).images()
    os.chmod(shared, 0o1777)  # sticky, like /tmp: nobody else may rename what is ours
    assert ImageStore(str(shared / "cache")).images() == []


def test_without_a_budget_a_layer_cannot_fill_the_disk(
    image_store: ImageStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 8 MiB of zeros (8 KiB of gzip) on a 20 GiB disk with 1 GiB + 7 MiB free (5% kept).
    # Before: extracted (a few MiB of gzip filled any disk without --image-cache-mib, the
    # default).
    assert image_store.budget_bytes is None
    ref = _raw(tmp_path, _tar((_info("zeros"), bytes(8 * MIB))), gz=True)

    _disk(monkeypatch, free_mib=1024 + 7)
    with pytest.raises(ConfigError, match="free space of the image cache's disk"):
        image_store.prepare(ref)
    _nothing_published(image_store)


def test_a_layer_cannot_take_the_disks_last_inodes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 80 empty files on a disk with 100 inodes free of 1000 (5% kept: 50 for the layer).
    # Before: extracted (millions of empty files: a few MiB of gzip, any disk's inodes).
    store = ImageStore(str(tmp_path / "cache"), budget_bytes=64 * MIB)
    ref = _raw(tmp_path, _tar(*((_info(f"f{i}"), b"") for i in range(80))), gz=True)
    _disk(monkeypatch, free_mib=1024, inodes=(1000, 100))
    with pytest.raises(ConfigError, match=r"more than 50 entries, more than .* inodes free"):
        store.prepare(ref)
    _nothing_published(store)


def test_a_layer_of_huge_entries_is_extracted_in_bounded_memory(tmp_path: Path) -> None:
    # 200 directories of 128 KiB of PAX records each (~40 KiB of gzip): tarfile kept every
    # entry read, and the store every directory's entry until the end. Before: ~25 MiB
    # traced (a 100 MiB blob: 100 GiB); now what one entry takes.
    tar = _tar(*((_info(f"d{i}", tarfile.DIRTYPE, comment="x" * (128 << 10)), b"")
                 for i in range(200)))  # fmt: skip
    blob = gzip.compress(tar, compresslevel=1, mtime=0)
    dest = tmp_path / "layer"
    dest.mkdir()
    digest = f"sha256:{hashlib.sha256(tar).hexdigest()}"
    tracemalloc.start()
    try:
        extract_layer(
            io.BytesIO(blob), str(dest), what="L", diff_id=digest,
            blob_digest=f"sha256:{hashlib.sha256(blob).hexdigest()}",
        )  # fmt: skip
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(list(dest.iterdir())) == 200
    assert peak < 12 * MIB, f"{peak >> 20} MiB traced"


def _disk(monkeypatch: pytest.MonkeyPatch, free_mib: int, inodes: tuple[int, int] = (0, 0)) -> None:
    """The cache's disk as os.statvfs tells the store: 20 GiB of which ``free_mib`` are free,
    ``inodes`` (total, free; 0: not counted, as btrfs)."""

    class Disk:
        f_frsize, f_blocks, f_bavail = 4096, (20 << 30) // 4096, (free_mib << 20) // 4096
        f_files, f_favail = inodes

    monkeypatch.setattr(store_module.os, "statvfs", lambda path: Disk())


@pytest.mark.parametrize("what", ["index", "layer"])
def test_a_layout_whose_files_are_a_fifo_or_a_device_is_refused(
    image_store: ImageStore, tmp_path: Path, what: str
) -> None:
    # Before: open() of a FIFO blocked for ever (the store's locks held, `stadium images
    # prune` waiting behind them); a layer linked to /dev/zero was hashed without end.
    layout = make_layout(tmp_path / "layout", [[Entry("f")]])
    if what == "index":
        (layout / "index.json").unlink()
        os.mkfifo(layout / "index.json")
    else:
        manifest = json.loads((layout / "index.json").read_text())["manifests"][0]["digest"]
        blobs = layout / "blobs/sha256"
        layer = json.loads((blobs / manifest[7:]).read_text())["layers"][0]["digest"][7:]
        (blobs / layer).unlink()
        (blobs / layer).symlink_to("/dev/zero")

    def hung(signum: int, frame: object) -> None:
        raise TimeoutError("the store blocked on the layout's file")

    old = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, 10 * UNIT)
    try:
        with pytest.raises(ConfigError, match="is not a regular file: the layout is malformed"):
            image_store.prepare(f"oci:{layout}")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    _nothing_published(image_store)


# ------------------------------------------------------------------ stopped by design


def _put(root: Path, doc: object) -> str:
    data = json.dumps(doc).encode()
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs" / "sha256" / digest).write_bytes(data)
    return f"sha256:{digest}"


def test_index_chains_and_lying_media_types_are_refused(
    image_store: ImageStore, tmp_path: Path
) -> None:
    layout = make_layout(tmp_path / "layout", [[Entry("f")]])
    index = json.loads((layout / "index.json").read_text())
    manifest = index["manifests"][0]["digest"]
    config = json.loads((layout / "blobs/sha256" / manifest[7:]).read_text())["config"]
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(os.uname().machine, os.uname().machine)
    nested = "application/vnd.oci.image.index.v1+json"
    target = {"mediaType": nested, "digest": manifest}
    for _ in range(5):  # indexes within indexes (a cycle cannot be: each names a digest)
        target = {"mediaType": nested, "platform": {"os": "linux", "architecture": arch},
                  "digest": _put(layout, {"manifests": [target]})}  # fmt: skip
    deep = b'{"manifests": [], "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    (layout / "blobs/sha256" / hashlib.sha256(deep).hexdigest()).write_bytes(deep)
    lies = {  # the descriptor, what the refusal says
        "chain": (target, "the manifest .* is not what an OCI layout holds"),
        "config-as-manifest": (
            {"mediaType": index["manifests"][0]["mediaType"], **config},
            "the manifest .* is not what an OCI layout holds: Object missing required field",
        ),
        "deep": (
            {"mediaType": nested, "digest": f"sha256:{hashlib.sha256(deep).hexdigest()}"},
            "nested more deeply than the decoder allows",
        ),
    }
    for name, (desc, says) in lies.items():
        (layout / "index.json").write_text(json.dumps({"manifests": [desc]}))
        with pytest.raises(ConfigError, match=says):
            image_store.prepare(f"oci:{layout}")
        assert image_store.images() == [], name


def test_links_through_whiteouts_and_replaced_directories_are_refused(
    image_store: ImageStore, tmp_path: Path
) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    cases = {  # the entries, what the refusal says
        "hard link to a whiteout": (
            [Entry(".wh.gone"), Entry("x", "hardlink", target="gone")],
            "the hard link 'x' points at 'gone', which is not a file earlier",
        ),
        "whiteout of ..": ([Entry("d", "dir"), Entry("d/.wh...")], "the whiteout .* malformed"),
        "a dir replaced by a symlink, then written through": (
            [
                Entry("a", "dir"),
                Entry("a/f", data=b"1"),
                Entry("a", "symlink", target=str(victim)),
                Entry("a/pwn", data=b"x"),
            ],
            "'a' is used as a directory but is a symlink",
        ),
    }
    for i, (name, (entries, says)) in enumerate(cases.items()):
        layout = make_layout(tmp_path / f"l{i}", [entries])
        with pytest.raises(ConfigError, match=says):
            image_store.prepare(f"oci:{layout}")
        assert list(victim.iterdir()) == [], name
        _nothing_published(image_store)


def test_a_lower_layers_symlink_is_not_written_through_by_the_next_layer(
    image_store: ImageStore, tmp_path: Path
) -> None:
    # Layer 1: etc -> the host's folder; layer 2: etc/pwn. Each layer is extracted on its
    # own (layer 2 makes a directory etc), and overlayfs shows the upper directory.
    victim = tmp_path / "victim"
    victim.mkdir()
    layout = make_layout(tmp_path / "layout", [
        [Entry("etc", "symlink", target=str(victim))],
        [Entry("etc/pwn", data=b"inside")],
    ])  # fmt: skip
    image = image_store.prepare(f"oci:{layout}")
    assert list(victim.iterdir()) == []
    overlay_reads(image.layers, {"etc/pwn": "inside"})


def test_a_layer_given_twice_mounts_once_where_it_is_topmost(
    image_store: ImageStore, tmp_path: Path
) -> None:
    # Before: layers (X, Y, X) were three lowerdirs, two the same folder: overlayfs refused
    # the mount ("conflicting lowerdir path"), so every session of the image failed.
    x = [Entry("f", data=b"x"), Entry("g", data=b"x")]
    layout = make_layout(tmp_path / "layout", [x, [Entry("f", data=b"y")], x])
    image = image_store.prepare(f"oci:{layout}")
    assert len(image.layers) == 2
    overlay_reads(image.layers, {"f": "x", "g": "x"})


def test_a_half_extracted_layer_of_a_killed_worker_is_never_used(
    image_store: ImageStore, tmp_path: Path
) -> None:
    # What a worker killed mid-extraction leaves: tmp/layer-HEX, no layers/HEX. The next
    # preparation (under that layer's lock) starts it again; nothing half is published.
    layout = make_layout(tmp_path / "layout", [[Entry("whole", data=b"1")]])
    hexd = image_store.prepare(f"oci:{layout}").layers[0].rsplit("/", 1)[1]
    image_store.prune(keep_bytes=0)
    partial = Path(image_store.root, "tmp", f"layer-{hexd}")
    partial.mkdir()
    (partial / "half").write_bytes(b"")
    layer = Path(image_store.prepare(f"oci:{layout}").layers[0])
    assert sorted(p.name for p in layer.iterdir()) == ["whole"]
    assert not partial.exists()
