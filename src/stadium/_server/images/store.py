"""The node's image cache: images prepared once into content-addressed layers, shared, leased,
evicted least recently used first under a disk budget.

The layout below the root (docs/IMAGES.md; default ``/var/lib/stadium/images``, or
``STADIUM_IMAGE_CACHE_DIR``; root-owned 0700, refused when others can write it or, without the
sticky bit, a folder above it, or when another user owns one of those)::

    .lock                   flock: shared while an image is prepared, exclusive while pruning
    layers/HEX/             a layer extracted (HEX: the sha256 of its uncompressed tar, the
                            config's diff_id): an overlayfs lowerdir, shared by every image
    layers/HEX.json         its size (written before the directory appears)
    images/HEX.json         an image (HEX: its config's sha256): its layers, config, REFs
    images/HEX.lease        leases: a shared flock per user; its mtime is the last use (LRU)
    refs/KEY.json           a REF (KEY: sha256 of its canonical form) → the prepared image, and
                            the stamp of its source (what to stat to know it is unchanged)
    locks/                  flocks: one preparation per REF, one extraction per layer
    tmp/                    extractions and exports under way (a rename publishes them)

:meth:`ImageStore.prepare` is O(1) once an image is prepared (read its REF's record, stat its
source and the image's record); the first time it is O(layers): each missing layer is
extracted once, into ``tmp/`` and renamed into place, under that layer's lock, so two
processes preparing one image extract each layer once and a crash leaves no half layer
(``tmp/`` is emptied by the next prune). A layer may take at most the budget (without one:
the disk's free space but a twentieth of the disk) and the disk's free inodes but a
twentieth. A layer an image has twice is stacked once, where it is topmost. Invariant:
every image record's layers exist (layers are removed only under the exclusive lock, when no
record names them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import stat
from collections.abc import Iterable, Iterator
from typing import Any

from stadium._errors import ConfigError
from stadium._server.images import podman_storage as podman
from stadium._server.images.extract import extract_layer
from stadium._server.images.oci import ArchiveLayout, DirLayout, ImageConfig, Layout, read_image
from stadium._server.images.refs import ImageRef, RefKind, parse_ref

__all__ = [
    "DEFAULT_ROOT",
    "CacheStats",
    "ImageInfo",
    "ImageLease",
    "ImageStore",
    "LeaseState",
    "PreparedImage",
    "default_root",
]

DEFAULT_ROOT = "/var/lib/stadium/images"
ROOT_ENV = "STADIUM_IMAGE_CACHE_DIR"
_SUBDIRS = ("layers", "images", "refs", "locks", "tmp")
_MAX_REFS = 16
"""REFs an image's record remembers (for ``stadium images list``)."""


def default_root() -> str:
    """``STADIUM_IMAGE_CACHE_DIR``, else ``/var/lib/stadium/images``."""
    return os.environ.get(ROOT_ENV) or DEFAULT_ROOT


@dataclasses.dataclass(frozen=True, slots=True)
class PreparedImage:
    """An image ready for overlayfs.

    Attributes:
        ref: the REF as the operator wrote it.
        digest: ``sha256:`` of the image's config (a root filesystem: of its path and identity).
        layers: absolute directories, bottom first (overlayfs lowerdirs, whiteouts converted);
            a root filesystem: ``(that directory,)``.
        config: the image's config.
        size_bytes: its layers' size in the cache (0 for a root filesystem: not in the cache).
    """

    ref: str
    digest: str
    layers: tuple[str, ...]
    config: ImageConfig
    size_bytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class ImageInfo:
    """An image in the cache, as ``stadium images list`` shows it."""

    digest: str
    kind: str
    refs: tuple[str, ...]
    layers: int
    size_bytes: int
    last_used: float
    leased: bool


@dataclasses.dataclass(frozen=True, slots=True)
class CacheStats:
    """The figures ``/metrics`` shows: images prepared, layers and their bytes, leases."""

    images: int
    layers: int
    bytes: int
    leased: int
    budget_bytes: int | None


class LeaseState(enum.Enum):
    HELD = "held"
    RELEASED = "released"


