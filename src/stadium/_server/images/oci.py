"""OCI image layouts read: ``index.json`` → manifest → config and layer blobs.

A layout is a directory (``oci:DIR``) or a tar of one (``oci-archive:FILE``, read in place
with random access, nothing unpacked). Every JSON document is decoded into its expected
shape with a size limit and its ``sha256`` checked against the digest that named it; blob
paths are built only from checked digests (``sha256:`` + 64 hex digits), and what they name
must be a regular file (a FIFO would block the store, a device give bytes without end).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
import stat
import tarfile
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import IO, Protocol, TypeVar

import msgspec

from stadium._env.codecs import UNREADABLE, unreadable_detail
from stadium._errors import ConfigError
from stadium._server.images.refs import check_digest

__all__ = [
    "DEFAULT_PATH",
    "ArchiveLayout",
    "ConfigSection",
    "DirLayout",
    "ImageConfig",
    "Layer",
    "Layout",
    "Manifested",
    "image_config",
    "read_image",
]

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
MAX_DOC_BYTES = 4 << 20
"""The most an index, manifest or config may take."""
MAX_LAYERS = 127
_INDEX_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)
_REF_NAME = "org.opencontainers.image.ref.name"
T = TypeVar("T")
_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm"}


@dataclasses.dataclass(frozen=True, slots=True)
class ImageConfig:
    """What of the OCI image config a session honours (defaults for a root filesystem).

    Attributes:
        env: ``Env`` as a dict (``PATH`` always set).
        workdir: ``WorkingDir``, else ``/``.
        user: ``User`` (informational: sessions keep their own uid).
        cmd, entrypoint: ``Cmd``, ``Entrypoint``.
    """

    env: dict[str, str] = dataclasses.field(default_factory=lambda: {"PATH": DEFAULT_PATH})
    workdir: str = "/"
    user: str | None = None
    cmd: tuple[str, ...] = ()
    entrypoint: tuple[str, ...] = ()

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, object]) -> ImageConfig:
        return msgspec.convert(data, _ConfigRecord).to_config()


class _ConfigRecord(msgspec.Struct):
    env: dict[str, str]
    workdir: str
    user: str | None
    cmd: tuple[str, ...]
    entrypoint: tuple[str, ...]

    def to_config(self) -> ImageConfig:
        return ImageConfig(self.env, self.workdir, self.user, self.cmd, self.entrypoint)


@dataclasses.dataclass(frozen=True, slots=True)
class Layer:
    """A layer of a manifest: its blob (digest, size) and its uncompressed tar's digest."""

    digest: str
    diff_id: str
    size: int


@dataclasses.dataclass(frozen=True, slots=True)
class Manifested:
    """An image read from a layout: its config's digest (the image's digest), config, layers."""

    digest: str
    config: ImageConfig
    layers: tuple[Layer, ...]


class _Platform(msgspec.Struct, rename="camel"):
    architecture: str = ""
    os: str = ""


class _Descriptor(msgspec.Struct, rename="camel"):
    digest: str
    size: int = 0
    media_type: str = ""
    annotations: dict[str, str] = {}
    platform: _Platform | None = None


class _Index(msgspec.Struct, rename="camel"):
    manifests: list[_Descriptor] = []
    media_type: str = ""


class _Manifest(msgspec.Struct, rename="camel"):
    config: _Descriptor
    layers: list[_Descriptor]
    media_type: str = ""


class ConfigSection(msgspec.Struct, rename={"env": "Env", "workdir": "WorkingDir",
                                            "user": "User", "cmd": "Cmd",
                                            "entrypoint": "Entrypoint"}):  # fmt: skip
    """The ``config`` section of an image config (``podman image inspect``'s ``Config``)."""

    env: list[str] | None = None
    workdir: str | None = None
    user: str | None = None
    cmd: list[str] | None = None
    entrypoint: list[str] | None = None


