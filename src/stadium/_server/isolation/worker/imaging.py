"""The worker's side of task images: which images sessions may run in, and each one's
layers and config (what a ``spawn`` carries to the template, :class:`~.wire.Image`),
from the node's image store (:class:`ImageSet`), and the warm processes per image.

``--image REF`` is every session's image (unless a ``reset`` chooses another);
``--images PATTERN|FILE`` the others a ``reset(options={"image": REF})`` may choose: a file
naming one ``REF`` per line (``#`` comments), or comma-separated ``fnmatch`` patterns
(``localhost/swe-*``). :class:`ImagePolicy` decides; anything else is a
:class:`~stadium.ValidationError` naming what is allowed.

:class:`ImageSet` turns a ``REF`` into its :class:`~.wire.Image` through the node's store
(a Podman image, an OCI layout or archive, a root filesystem directory used in place) and
holds a lease on it while the worker lives.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import fnmatch
import os
from typing import TYPE_CHECKING

from stadium._errors import ConfigError, ValidationError
from stadium._server.images import ImageLease, ImageStore
from stadium._server.isolation import wire
from stadium._server.metrics import IMAGE_SLOTS

if TYPE_CHECKING:
    from stadium._server.isolation.worker.proc import EnvProcess

#: The environment a session's commands get when the image names none.
DEFAULT_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
#: The characters an overlayfs ``lowerdir`` option cannot hold in a layer's path.
_UNSAFE = frozenset(",:\\\n")


class ImageSet:
    """The images a worker's sessions run in: prepared by the node's store
    (:class:`~stadium._server.images.ImageStore`: once per node, layers shared), leased for
    the worker's life (never evicted while it serves them), as a spawn carries them.

    Args:
        budget_mib: ``--image-cache-mib`` (0: no budget).
    """

    def __init__(self, budget_mib: int = 0) -> None:
        self.store = ImageStore(budget_bytes=budget_mib * 2**20 if budget_mib else None)
        self.ready: dict[str, wire.Image] = {}
        self._leases: list[ImageLease] = []

    def prepare(self, ref: str) -> wire.Image:
        """``ref``'s image (prepared and leased the first time: slow then; blocking).

        Raises:
            ConfigError: ``ref`` names no usable image (the message says what to write).
        """
        found = self.ready.get(ref)
        if found is not None:
            return found
        lease = self.store.lease(self.store.prepare(ref))
        self._leases.append(lease)
        image, config = lease.image, lease.image.config
        if any(_UNSAFE & set(layer) for layer in image.layers):
            raise ConfigError(f"image {ref!r}: a layer's path holds , : or \\", image=ref)
        env = dict(config.env) or dict(DEFAULT_ENV)
        found = self.ready[ref] = wire.Image(ref, list(image.layers), env, config.workdir or "/")
        return found

    async def get(self, ref: str | None) -> wire.Image | None:
        """``ref``'s image, prepared off the loop; a ``REF`` that names no usable image is the
        reset's :class:`~stadium.ValidationError`."""
        if ref is None:
            return None
        found = self.ready.get(ref)
        if found is None:
            try:
                found = await asyncio.get_running_loop().run_in_executor(None, self.prepare, ref)
            except ConfigError as exc:
                raise ValidationError(exc.message, image=ref) from None
        return found

    def root(self) -> str:
        """The store's directory (made if missing: the template's bubblewrap binds it)."""
        os.makedirs(self.store.root, mode=0o700, exist_ok=True)
        return self.store.root

    def close(self) -> None:
        """Let the images go (the store may evict them once no other worker holds them)."""
        for lease in self._leases:
            lease.close()
        self._leases.clear()


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

    def slots(self) -> list[str]:
        """The ``image`` labels of ``/metrics``' task image slots: the default image, the
        other named ones (sorted), then ``other`` (every worker agrees: from the config)."""
        if not self.any:
            return []
        named = [self.default] if self.default else []
        named += sorted(self.allowed - {self.default})
        return [*named[: IMAGE_SLOTS - 1], "other"]

    def slot(self, ref: str | None, slots: list[str]) -> int:
        """``ref``'s slot in ``slots`` (the last, ``other``, for an unnamed one)."""
        try:
            return slots.index(ref or "", 0, len(slots) - 1)
        except ValueError:
            return len(slots) - 1

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

    def counts(self, policy: ImagePolicy) -> tuple[list[int], list[int]]:
        """Warm processes and starts per ``/metrics`` image slot (:meth:`ImagePolicy.slots`)."""
        slots = policy.slots()
        if not slots:  # no task images: nothing to count apart
            return [], []
        warm, starts = [0] * len(slots), [0] * len(slots)
        for image, pool in self.pools.items():
            warm[policy.slot(image, slots)] += len(pool)
        for image, count in self.starts.items():
            starts[policy.slot(image, slots)] += count
        return warm, starts

    def all(self) -> list[EnvProcess]:
        """Every warm process, emptying the pools (shutdown)."""
        out = [proc for pool in self.pools.values() for proc in pool]
        for pool in self.pools.values():
            pool.clear()
        return out
