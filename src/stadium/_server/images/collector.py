"""The image store's figures for ``GET /metrics``: a prometheus-client collector.

Register it beside the server's own collector (``registry.register(ImageStoreCollector(store))``);
each scrape reads the store's records (one small file per image, a lock probe per image):

* ``stadium_images_prepared``: images in the node's cache;
* ``stadium_image_cache_layers``: layers extracted (shared between images, counted once);
* ``stadium_image_cache_bytes``: what those layers take;
* ``stadium_image_cache_budget_bytes``: the budget (absent without one);
* ``stadium_images_leased``: images a process holds a lease on now.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from stadium._server.images.store import ImageStore

__all__ = ["ImageStoreCollector"]


class ImageStoreCollector(Collector):
    """Gauges of one :class:`ImageStore`, read at each scrape."""

    def __init__(self, store: ImageStore) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        stats = self.store.stats()
        yield GaugeMetricFamily(
            "stadium_images_prepared", "Images prepared in the node's image cache.", stats.images
        )
        yield GaugeMetricFamily(
            "stadium_image_cache_layers",
            "Layers extracted in the image cache (shared between images, counted once).",
            stats.layers,
        )
        yield GaugeMetricFamily(
            "stadium_image_cache_bytes", "Bytes the image cache's layers take.", stats.bytes
        )
        if stats.budget_bytes is not None:
            yield GaugeMetricFamily(
                "stadium_image_cache_budget_bytes",
                "The image cache's budget (--image-cache-mib).",
                stats.budget_bytes,
            )
        yield GaugeMetricFamily(
            "stadium_images_leased", "Images a process holds a lease on now.", stats.leased
        )
