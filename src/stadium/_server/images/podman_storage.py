"""Images in the node's Podman storage: looked up with ``podman image inspect``, exported with
``podman save --format oci-dir`` (then read as any OCI layout).

Why ``podman save`` and not Podman's own layer directories (``.../overlay/ID/diff``, already
extracted, and cheaper to copy): those are Podman's private storage, laid out by its storage
driver and removed under us by ``podman rmi``; the export is Podman's public interface, gives
each layer as a tar checked against the config's ``diff_id``, and makes one code path for every
kind. The export is paid once per image (docs/IMAGES.md has the figures).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess

import msgspec

from stadium._errors import ConfigError
from stadium._server.images.oci import ConfigSection, ImageConfig, image_config
from stadium._server.images.refs import check_digest

__all__ = ["PodmanImage", "inspect", "save"]

INSPECT_TIMEOUT_S = 120.0
SAVE_TIMEOUT_S = 1800.0


@dataclasses.dataclass(frozen=True, slots=True)
class PodmanImage:
    """An image in Podman's storage.

    Attributes:
        digest: ``sha256:`` + its ID (the digest of its config, as an OCI layout's).
        stamp_path: the storage's image list (``<graphroot>/<driver>-images/images.json``):
            while it is unchanged, so is what every name points at (``None``: unknown).
        diff_ids: its layers' uncompressed digests, bottom first.
        config: its config (``Env``, ``WorkingDir``, ...), as the image's config says.
    """

    digest: str
    stamp_path: str | None
    diff_ids: tuple[str, ...]
    config: ImageConfig


def _podman(what: str) -> str:
    exe = shutil.which("podman")
    if exe is None:
        raise ConfigError(
            f"{what} names an image in Podman's storage, but podman is not installed "
            f"(scripts/install-container-deps.sh installs it); or give an OCI layout "
            f"(oci:DIR) or a root filesystem (dir:/PATH)"
        )
    return exe


def inspect(name: str, what: str) -> PodmanImage:
    """``name``'s ID and where its storage's image list is; a ConfigError if it is not there."""
    exe = _podman(what)
    try:
        out = subprocess.run(
            [exe, "image", "inspect", "--format", "json", "--", name],
            capture_output=True, text=True, timeout=INSPECT_TIMEOUT_S, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise ConfigError(f"{what}: podman image inspect took over {INSPECT_TIMEOUT_S} s") from None
    if out.returncode != 0:
        raise ConfigError(
            f"{what}: no such image in Podman's storage ({out.stderr.strip()[-300:]}); "
            f"`podman images` lists them; build one with `podman build -t localhost/NAME:TAG .`, "
            f"or write dir:/PATH for a root filesystem directory",
            ref=what,
        )
    try:
        info = json.loads(out.stdout)[0]
        digest = check_digest(f"sha256:{info['Id']}", f"{what}: podman's image ID")
        diff_ids = tuple(check_digest(d, what) for d in info["RootFS"]["Layers"])
        config = image_config(msgspec.convert(info.get("Config"), ConfigSection | None), what)
    except (ValueError, LookupError, TypeError, msgspec.ValidationError):
        raise ConfigError(f"{what}: podman image inspect answered what it should not") from None
    return PodmanImage(digest, _stamp_path(info), diff_ids, config)


def _stamp_path(info: dict[str, object]) -> str | None:
    driver = info.get("GraphDriver")
    if not isinstance(driver, dict):
        return None
    name, data = driver.get("Name"), driver.get("Data")
    upper = data.get("UpperDir") if isinstance(data, dict) else None
    if not isinstance(name, str) or not isinstance(upper, str):
        return None
    marker = f"/{name}/"
    if marker not in upper:
        return None
    graphroot = upper[: upper.index(marker)]
    path = os.path.join(graphroot, f"{name}-images", "images.json")
    return path if os.path.isfile(path) else None


def save(name: str, dest: str, what: str) -> None:
    """``podman save --uncompressed --format oci-dir -o dest name`` (``dest`` must not exist;
    uncompressed: half the time of the default gzip here, and nothing to decompress)."""
    exe = _podman(what)
    try:
        out = subprocess.run(
            [exe, "save", "--quiet", "--uncompressed", "--format", "oci-dir", "-o", dest,
             "--", name],
            capture_output=True, text=True, timeout=SAVE_TIMEOUT_S, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise ConfigError(f"{what}: podman save took over {SAVE_TIMEOUT_S} s") from None
    if out.returncode != 0:
        raise ConfigError(f"{what}: podman save failed: {out.stderr.strip()[-500:]}")
