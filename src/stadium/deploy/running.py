"""A running deployment: what every launcher returns (local, SLURM, Ray, Podman).

A :class:`Running` holds the :class:`~stadium.deploy.deployment.Deployment` (node URLs,
router URL if any) and knows how to drain and stop what it started. It is a context
manager (leaving the block drains and stops) and clients take it wherever they take a
URL::

    with stadium.launch("echo", replicas=4, on="local") as d:
        pool = stadium.SessionPool(d, size=256)
"""

from __future__ import annotations

import abc
import types

from stadium.deploy.deployment import Deployment


class Running(abc.ABC):
    """Servers started by a launcher; :meth:`stop` drains them (SIGTERM: in-flight steps
    finish, sessions close with 1001), then ends what is left after ``timeout``."""

    #: Where the servers are (nodes, router); clients balance over ``deployment.nodes``.
    deployment: Deployment

    def __init__(self, deployment: Deployment) -> None:
        self.deployment = deployment

    @property
    def endpoints(self) -> tuple[str, ...]:
        """The nodes' base URLs (``http://host:port``), for client-side balancing."""
        return self.deployment.nodes

    @property
    def router(self) -> str | None:
        """The router's URL, if the launcher started one."""
        return self.deployment.router

    @property
    def url(self) -> str:
        """One URL: the router's, else the first node's."""
        return self.deployment.url

    @abc.abstractmethod
    def stop(self, timeout: float = 30.0) -> None:
        """Drain every server and wait up to ``timeout`` seconds, then end what is left.
        Idempotent."""

    def __enter__(self) -> Running:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} nodes={list(self.endpoints)} router={self.router}>"


__all__ = ["Running"]
