"""A running deployment: what every launcher returns (local, SLURM, Ray, Podman).

A :class:`Running` holds the :class:`~stadium.deploy.deployment.Deployment` (node URLs,
router URL if any) and knows how to drain and stop what it started: a launcher's
:class:`Stopper` stops it once, whether from :meth:`Running.stop` or, for a deployment
dropped without ``stop``, from a finalizer when it is collected or at exit. It is a context
manager (leaving the block drains and stops) and clients take it wherever they take a
URL::

    with stadium.launch("echo", replicas=4, on="local") as d:
        pool = stadium.SessionPool(d, size=256)
"""

from __future__ import annotations

import abc
import threading
import types
import weakref
from typing import Generic, TypeVar

from stadium.deploy.deployment import Deployment

CodesT = TypeVar("CodesT")


class Stopper(abc.ABC, Generic[CodesT]):
    """Stopping a deployment's servers, once: what stopping needs, kept apart from the
    deployment so that a finalizer can hold it. The first call stops (:meth:`stop`, the
    launcher's part); later calls, and a call racing it, do nothing."""

    def __init__(self) -> None:
        #: The servers' exit codes once stopped (None: not stopped, or not known).
        self.codes: CodesT | None = None
        self._done = False
        self._lock = threading.Lock()

    def __call__(self, timeout: float) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
            self.codes = self.stop(timeout)

    @abc.abstractmethod
    def stop(self, timeout: float) -> CodesT | None:
        """Drain the servers, end what is left after ``timeout``; their exit codes."""


class Running(abc.ABC):
    """Servers started by a launcher; :meth:`stop` drains them (SIGTERM: in-flight steps
    finish, sessions close with 1001), then ends what is left after ``timeout``."""

    #: Where the servers are (nodes, router); clients balance over ``deployment.nodes``.
    deployment: Deployment

    def __init__(self, deployment: Deployment) -> None:
        self.deployment = deployment

    def _stop_when_dropped(self, stopper: Stopper[CodesT]) -> weakref.finalize[[float], Running]:
        """A finalizer that stops the deployment when it is collected or at exit (10 s);
        :meth:`stop` detaches it and calls ``stopper`` itself."""
        return weakref.finalize(self, stopper, 10.0)

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


__all__ = ["Running", "Stopper"]