class _RootFS(msgspec.Struct):
    diff_ids: list[str]
    type: str = "layers"


class _Config(msgspec.Struct):
    rootfs: _RootFS
    config: ConfigSection | None = None


class Layout(Protocol):
    """Where a layout's documents and blobs are read from."""

    what: str

    def read_index(self) -> bytes: ...

    def blob(self, digest: str) -> AbstractContextManager[IO[bytes]]: ...


class DirLayout:
    """An OCI layout directory."""

    def __init__(self, path: str, what: str) -> None:
        self.path = path
        self.what = what

    def read_index(self) -> bytes:
        try:
            with _open_file(os.path.join(self.path, "index.json"), self.what) as f:
                return f.read(MAX_DOC_BYTES + 1)
        except FileNotFoundError:
            raise ConfigError(
                f"{self.what}: {self.path} has no index.json, so it is not an OCI image layout "
                f"(make one with: podman save --format oci-dir -o DIR IMAGE; a root "
                f"filesystem directory is written dir:{self.path})"
            ) from None
        except OSError as exc:
            raise ConfigError(f"{self.what}: cannot read {self.path}/index.json: {exc}") from None

    @contextmanager
    def blob(self, digest: str) -> Iterator[IO[bytes]]:
        path = os.path.join(self.path, "blobs", "sha256", digest.removeprefix("sha256:"))
        try:
            f = _open_file(path, self.what)
        except OSError as exc:
            raise ConfigError(f"{self.what}: the blob {digest} is missing: {exc}") from None
        with f:
            yield f


