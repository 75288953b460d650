"""What an operator writes to name an image (a REF), parsed without touching the disk.

Four kinds (docs/IMAGES.md):

* ``localhost/name:tag`` (or any image name, or ``containers-storage:NAME``): an image in the
  node's Podman storage;
* ``oci:DIR[:tag]``: an OCI image layout directory (``index.json``, ``blobs/sha256/...``);
* ``oci-archive:FILE[:tag]``: the same layout in a tar file;
* ``dir:/path``, or an absolute directory path: a root filesystem used in place, read-only.

:func:`parse_ref` checks only the text; whether the image exists is for
:meth:`~stadium._server.images.store.ImageStore.prepare` to find out. Every error is a
:class:`~stadium._errors.ConfigError` naming the REF and what to write instead.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re

from stadium._errors import ConfigError

__all__ = ["DIGEST_RE", "ImageRef", "RefKind", "check_digest", "parse_ref"]

MAX_REF_CHARS = 4096

DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
"""The only digests the store accepts (a blob's file name is built from one: no other text)."""

_TAG_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
# The reference grammar of distribution/reference: [domain/]path[:tag][@digest].
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN = r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9-]+)*(?::[0-9]+)?/)"
_NAME_RE = re.compile(
    rf"{_DOMAIN}?{_COMPONENT}(?:/{_COMPONENT})*(?::[A-Za-z0-9_][A-Za-z0-9._-]{{0,127}})?"
    r"(?:@sha256:[0-9a-f]{64})?"
)
_KINDS_HELP = (
    "write localhost/NAME:TAG (an image in Podman's storage), oci:DIR[:TAG] (an OCI layout), "
    "oci-archive:FILE[:TAG] or dir:/ROOTFS (a root filesystem directory)"
)


class RefKind(enum.StrEnum):
    """Where an image comes from."""

    PODMAN = "podman"
    OCI = "oci"
    OCI_ARCHIVE = "oci-archive"
    DIR = "dir"


@dataclasses.dataclass(frozen=True, slots=True)
class ImageRef:
    """A parsed REF.

    Attributes:
        text: the REF as written.
        kind: its kind.
        location: the Podman image name, or the absolute path of the layout, archive or
            root filesystem.
        tag: ``oci:``/``oci-archive:`` only: the ``org.opencontainers.image.ref.name`` asked
            for (``None``: the layout's only image).
    """

    text: str
    kind: RefKind
    location: str
    tag: str | None = None

    @property
    def key(self) -> str:
        """The canonical form: equal for two REFs written differently for the same thing."""
        suffix = f":{self.tag}" if self.tag else ""
        return f"{self.kind}:{self.location}{suffix}"


def check_digest(digest: object, what: str) -> str:
    """``digest`` if it is ``sha256:`` and 64 lower-case hex digits, else a ConfigError."""
    if not isinstance(digest, str) or DIGEST_RE.fullmatch(digest) is None:
        raise ConfigError(
            f"{what} has digest {str(digest)[:100]!r}: only sha256:<64 hex digits> is accepted",
            digest=str(digest)[:100],
        )
    return digest


def parse_ref(ref: str) -> ImageRef:
    """Parse ``ref`` (see the module's docstring); a ConfigError says what to write instead.

    >>> parse_ref("localhost/task-a:v1").kind
    <RefKind.PODMAN: 'podman'>
    >>> parse_ref("oci:/srv/layouts/a:v1").key
    'oci:/srv/layouts/a:v1'
    >>> parse_ref("/srv/rootfs").key
    'dir:/srv/rootfs'
    """
    if not isinstance(ref, str) or not ref.strip():
        raise ConfigError(f"an image REF is empty: {_KINDS_HELP}", ref=str(ref)[:200])
    text = ref.strip()
    if len(text) > MAX_REF_CHARS or any(c in text for c in "\0\n\r"):
        raise ConfigError(
            f"image REF {text[:80]!r}... is not one line of at most {MAX_REF_CHARS} characters",
            ref=text[:200],
        )
    for prefix, kind in (("oci:", RefKind.OCI), ("oci-archive:", RefKind.OCI_ARCHIVE)):
        if text.startswith(prefix):
            path, tag = _split_tag(text[len(prefix) :])
            return ImageRef(text, kind, _absolute(text, path, prefix), tag)
    if text.startswith("dir:"):
        return ImageRef(text, RefKind.DIR, _absolute(text, text[4:], "dir:"))
    if text.startswith("/"):
        return ImageRef(text, RefKind.DIR, os.path.normpath(text))
    name = text
    for prefix in ("containers-storage:", "podman:"):
        if name.startswith(prefix):
            name = name[len(prefix) :]
    if "://" in name or name.startswith(("docker:", "docker-daemon:", "docker-archive:")):
        raise ConfigError(
            f"image REF {text!r}: images are not pulled from registries here (none may be "
            f"reachable); put the image in Podman's storage first (podman pull / podman build "
            f"-t localhost/NAME:TAG) and {_KINDS_HELP}",
            ref=text,
        )
    if _NAME_RE.fullmatch(name) is None:
        raise ConfigError(
            f"image REF {text!r} is neither an image name nor a path: {_KINDS_HELP}", ref=text
        )
    return ImageRef(text, RefKind.PODMAN, name)


def _split_tag(rest: str) -> tuple[str, str | None]:
    path, sep, tag = rest.rpartition(":")
    if sep and path and _TAG_RE.fullmatch(tag) and "/" not in tag:
        return path, tag
    return rest, None


def _absolute(ref: str, path: str, prefix: str) -> str:
    if not path:
        raise ConfigError(f"image REF {ref!r} names no path: write {prefix}/ABSOLUTE/PATH", ref=ref)
    return os.path.normpath(os.path.abspath(path))
