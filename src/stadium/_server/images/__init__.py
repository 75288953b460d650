"""Task images: the node's image store (issue #31; docs/IMAGES.md).

An image named by a REF (:func:`parse_ref`: a Podman image, an OCI layout or archive, a root
filesystem directory) is prepared once per node by :class:`ImageStore` into content-addressed
layers shared between images, ready as overlayfs lowerdirs (:class:`PreparedImage`), leased
while sessions use it (:class:`ImageLease`) and evicted least recently used first under a disk
budget. ``stadium images list|prefetch|prune|inspect`` is its command line
(``stadium._cli.images``); :mod:`.collector` its ``/metrics`` figures.

Modules, top to bottom (the ``images`` import contract): ``collector`` → ``store`` →
``podman`` | ``oci`` → ``extract`` → ``refs``.
"""

from __future__ import annotations

from stadium._server.images.oci import ImageConfig
from stadium._server.images.refs import ImageRef, RefKind, parse_ref
from stadium._server.images.store import (
    CacheStats,
    ImageInfo,
    ImageLease,
    ImageStore,
    LeaseState,
    PreparedImage,
    default_root,
)

__all__ = [
    "CacheStats",
    "ImageConfig",
    "ImageInfo",
    "ImageLease",
    "ImageRef",
    "ImageStore",
    "LeaseState",
    "PreparedImage",
    "RefKind",
    "default_root",
    "parse_ref",
]