def _open_file(path: str, what: str) -> IO[bytes]:
    """``path`` opened for reading if it is a regular file (a layout is a stranger's: a
    FIFO would block the store for ever, a device give bytes without end)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO opens at once
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError(f"{what}: {path} is not a regular file: the layout is malformed")
    return os.fdopen(fd, "rb")


class ArchiveLayout:
    """An OCI layout in a tar file, read in place (members located once, then seeked to)."""

    def __init__(self, path: str, what: str) -> None:
        self.what = what
        try:
            self._tar = tarfile.open(path, "r:")  # noqa: SIM115
        except (OSError, tarfile.TarError) as exc:
            raise ConfigError(
                f"{what}: {path} is not a readable (uncompressed) tar of an OCI layout: {exc} "
                f"(make one with: podman save --format oci-archive -o FILE IMAGE)"
            ) from None
        self._members = {m.name.removeprefix("./"): m for m in self._tar if m.isreg()}

    def close(self) -> None:
        self._tar.close()

    def _open(self, name: str) -> IO[bytes]:
        member = self._members.get(name)
        f = self._tar.extractfile(member) if member is not None else None
        if f is None:
            raise ConfigError(f"{self.what}: the archive has no {name}")
        return f

    def read_index(self) -> bytes:
        return self._open("index.json").read(MAX_DOC_BYTES + 1)

    @contextmanager
    def blob(self, digest: str) -> Iterator[IO[bytes]]:
        yield self._open(f"blobs/sha256/{digest.removeprefix('sha256:')}")


def _doc(layout: Layout, digest: str, kind: type[T], what: str) -> T:
    with layout.blob(digest) as f:
        data = f.read(MAX_DOC_BYTES + 1)
    if len(data) > MAX_DOC_BYTES:
        raise ConfigError(f"{layout.what}: the {what} {digest} is over {MAX_DOC_BYTES} bytes")
    if f"sha256:{hashlib.sha256(data).hexdigest()}" != digest:
        raise ConfigError(f"{layout.what}: the {what} {digest} does not match its digest")
    return _decode(data, kind, f"the {what} {digest}", layout.what)


def _decode(data: bytes, kind: type[T], what: str, where: str) -> T:
    if len(data) > MAX_DOC_BYTES:
        raise ConfigError(f"{where}: {what} is over {MAX_DOC_BYTES} bytes")
    try:
        return msgspec.json.decode(data, type=kind)
    except UNREADABLE as exc:
        raise ConfigError(
            f"{where}: {what} is not what an OCI layout holds: {unreadable_detail(exc)}"
        ) from None


def read_image(layout: Layout, tag: str | None) -> Manifested:
    """The image ``tag`` names in ``layout`` (its only one when ``tag`` is None)."""
    index = _decode(layout.read_index(), _Index, "index.json", layout.what)
    desc = _choose(index.manifests, tag, layout.what)
    for _ in range(3):  # an index may point at a per-platform index
        check_digest(desc.digest, f"{layout.what}: a manifest")
        if desc.media_type not in _INDEX_TYPES:
            break
        nested = _doc(layout, desc.digest, _Index, "image index")
        desc = _platform(nested.manifests, layout.what)
    manifest = _doc(layout, desc.digest, _Manifest, "manifest")
    config_digest = check_digest(manifest.config.digest, f"{layout.what}: the config")
    config = _doc(layout, config_digest, _Config, "config")
    if len(manifest.layers) != len(config.rootfs.diff_ids):
        raise ConfigError(
            f"{layout.what}: the manifest has {len(manifest.layers)} layers and the config "
            f"{len(config.rootfs.diff_ids)} diff_ids: the image is malformed"
        )
    if len(manifest.layers) > MAX_LAYERS:
        raise ConfigError(f"{layout.what}: more than {MAX_LAYERS} layers: squash the image")
    layers = tuple(
        Layer(
            check_digest(d.digest, f"{layout.what}: a layer"),
            check_digest(diff_id, f"{layout.what}: a diff_id"),
            d.size,
        )
        for d, diff_id in zip(manifest.layers, config.rootfs.diff_ids, strict=True)
    )
    return Manifested(config_digest, image_config(config.config, layout.what), layers)


def _choose(manifests: list[_Descriptor], tag: str | None, what: str) -> _Descriptor:
    names = [m.annotations.get(_REF_NAME, "") for m in manifests]
    if tag is None:
        if len(manifests) == 1:
            return manifests[0]
        raise ConfigError(
            f"{what}: the layout holds {len(manifests)} images; name one with :TAG "
            f"(tags: {', '.join(n for n in names if n) or 'none'})"
        )
    for m, name in zip(manifests, names, strict=True):
        if name == tag or name.endswith(f":{tag}"):
            return m
    raise ConfigError(
        f"{what}: no image tagged {tag!r} in the layout (tags: "
        f"{', '.join(n for n in names if n) or 'none'})"
    )


def _platform(manifests: list[_Descriptor], what: str) -> _Descriptor:
    arch = _ARCH.get(platform.machine(), platform.machine())
    for m in manifests:
        if m.platform is not None and m.platform.os == "linux" and m.platform.architecture == arch:
            return m
    raise ConfigError(f"{what}: the image index has no linux/{arch} image")


def image_config(section: ConfigSection | None, what: str = "the image") -> ImageConfig:
    """What a session honours of ``section``; a NUL byte in ``Env`` or ``WorkingDir`` (which
    no process environment or path can hold) refuses the image."""
    if section is None:
        return ImageConfig()
    for item in (*(section.env or ()), section.workdir or ""):
        if "\0" in item:
            raise ConfigError(
                f"{what}: its config's Env or WorkingDir {item[:100]!r} holds a NUL byte, "
                f"which no environment or path can: fix the image's ENV/WORKDIR and rebuild"
            )
    env: dict[str, str] = {}
    for item in section.env or ():
        key, sep, value = item.partition("=")
        if sep and key:
            env[key] = value
    env.setdefault("PATH", DEFAULT_PATH)
    return ImageConfig(
        env=env,
        workdir=section.workdir or "/",
        user=section.user or None,
        cmd=tuple(section.cmd or ()),
        entrypoint=tuple(section.entrypoint or ()),
    )