class ImageLease:
    """A hold on a prepared image: while any process holds one, prune never evicts it.

    A shared ``flock`` on the image's lease file: released by :meth:`close`, or by the kernel
    when every process holding the descriptor (a fork inherits it) has exited.
    ``image`` is the image held (prepared again if it was evicted before the lease was taken).
    """

    def __init__(self, image: PreparedImage, fd: int, path: str) -> None:
        self.image = image
        self.state = LeaseState.HELD
        self._fd = fd
        self._path = path

    def close(self) -> None:
        if self.state is LeaseState.HELD:
            self.state = LeaseState.RELEASED
            with contextlib.suppress(OSError):
                os.utime(self._path)
            os.close(self._fd)

    def __enter__(self) -> ImageLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ImageStore:
    """The image cache of one node (see the module's docstring).

    Args:
        root: the cache's directory (made 0700 on first use); default :func:`default_root`.
        budget_bytes: the most its layers may take; past it, after each preparation, the least
            recently used images no lease holds are evicted (``None``: no budget).
    """

    def __init__(self, root: str | None = None, budget_bytes: int | None = None) -> None:
        self.root = os.path.abspath(root or default_root())
        if budget_bytes is not None and budget_bytes <= 0:
            raise ConfigError("the image cache's budget must be positive (MiB)", value=budget_bytes)
        self.budget_bytes = budget_bytes
        self._ready = False

    # ------------------------------------------------------------------ paths and files

    def _path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def _ensure(self) -> None:
        """Make the layout (root 0700), refusing a root that others may write."""
        if self._ready:
            return
        root = self.root
        try:
            os.makedirs(os.path.dirname(root), mode=0o755, exist_ok=True)
            with contextlib.suppress(FileExistsError):
                os.mkdir(root, 0o700)
            st = os.lstat(root)
        except OSError as exc:
            raise ConfigError(
                f"cannot make the image cache {root}: {exc.strerror}; run as root, or set "
                f"{ROOT_ENV} to a directory of yours"
            ) from None
        if not stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"the image cache {root} is not a directory (a symlink?)")
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise ConfigError(
                f"the image cache {root} is writable by others or owned by uid {st.st_uid}: "
                f"`chown {os.geteuid()} {root} && chmod 700 {root}`, or set {ROOT_ENV}"
            )
        _check_ancestors(root)
        for sub in _SUBDIRS:
            with contextlib.suppress(FileExistsError):
                os.mkdir(self._path(sub), 0o700)
        self._ready = True

    @contextlib.contextmanager
    def _flock(self, path: str, op: int) -> Iterator[None]:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, op)
            yield
        finally:
            os.close(fd)

    def _write_json(self, path: str, data: object) -> None:
        tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, separators=(",", ":"))
        os.replace(tmp, path)

    @staticmethod
    def _read_json(path: str) -> Any:
        with open(path, "rb") as f:
            return json.loads(f.read())

    def _image_paths(self, digest: str) -> tuple[str, str]:
        hexd = digest.removeprefix("sha256:")
        return self._path("images", f"{hexd}.json"), self._path("images", f"{hexd}.lease")

    # ------------------------------------------------------------------ prepare

    def prepare(self, ref: str) -> PreparedImage:
        """The image ``ref`` names, ready: O(1) when prepared before and its source unchanged,
        else its missing layers extracted (once, whichever processes ask at the same time).

        Raises:
            ConfigError: a bad REF, a missing or malformed image, a hostile layer, the budget.
        """
        parsed = parse_ref(ref)
        self._ensure()
        key = hashlib.sha256(parsed.key.encode()).hexdigest()
        found = self._fast(ref, key)
        if found is not None:
            return found
        with self._flock(self._path("locks", f"ref-{key}"), fcntl.LOCK_EX):
            found = self._fast(ref, key)
            if found is not None:
                return found
            with self._flock(self._path(".lock"), fcntl.LOCK_SH):
                image = self._prepare_slow(parsed, key)
        if self.budget_bytes is not None:  # unless another process prepares or prunes now
            self._prune(self.budget_bytes, (image.digest,), fcntl.LOCK_EX | fcntl.LOCK_NB)
        return image

    def _fast(self, ref: str, key: str) -> PreparedImage | None:
        try:
            rec = self._read_json(self._path("refs", f"{key}.json"))
            stamp = rec["stamp"]
            if stamp is None or _stamp(stamp[0], dir_only=stamp[5]) != stamp:
                return None
            record, lease = self._image_paths(rec["digest"])
            os.stat(record)
        except (OSError, ValueError, LookupError, TypeError):
            return None
        with contextlib.suppress(OSError):
            os.utime(lease)
        return _prepared(ref, rec["image"])

    def _prepare_slow(self, r: ImageRef, key: str) -> PreparedImage:
        what = f"image {r.text!r}"
        stamp: list[Any] | None
        expected: str | None = None  # the digest Podman named, which its export must have
        if r.kind is RefKind.DIR:
            image, stamp = self._rootfs(r, what)
        elif r.kind is RefKind.PODMAN:
            found = podman.inspect(r.location, what)
            expected = found.digest
            stamp = _stamp(found.stamp_path) if found.stamp_path else None
            image = (
                self._existing(r.text, found.digest)
                or self._from_cached_layers(r, found)
                or self._from_podman(r, what)
            )
        elif r.kind is RefKind.OCI:
            stamp = _stamp(os.path.join(r.location, "index.json"), missing_ok=True)
            image = self._ingest(r, DirLayout(r.location, what), r.tag, what)
        else:
            stamp = _stamp(r.location, missing_ok=True)
            if not os.path.isfile(r.location):
                raise ConfigError(
                    f"{what}: {r.location} is not a file (make one with: podman save "
                    f"--format oci-archive -o FILE IMAGE)"
                )
            archive = ArchiveLayout(r.location, what)
            try:
                image = self._ingest(r, archive, r.tag, what)
            finally:
                archive.close()
        if stamp is not None and (
            _stamp(stamp[0], dir_only=stamp[5], missing_ok=True) != stamp
            or (expected is not None and image.digest != expected)
        ):
            stamp = None  # the source changed while it was read: look again next time
        body = _image_json(image)
        self._write_json(
            self._path("refs", f"{key}.json"),
            {
                "ref_key": r.key,
                "digest": image.digest,
                "stamp": stamp,
                "image": body,
            },
        )
        return image

    def _from_cached_layers(self, r: ImageRef, found: podman.PodmanImage) -> PreparedImage | None:
        """The image from layers other images brought, when all of its are here (its config
        from ``podman image inspect``): no export."""
        dirs, sizes = [], []
        for diff_id in found.diff_ids:
            hexd = diff_id.removeprefix("sha256:")
            dest = self._path("layers", hexd)
            if not os.path.isdir(dest):
                return None
            dirs.append(dest)
            sizes.append(int(self._read_json(f"{dest}.json")["size_bytes"]))
        return self._record(r, found.digest, dirs, sizes, found.config, f"image {r.text!r}")

    def _from_podman(self, r: ImageRef, what: str) -> PreparedImage:
        tmp = self._path("tmp", f"export-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            podman.save(r.location, tmp, what)
            return self._ingest(r, DirLayout(tmp, what), None, what)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _existing(self, ref: str, digest: str) -> PreparedImage | None:
        """The image ``digest`` if another REF prepared it (its record gains ``ref``)."""
        record, lease = self._image_paths(digest)
        try:
            rec = self._read_json(record)
        except (OSError, ValueError):
            return None
        self._remember(rec, ref, record, lease)
        return _prepared(ref, rec["image"])

    def _remember(self, rec: dict[str, Any], ref: str, record: str, lease: str) -> None:
        refs = [r for r in rec.get("refs", []) if r != ref][-(_MAX_REFS - 1) :]
        rec["refs"] = [*refs, ref]
        self._write_json(record, rec)
        with open(lease, "a"):
            os.utime(lease)

    def _rootfs(self, r: ImageRef, what: str) -> tuple[PreparedImage, list[Any] | None]:
        real = os.path.realpath(r.location)
        try:
            st = os.stat(real)
        except OSError as exc:
            raise ConfigError(
                f"{what}: {r.location} cannot be used as a root filesystem: {exc.strerror} "
                f"(write dir:/ABSOLUTE/PATH of a directory, e.g. from `podman export C | tar x`)"
            ) from None
        if not stat.S_ISDIR(st.st_mode):
            raise ConfigError(
                f"{what}: {r.location} is not a directory (write oci-archive:FILE "
                f"for an image archive)"
            )
        if os.path.isfile(os.path.join(real, "oci-layout")):
            raise ConfigError(f"{what}: {r.location} is an OCI image layout: write oci:{real}")
        identity = f"dir\0{real}\0{st.st_dev}\0{st.st_ino}".encode()
        digest = f"sha256:{hashlib.sha256(identity).hexdigest()}"
        image = PreparedImage(r.text, digest, (real,), ImageConfig(), 0)
        self._publish(image, "dir", [])
        return image, _stamp(r.location, dir_only=True)

    def _ingest(self, r: ImageRef, layout: Layout, tag: str | None, what: str) -> PreparedImage:
        manifested = read_image(layout, tag)
        found = self._existing(r.text, manifested.digest)
        if found is not None:
            return found
        dirs, sizes = [], []
        for layer in manifested.layers:
            path, size = self._layer(layer.digest, layer.diff_id, layout, what)
            dirs.append(path)
            sizes.append(size)
        return self._record(r, manifested.digest, dirs, sizes, manifested.config, what)

    def _record(
        self,
        r: ImageRef,
        digest: str,
        dirs: list[str],
        sizes: list[int],
        config: ImageConfig,
        what: str,
    ) -> PreparedImage:
        unique = dict(zip(dirs, sizes, strict=True))
        image = PreparedImage(r.text, digest, _stack(dirs), config, sum(unique.values()))
        if self.budget_bytes is not None and image.size_bytes > self.budget_bytes:
            raise ConfigError(
                f"{what} takes {image.size_bytes >> 20} MiB, over the image cache's budget "
                f"({self.budget_bytes >> 20} MiB): raise --image-cache-mib"
            )
        layers = [
            {"diff_id": f"sha256:{os.path.basename(d)}", "size_bytes": s}
            for d, s in zip(dirs, sizes, strict=True)
        ]
        self._publish(image, str(r.kind), layers)
        return image

    def _publish(self, image: PreparedImage, kind: str, layers: list[dict[str, Any]]) -> None:
        record, lease = self._image_paths(image.digest)
        rec = {
            "digest": image.digest,
            "kind": kind,
            "layers": layers,
            "refs": [],
            "image": _image_json(image),
        }
        self._remember(rec, image.ref, record, lease)

    def _layer(self, digest: str, diff_id: str, layout: Layout, what: str) -> tuple[str, int]:
        """The layer's directory (extracted now if missing) and its size."""
        hexd = diff_id.removeprefix("sha256:")
        dest, meta = self._path("layers", hexd), self._path("layers", f"{hexd}.json")
        if os.path.isdir(dest):
            return dest, int(self._read_json(meta)["size_bytes"])
        with self._flock(self._path("locks", f"layer-{hexd}"), fcntl.LOCK_EX):
            if os.path.isdir(dest):
                return dest, int(self._read_json(meta)["size_bytes"])
            tmp = self._path("tmp", f"layer-{hexd}")
            shutil.rmtree(tmp, ignore_errors=True)  # a crashed extraction's (we hold its lock)
            os.mkdir(tmp, 0o700)
            try:
                with layout.blob(digest) as blob:
                    facts = extract_layer(
                        blob,
                        tmp,
                        blob_digest=digest,
                        diff_id=diff_id,
                        what=f"layer {digest} of {what}",
                        **self._layer_limit(),
                    )
                self._write_json(meta, {"size_bytes": facts.size_bytes, "blob": digest})
                os.rename(tmp, dest)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        return dest, facts.size_bytes

    def _layer_limit(self) -> dict[str, Any]:
        """What a layer may take: the budget, else the cache's disk's free space but a
        twentieth of the disk; at most its free inodes but a twentieth (a layer that
        decompresses without end, or into millions of empty files, fills no disk)."""
        vfs = os.statvfs(self._path("tmp"))
        limits: dict[str, Any] = {}
        if vfs.f_files:  # 0: the file system has no inode count (btrfs)
            limits["limit_entries"] = max(0, vfs.f_favail - vfs.f_files // 20)
        if self.budget_bytes is not None:
            return {**limits, "limit_bytes": self.budget_bytes}
        free = (vfs.f_bavail - vfs.f_blocks // 20) * vfs.f_frsize
        return {
            **limits,
            "limit_bytes": max(0, free),
            "over_limit": "the free space of the image cache's disk (keeping 5% of it "
            "free): free some, or prune the cache (stadium images prune)",
        }

    # ------------------------------------------------------------------ leases

    def lease(self, image: PreparedImage) -> ImageLease:
        """Hold ``image`` against eviction until the lease is closed or this process (and
        its children) exit. If it was evicted since it was prepared, it is prepared again."""
        self._ensure()
        for _ in range(4):
            record, path = self._image_paths(image.digest)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
                if same and os.path.exists(record):
                    os.utime(fd)
                    return ImageLease(image, fd, path)
            except FileNotFoundError:
                pass
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # pruned meanwhile: prepare it again, then lease that
            image = self.prepare(image.ref)
        raise ConfigError(
            f"image {image.ref!r} kept being evicted while being leased: raise --image-cache-mib"
        )

    def _leased(self, lease_path: str) -> bool:
        try:
            fd = os.open(lease_path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    # ------------------------------------------------------------------ listing and pruning

    def _records(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        images = self._path("images")
        for name in os.listdir(images):
            if name.endswith(".json"):
                with contextlib.suppress(OSError, ValueError):
                    rec = self._read_json(os.path.join(images, name))
                    out[rec["digest"]] = rec
        return out

    def images(self) -> list[ImageInfo]:
        """The images in the cache, most recently used first."""
        self._ensure()
        infos = []
        for digest, rec in self._records().items():
            _, lease = self._image_paths(digest)
            try:
                used = os.stat(lease).st_mtime
            except OSError:
                used = 0.0
            infos.append(
                ImageInfo(
                    digest,
                    rec.get("kind", "?"),
                    tuple(rec.get("refs", ())),
                    len(rec["image"]["layers"]),
                    int(rec["image"]["size_bytes"]),
                    used,
                    self._leased(lease),
                )
            )
        return sorted(infos, key=lambda i: -i.last_used)

    def stats(self) -> CacheStats:
        """Images prepared, layers, bytes, images leased now (for ``/metrics``)."""
        self._ensure()
        records = self._records()
        layers = _layer_sizes(records.values())
        leased = sum(self._leased(self._image_paths(d)[1]) for d in records)
        return CacheStats(
            len(records), len(layers), sum(layers.values()), leased, self.budget_bytes
        )

    def prune(self, keep_bytes: int | None = None, protect: Iterable[str] = ()) -> list[str]:
        """Evict the least recently used images no lease holds until the layers take at most
        ``keep_bytes`` (default: the budget, else 0: every unleased image), then remove the
        layers no image names and what crashed preparations left. Returns the digests evicted.
        """
        self._ensure()
        target = keep_bytes if keep_bytes is not None else (self.budget_bytes or 0)
        return self._prune(target, tuple(protect), fcntl.LOCK_EX)

    def _prune(self, target: int, keep: tuple[str, ...], op: int) -> list[str]:
        try:
            with self._flock(self._path(".lock"), op):
                return self._prune_locked(target, keep)
        except BlockingIOError:  # LOCK_NB: someone prepares or prunes; the next one will see
            return []

    def _prune_locked(self, target: int, keep: tuple[str, ...]) -> list[str]:
        removed: list[str] = []
        tmp = self._path("tmp")
        for name in os.listdir(tmp):  # nothing is prepared now: all of it is left over
            _remove(os.path.join(tmp, name))
        records = self._records()
        order = sorted(records, key=lambda d: _mtime(self._image_paths(d)[1]))
        for digest in order:
            if sum(_layer_sizes(records.values()).values()) <= target:
                break
            if digest not in keep and self._evict(digest):
                del records[digest]
                removed.append(digest)
        self._sweep(records)
        return removed

    def _evict(self, digest: str) -> bool:
        """Remove the image's record, REFs and lease file, unless a lease holds it."""
        record, lease = self._image_paths(digest)
        fd = os.open(lease, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            os.unlink(record)
            refs = self._path("refs")
            for name in os.listdir(refs):
                path = os.path.join(refs, name)
                with contextlib.suppress(OSError, ValueError, LookupError, TypeError):
                    if self._read_json(path)["digest"] == digest:
                        os.unlink(path)
            os.unlink(lease)  # a waiting lease finds its file gone and prepares again
            return True
        finally:
            os.close(fd)

    def _sweep(self, records: dict[str, dict[str, Any]]) -> None:
        """Layers no record names; lease files of no record (none held)."""
        named = set(_layer_sizes(records.values()))
        layers = self._path("layers")
        for name in os.listdir(layers):
            hexd = name.removesuffix(".json")
            if f"sha256:{hexd}" in named:
                continue
            path = os.path.join(layers, name)
            if name.endswith(".json"):
                if not os.path.isdir(os.path.join(layers, hexd)):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                continue
            doomed = self._path("tmp", f"del-{hexd}")
            os.rename(path, doomed)
            _remove(doomed)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"{path}.json")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path("locks", f"layer-{hexd}"))
        images = self._path("images")
        for name in os.listdir(images):
            digest = f"sha256:{name.removesuffix('.lease')}"
            if (
                name.endswith(".lease")
                and digest not in records
                and not self._leased(os.path.join(images, name))
            ):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(images, name))


def _check_ancestors(root: str) -> None:
    """Refuse a cache whose folders above could be renamed away and replaced by another
    user (one writable by others without the sticky bit, or owned by another user): who
    swaps the cache swaps its records, and so the layers (any host folder) sessions mount."""
    me = os.geteuid()
    path = os.path.dirname(root)
    for _ in range(root.count("/") + 1):
        st = os.stat(path)
        loose = st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX
        if st.st_uid not in (0, me) or loose:
            raise ConfigError(
                f"the image cache {root} is below {path}, which uid {st.st_uid} owns or others "
                f"may write (mode {stat.S_IMODE(st.st_mode):o}): another user could replace the "
                f"cache; set {ROOT_ENV} to a directory under folders only root (or you) can write"
            )
        if path == "/":
            return
        path = os.path.dirname(path)


def _layer_sizes(records: Iterable[dict[str, Any]]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for rec in records:
        for layer in rec["layers"]:
            sizes[layer["diff_id"]] = int(layer["size_bytes"])
    return sizes


def _stamp(path: str, *, dir_only: bool = False, missing_ok: bool = False) -> list[Any] | None:
    """What must stay equal for a source to be unchanged: its identity (and for files, size
    and mtime; a root filesystem is used in place, so only its identity counts)."""
    try:
        st = os.stat(path)
    except OSError:
        if missing_ok:
            return None
        raise
    if dir_only:
        return [path, st.st_dev, st.st_ino, 0, 0, True]
    return [path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, False]


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _image_json(image: PreparedImage) -> dict[str, Any]:
    return {
        "digest": image.digest,
        "layers": list(image.layers),
        "config": image.config.to_json(),
        "size_bytes": image.size_bytes,
    }


def _stack(dirs: Iterable[str]) -> tuple[str, ...]:
    """Layers bottom first, a layer given twice (the same diff_id) once, where it is topmost:
    the same overlay, and overlayfs refuses a lowerdir given twice ("conflicting lowerdir
    path"). Records written before this was done are read through it too."""
    return tuple(reversed(dict.fromkeys(reversed(list(dirs)))))


def _prepared(ref: str, body: dict[str, Any]) -> PreparedImage:
    return PreparedImage(
        ref,
        body["digest"],
        _stack(body["layers"]),
        ImageConfig.from_json(body["config"]),
        int(body["size_bytes"]),
    )
