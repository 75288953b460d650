"""The worker's side of task images: which images sessions may run in, and each one's
layers and config (what a ``spawn`` carries to the template, :class:`~.wire.Image`).

``--image REF`` is every session's image (unless a ``reset`` chooses another);
``--images PATTERN|FILE`` the others a ``reset(options={"image": REF})`` may choose: a file
naming one ``REF`` per line (``#`` comments), or comma-separated ``fnmatch`` patterns
(``localhost/swe-*``). :class:`ImagePolicy` decides; anything else is a
:class:`~stadium.ValidationError` naming what is allowed.

:func:`prepare` turns a ``REF`` into its :class:`~.wire.Image`. Until the node's image
store serves every kind of ``REF``, this one reads a root filesystem directory
(``dir:/path``, or an absolute path), used in place, read-only, as the image's one layer.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import fnmatch
import os
from typing import TYPE_CHECKING

from stadium._errors import ConfigError, ValidationError
from stadium._server.isolation import wire

if TYPE_CHECKING:
    from stadium._server.isolation.proc import EnvProcess

#: The environment a session's commands get when the image names none.
DEFAULT_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
#: The characters an overlayfs ``lowerdir`` option cannot hold in a layer's path.
_UNSAFE = frozenset(",:\\\n")


def prepare(ref: str) -> wire.Image:
    """The image ``ref`` names, ready for a spawn (slow for a store's first time).

    Raises:
        ConfigError: ``ref`` names no usable image (the message says what to write).
    """
    path = _rootfs(ref)
    if path is None:
        raise ConfigError(
            f"image {ref!r}: only a root filesystem directory is supported here "
            "(dir:/path/to/rootfs, made with `podman export CID | tar -x -C DIR`)",
            image=ref,
        )
    if not os.path.isdir(path):
        raise ConfigError(f"image {ref!r}: {path} is no directory", image=ref)
    if not os.path.isdir(os.path.join(path, "usr")) and not os.path.exists(
        os.path.join(path, "bin")
    ):
        raise ConfigError(
            f"image {ref!r}: {path} holds no root filesystem (no usr/ nor bin/)", image=ref
        )
    if _UNSAFE & set(path):
        raise ConfigError(f"image {ref!r}: its path may hold none of , : \\", image=ref)
    return wire.Image(ref, [path], dict(DEFAULT_ENV), "/")


async def prepared(cache: dict[str, wire.Image], ref: str | None) -> wire.Image | None:
    """``ref``'s image, prepared once (off the loop) and kept in ``cache``. A ``REF`` that
    names no usable image is the reset's :class:`~stadium.ValidationError`."""
    if ref is None:
        return None
    image = cache.get(ref)
    if image is None:
        try:
            image = await asyncio.get_running_loop().run_in_executor(None, prepare, ref)
        except ConfigError as exc:
            raise ValidationError(exc.message, image=ref) from None
        cache[ref] = image
    return image


def _rootfs(ref: str) -> str | None:
    if ref.startswith("dir:"):
        return os.path.realpath(ref[4:]) if ref[4:].startswith("/") else None
    if ref.startswith("/"):
        return os.path.realpath(ref)
    return None


@dataclasses.dataclass(frozen=True)
class ImagePolicy:
    """The images a server's sessions may run in.

    Attributes:
        default: ``--image`` (every session's unless a reset chooses), or ``None``.
        allowed: exact ``REF``s a reset may choose (``--images FILE``, and ``default``).
        patterns: ``fnmatch`` patterns of ``REF``s a reset may choose (``--images``).
    """

    default: str | None = None
    allowed: frozenset[str] = frozenset()
    patterns: tuple[str, ...] = ()

    @classmethod
    def of(cls, image: str | None, images: str | None) -> ImagePolicy:
        """From ``--image`` and ``--images`` (a file of REFs, or patterns)."""
        allowed: set[str] = {image} if image else set()
        patterns: list[str] = []
        if images:
            if os.path.isfile(images):
                try:
                    with open(images) as f:
                        lines = f.read(1 << 20).splitlines()
                except OSError as exc:
                    raise ConfigError(f"--images {images}: {exc.strerror}") from None
                allowed |= {ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")}
            else:
                for item in (p.strip() for p in images.split(",")):
                    if item and _is_pattern(item):
                        patterns.append(item)
                    elif item:
                        allowed.add(item)
        return cls(image, frozenset(allowed), tuple(patterns))

    @property
    def any(self) -> bool:
        """Whether sessions run in images at all."""
        return bool(self.default or self.allowed or self.patterns)

    def choose(self, ref: object) -> str | None:
        """The image a reset's ``options["image"]`` asks for (``None``: the default).

        Raises:
            ValidationError: not a string, or an image the server does not allow.
        """
        if ref is None:
            return self.default
        if not isinstance(ref, str) or not ref:
            raise ValidationError("options.image must be an image reference (a string)")
        if ref in self.allowed or any(fnmatch.fnmatchcase(ref, p) for p in self.patterns):
            return ref
        named = sorted(self.allowed) + list(self.patterns)
        raise ValidationError(
            f"image {ref!r} is not allowed on this server: choose one of "
            f"{', '.join(named) or '(none: it serves no images)'} (the operator allows more "
            "with --images PATTERN|FILE)",
            image=ref,
        )

    def roots(self) -> list[str]:
        """The host folders the template's bubblewrap must bind read-only so that every
        allowed image's layers are reachable (a pattern's fixed folder)."""
        out: list[str] = []
        for ref in (*self.allowed, *self.patterns):
            if _is_pattern(ref):  # the folder before its first wildcard
                first = min(ref.find(ch) for ch in "*?[" if ch in ref)
                ref = os.path.dirname(ref[:first])
            path = _rootfs(ref)
            if path is not None and os.path.isdir(path):
                out.append(path)
        return out


def _is_pattern(ref: str) -> bool:
    return any(ch in ref for ch in "*?[")


class WarmPools:
    """A worker's warm env processes, per image (``None``: sessions without one).

    The default image's pool (``--image``, or none) is kept at ``size`` from the start;
    another image's pool is made at its first use, then kept at ``size`` too (the first
    session of an image waits for its process; the next ones find theirs forked ahead).
    """

    def __init__(self, size: int, default: str | None) -> None:
        self.size = size
        self.default = default
        self.pools: dict[str | None, collections.deque[EnvProcess]] = {default: collections.deque()}
        self.filling: collections.Counter[str | None] = collections.Counter()
        self.starts: collections.Counter[str | None] = collections.Counter()
        """Processes started per image (``/metrics``)."""

    def pool(self, image: str | None) -> collections.deque[EnvProcess]:
        """The warm processes of ``image`` (its pool is made now at its first use)."""
        found = self.pools.get(image)
        if found is None:
            found = self.pools[image] = collections.deque()
        return found

    def short(self) -> list[str | None]:
        """One image per process missing from its pool (counting those being forked)."""
        return [
            image
            for image, pool in self.pools.items()
            for _ in range(self.size - len(pool) - self.filling[image])
        ]

    def sizes(self) -> dict[str, int]:
        """Warm processes per image's ``REF`` (``""``: no image), for ``/metrics``."""
        return {image or "": len(pool) for image, pool in self.pools.items()}

    def all(self) -> list[EnvProcess]:
        """Every warm process, emptying the pools (shutdown)."""
        out = [proc for pool in self.pools.values() for proc in pool]
        for pool in self.pools.values():
            pool.clear()
        return out
