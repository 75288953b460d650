"""Hand-made OCI image layouts for the store's tests: layers from lists of tar entries.

No Podman: each layout is a few files written here, so hostile layers (``../``, symlinked
parents, hard links out, devices, overlayfs xattrs) and many small images cost milliseconds.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
import subprocess
import tarfile
from pathlib import Path

from tests.conftest import UNIT


@dataclasses.dataclass
class Entry:
    """A tar entry: ``kind`` one of file, dir, symlink, hardlink, chr, fifo."""

    name: str
    kind: str = "file"
    data: bytes = b""
    target: str = ""
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    xattrs: dict[str, str] = dataclasses.field(default_factory=dict)
    dev: tuple[int, int] = (0, 0)


_TYPES = {
    "file": tarfile.REGTYPE,
    "dir": tarfile.DIRTYPE,
    "symlink": tarfile.SYMTYPE,
    "hardlink": tarfile.LNKTYPE,
    "chr": tarfile.CHRTYPE,
    "fifo": tarfile.FIFOTYPE,
}


def layer_tar(entries: list[Entry]) -> bytes:
    """An uncompressed tar (PAX) of ``entries``, in order."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for e in entries:
            info = tarfile.TarInfo(e.name)
            info.type = _TYPES[e.kind]
            info.mode, info.uid, info.gid, info.mtime = e.mode, e.uid, e.gid, 1_700_000_000
            info.linkname = e.target
            info.devmajor, info.devminor = e.dev
            if e.xattrs:
                info.pax_headers = {f"SCHILY.xattr.{k}": v for k, v in e.xattrs.items()}
            if e.kind == "file":
                info.size = len(e.data)
                tar.addfile(info, io.BytesIO(e.data))
            else:
                tar.addfile(info)
    return buf.getvalue()


def _put(root: Path, data: bytes) -> tuple[str, int]:
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs" / "sha256" / digest).write_bytes(data)
    return f"sha256:{digest}", len(data)


def make_layout(
    root: Path,
    layers: list[list[Entry]],
    *,
    tag: str | None = None,
    gzip_layers: bool = False,
    env: tuple[str, ...] = ("PATH=/usr/bin:/bin", "TASK=x"),
    workdir: str = "/work",
    diff_ids: list[str] | None = None,
    raw_layers: list[bytes] | None = None,
) -> Path:
    """Write (or add an image to) an OCI layout at ``root``; returns ``root``.

    ``diff_ids`` overrides the config's (to make a lying image); ``raw_layers`` gives the
    blobs as they are (e.g. zstd) with ``diff_ids``.
    """
    (root / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    descs, ids = [], []
    blobs = raw_layers if raw_layers is not None else [layer_tar(e) for e in layers]
    for tar in blobs:
        ids.append(f"sha256:{hashlib.sha256(tar).hexdigest()}")
        blob = gzip.compress(tar, mtime=0) if gzip_layers else tar
        digest, size = _put(root, blob)
        media = "application/vnd.oci.image.layer.v1.tar" + ("+gzip" if gzip_layers else "")
        descs.append({"mediaType": media, "digest": digest, "size": size})
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": list(env), "WorkingDir": workdir, "Cmd": ["/bin/sh"]},
        "rootfs": {"type": "layers", "diff_ids": diff_ids or ids},
    }
    cdigest, csize = _put(root, json.dumps(config).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": cdigest, "size": csize},
        "layers": descs,
    }  # fmt: skip
    mdigest, msize = _put(root, json.dumps(manifest).encode())
    index_path = root / "index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else {
        "schemaVersion": 2, "manifests": []}  # fmt: skip
    desc: dict[str, object] = {
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "digest": mdigest,
        "size": msize,
    }
    if tag:
        desc["annotations"] = {"org.opencontainers.image.ref.name": tag}
    index["manifests"].append(desc)
    index_path.write_text(json.dumps(index))
    return root


def make_archive(layout: Path, dest: Path) -> Path:
    """The layout as an uncompressed tar (``oci-archive:``)."""
    with tarfile.open(dest, "w") as tar:
        for path in sorted(layout.rglob("*")):
            tar.add(path, arcname=str(path.relative_to(layout)), recursive=False)
    return dest


def overlay_reads(layers: tuple[str, ...], expect: dict[str, str | None]) -> None:
    """Mount the layers with overlayfs (in a mount namespace of a child) and read the first
    line of each of ``expect``'s paths: None means absent."""
    checks = " ; ".join(
        f"if [ -e /mnt/{p} ]; then head -n1 /mnt/{p} | tr -d '\\n'; echo; else echo ABSENT; fi"
        for p in expect
    )
    lower = ":".join(reversed(layers))
    script = f"mount -t overlay overlay -o lowerdir={lower} /mnt && {{ {checks} ; }}"
    out = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                         capture_output=True, text=True, timeout=60 * UNIT, check=True)  # fmt: skip
    seen = [line.strip() for line in out.stdout.split("\n")[: len(expect)]]
    assert seen == [v if v is not None else "ABSENT" for v in expect.values()], out.stdout
