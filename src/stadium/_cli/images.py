"""``stadium images``: the node's image cache (docs/IMAGES.md).

* ``stadium images list`` — the images prepared: digest, kind, size, layers, last use, lease;
* ``stadium images prefetch REF...`` — prepare images ahead of serving them;
* ``stadium images prune [--keep MIB]`` — evict the least recently used images no session
  leases, down to MIB (default: the budget, else every unleased image);
* ``stadium images inspect REF`` — the image as sessions get it (prepared if it is not), as JSON.

The cache is ``--cache-dir`` (``STADIUM_IMAGE_CACHE_DIR``, default ``/var/lib/stadium/images``).
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import click

from stadium._server.images import ImageStore

__all__ = ["images"]

_CACHE_DIR = click.option(
    "--cache-dir",
    envvar="STADIUM_IMAGE_CACHE_DIR",
    metavar="DIR",
    help="The image cache [env STADIUM_IMAGE_CACHE_DIR; /var/lib/stadium/images].",
)
_BUDGET = click.option(
    "--image-cache-mib",
    type=click.IntRange(min=0),
    default=0,
    help="The cache's budget in MiB: past it, least recently used unleased images are "
    "evicted (0: none) [0].",
)


def _store(cache_dir: str | None, budget_mib: int = 0) -> ImageStore:
    return ImageStore(cache_dir, budget_bytes=budget_mib << 20 if budget_mib else None)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def images() -> None:
    """The node's image cache: images prepared for --image sessions (docs/IMAGES.md)."""


@images.command("list")
@_CACHE_DIR
@click.option("--json", "as_json", is_flag=True, help="One JSON object per image.")
def list_(cache_dir: str | None, as_json: bool) -> None:
    """The images prepared, most recently used first."""
    store = _store(cache_dir)
    infos = store.images()
    if as_json:
        for info in infos:
            click.echo(json.dumps(dataclasses.asdict(info)))
        return
    click.echo(f"{'DIGEST':<19} {'KIND':<11} {'SIZE':>11} {'LAYERS':>6} {'LAST USED':<19} "
               f"{'LEASED':<6} REFS")  # fmt: skip
    for i in infos:
        used = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(i.last_used))
        click.echo(
            f"{i.digest[:19]:<19} {i.kind:<11} {_mib(i.size_bytes):>11} {i.layers:>6} "
            f"{used:<19} {'yes' if i.leased else 'no':<6} {', '.join(i.refs)}"
        )
    stats = store.stats()
    budget = f" of {_mib(stats.budget_bytes)}" if stats.budget_bytes else ""
    click.echo(f"{stats.images} images, {stats.layers} layers, {_mib(stats.bytes)}{budget}")


@images.command()
@click.argument("refs", nargs=-1, required=True, metavar="REF...")
@_CACHE_DIR
@_BUDGET
def prefetch(refs: tuple[str, ...], cache_dir: str | None, image_cache_mib: int) -> None:
    """Prepare each REF now (localhost/NAME:TAG, oci:DIR[:TAG], oci-archive:FILE[:TAG],
    dir:/ROOTFS), so that the first session of it does not wait."""
    store = _store(cache_dir, image_cache_mib)
    for ref in refs:
        start = time.perf_counter()
        image = store.prepare(ref)
        took = time.perf_counter() - start
        click.echo(
            f"{ref}: {image.digest[:19]}, {len(image.layers)} layers, "
            f"{_mib(image.size_bytes)} ({took:.2f} s)"
        )


@images.command()
@click.option(
    "--keep",
    type=click.IntRange(min=0),
    metavar="MIB",
    help="Evict down to this many MiB [the budget, else 0: every unleased image].",
)
@_CACHE_DIR
@_BUDGET
def prune(keep: int | None, cache_dir: str | None, image_cache_mib: int) -> None:
    """Evict the least recently used images no session leases; remove unused layers."""
    store = _store(cache_dir, image_cache_mib)
    removed = store.prune(None if keep is None else keep << 20)
    for digest in removed:
        click.echo(f"evicted {digest}")
    stats = store.stats()
    click.echo(f"{len(removed)} evicted; {stats.images} images, {_mib(stats.bytes)} left")


@images.command()
@click.argument("ref")
@_CACHE_DIR
def inspect(ref: str, cache_dir: str | None) -> None:
    """REF as sessions get it (prepared first if it is not): digest, layers (bottom first),
    config, size, as JSON."""
    image = _store(cache_dir).prepare(ref)
    body: dict[str, Any] = dataclasses.asdict(image)
    click.echo(json.dumps(body, indent=2))
