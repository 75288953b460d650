"""Stadium servers on a Ray cluster (``stadium.ray.start``, ``stadium.launch(on="ray")``).

One Ray actor per server. Each actor holds one ``stadium serve`` subprocess bound to
its node's address (``ray.util.get_node_ip_address()``, a port the kernel picks unless
``port`` is given) and answers once the server's ``/health`` does. The actors sit in
one placement group:

* **one server per node** (default): bundles of ``workers`` CPUs, ``STRICT_SPREAD``
  (no two on one node); ``replicas`` defaults to the nodes alive;
* **one server per N CPUs** (``cpus_per_server=N``): bundles of N CPUs, ``SPREAD``
  (or ``strategy="PACK"``), ``workers`` defaults to N; ``replicas`` defaults to the
  cluster's CPUs // N.

Each actor reserves its bundle's CPUs (``num_cpus``), the CPUs its server's workers use,
so Ray schedules nothing else on them. :func:`start` returns a :class:`RayDeployment`:
its ``endpoints`` are the servers' URLs, for client-side balancing (no router; a
client must reach the nodes' addresses). :meth:`RayDeployment.stop` asks every actor to
SIGTERM its server and wait for the drain (in-flight steps finish, sessions close with
1001), then kills the actors and removes the placement group.

Connecting: when Ray is not initialised in this process yet, :func:`start` calls
``ray.init(address=address)``: ``address=None`` is ``"auto"`` (``$RAY_ADDRESS``, else the
cluster that ``ray start`` runs on this machine; none is an error: nothing is started
behind your back); ``"local"`` starts a throwaway single-node Ray inside this process;
``"HOST:PORT"`` or ``"ray://..."`` names a cluster. A connection :func:`start` made is
closed by :meth:`RayDeployment.stop`; one you made is left alone.

A server outlives nothing: if its actor dies (the driver exits, ``ray.kill``), the
kernel sends it SIGTERM (``PR_SET_PDEATHSIG``) and it drains.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from stadium._errors import ConfigError
from stadium.deploy.deployment import Deployment, refuse_token_in_argv
from stadium.deploy.local import ServerProcess, serve_command, wait_all_ready
from stadium.deploy.running import Running, Stopper

log = logging.getLogger("stadium.deploy.ray_cluster")

STRATEGIES = ("STRICT_SPREAD", "SPREAD", "PACK", "STRICT_PACK")


def _ray() -> Any:
    try:
        return importlib.import_module("ray")
    except ModuleNotFoundError:
        raise ConfigError(
            "Ray is not installed here: pip install 'stadium-rl[ray]' (or 'ray[default]')"
        ) from None


@dataclasses.dataclass(frozen=True, slots=True)
class RayServer:
    """One server of a :class:`RayDeployment`."""

    url: str  #: its base URL, ``http://NODE_IP:PORT``
    node_ip: str  #: the Ray node's address
    node_id: str  #: the Ray node's id
    pid: int  #: the ``stadium serve`` process id, on that node


class ServerActor:
    """The Ray actor holding one ``stadium serve`` subprocess (made remote by :func:`start`).

    Its methods run on the actor's main thread (a synchronous actor), which lives as long
    as the actor: the server is started with ``die_with_parent``.
    """

    def __init__(self) -> None:
        self.server: ServerProcess | None = None
        self.log_dir = Path(tempfile.mkdtemp(prefix="stadium-ray-"))

    def start(
        self, args: dict[str, Any], env: dict[str, str], cwd: str | None, timeout_s: float
    ) -> dict[str, Any]:
        """Start the server on this node; its ``RayServer`` fields, or ``{"error": ...}``."""
        ray = _ray()
        ip = str(ray.util.get_node_ip_address())
        main = threading.current_thread() is threading.main_thread()
        try:
            cmd = serve_command(host=ip, **args)
            self.server = ServerProcess(
                cmd, log_dir=self.log_dir, name="server", env=env,
                cwd=cwd if cwd and os.path.isdir(cwd) else None, die_with_parent=main,
            )  # fmt: skip
            url = wait_all_ready([self.server], timeout_s)[0]
        except (ConfigError, OSError) as exc:
            if self.server is not None:
                self.server.stop(0.0)
            return {"error": f"on node {ip}: {exc}"}
        node_id = str(ray.get_runtime_context().get_node_id())
        return {"url": url, "node_ip": ip, "node_id": node_id, "pid": self.server.pid}

    def stop(self, timeout: float) -> int | None:
        """Drain the server (SIGTERM), wait up to ``timeout``, SIGKILL what is left."""
        code = None if self.server is None else self.server.stop(timeout)
        shutil.rmtree(self.log_dir, ignore_errors=True)
        return code


class _RayStopper(Stopper[list[int | None]]):
    """Stops the server actors, removes the placement group (and the connection this launcher
    made)."""

    def __init__(self, actors: list[Any], group: Any, owns_connection: bool) -> None:
        super().__init__()
        self.actors = actors
        self.group = group
        self.owns_connection = owns_connection

    def stop(self, timeout: float) -> list[int | None] | None:
        codes: list[int | None] | None = None
        ray = _ray()
        if not ray.is_initialized():  # disconnected: Ray ended the actors, the servers drain
            return None
        try:
            refs = [a.stop.remote(timeout) for a in self.actors]
            codes = list(ray.get(refs, timeout=timeout + 15.0))
        except Exception as exc:  # an actor already dead, a timeout: kill regardless
            log.warning("stopping the Stadium servers on Ray: %r", exc)
        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception as exc:
                log.debug("ray.kill: %r", exc)
        if self.group is not None:
            try:
                ray.util.remove_placement_group(self.group)
            except Exception as exc:
                log.debug("remove_placement_group: %r", exc)
        if self.owns_connection:
            ray.shutdown()
        return codes


class RayDeployment(Running):
    """Servers on a Ray cluster: ``servers`` (:class:`RayServer`), ``placement_group``,
    ``actors``; :meth:`stop` drains them, kills the actors, removes the group."""

    def __init__(
        self, servers: list[RayServer], actors: list[Any], group: Any, stopper: _RayStopper
    ) -> None:
        super().__init__(Deployment.of(s.url for s in servers))
        self.servers = servers
        self.actors = actors
        self.placement_group = group
        self._stopper = stopper
        self._finalizer = self._stop_when_dropped(stopper)

    def stop(self, timeout: float = 30.0) -> None:
        """Ask each actor to SIGTERM its server and wait up to ``timeout`` for the drain
        (then SIGKILL); kill the actors, remove the placement group. Idempotent."""
        self._finalizer.detach()
        self._stopper(timeout)

    @property
    def exit_codes(self) -> list[int | None] | None:
        """The servers' exit codes once stopped (0: drained and exited)."""
        return self._stopper.codes


def _connect(ray: Any, address: str | None) -> bool:
    """Connect to Ray unless this process is; whether this call connected."""
    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"address": address or "auto"}
    if address == "local":
        kwargs = {}  # ray.init() with no address starts a local Ray: asked for explicitly
    try:
        ray.init(**kwargs)
    except ConnectionError as exc:
        raise ConfigError(
            f"no Ray cluster to connect to ({exc}); start one (ray start --head), set "
            "RAY_ADDRESS, pass address='HOST:PORT', or address='local' for a Ray inside "
            "this process"
        ) from None
    return True


def _layout(
    ray: Any,
    replicas: int | None,
    cpus_per_server: int | None,
    workers: int | None,
    strategy: str | None,
) -> tuple[int, int, int, str]:
    """(servers, CPUs per bundle, workers per server, strategy)."""
    if cpus_per_server is None:
        workers = workers or 1
        cpus = workers
        alive = sum(1 for n in ray.nodes() if n.get("Alive"))
        count = replicas if replicas is not None else alive
        strategy = strategy or "STRICT_SPREAD"
    else:
        if cpus_per_server < 1:
            raise ConfigError("cpus_per_server must be at least 1", cpus_per_server=cpus_per_server)
        cpus = cpus_per_server
        workers = workers or cpus
        total = int(ray.cluster_resources().get("CPU", 0))
        count = replicas if replicas is not None else total // cpus
        strategy = strategy or "SPREAD"
    if strategy not in STRATEGIES:
        raise ConfigError(f"strategy must be one of {', '.join(STRATEGIES)}", strategy=strategy)
    if count < 1:
        raise ConfigError("no room for a server on this Ray cluster", cpus_per_server=cpus)
    return count, cpus, workers, strategy


def start(
    target: str,
    *,
    replicas: int | None = None,
    cpus_per_server: int | None = None,
    strategy: str | None = None,
    address: str | None = None,
    port: int = 0,
    workers: int | None = None,
    max_sessions: int | None = None,
    drain_timeout: float | None = None,
    serve_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout_s: float = 120.0,
) -> RayDeployment:
    """Start Stadium servers on a Ray cluster; return once every one answers ``/health``.

    Args:
        target: what ``stadium serve`` takes; it must load on every node (same code
            there, or a built-in env).
        replicas: how many servers (default: one per alive node, or as many as the
            cluster's CPUs hold with ``cpus_per_server``).
        cpus_per_server: None: one server per node; N: one per N CPUs.
        strategy: the placement group's (default ``STRICT_SPREAD`` per node,
            ``SPREAD`` per N CPUs; also ``PACK``, ``STRICT_PACK``).
        address: the Ray cluster, when this process is not connected yet (see the
            module docstring: never starts a cluster unless ``"local"``).
        port: 0: a free port on each node; else that port on every node.
        workers, max_sessions, drain_timeout, serve_args: each server's ``stadium
            serve`` options (``workers`` also sets the CPUs an actor reserves).
        env: environment variables added for the servers.
        cwd: their working directory if it exists on the node (default: this one's).
        timeout_s: how long to wait for the placement group, then for the servers.

    Raises:
        ConfigError: Ray missing or unreachable, the placement group not placeable in
            ``timeout_s`` (e.g. more servers than nodes, one per node), a server that
            did not come up (with the end of its stderr). Nothing is left running.
    """
    refuse_token_in_argv(serve_args)  # before Ray: the token goes in ``env``
    ray = _ray()
    owns = _connect(ray, address)
    actors: list[Any] = []
    group: Any = None
    stopper = _RayStopper(actors, None, owns)
    try:
        count, cpus, workers, strategy = _layout(ray, replicas, cpus_per_server, workers, strategy)
        strategies = importlib.import_module("ray.util.scheduling_strategies")
        group = stopper.group = ray.util.placement_group([{"CPU": cpus}] * count, strategy)
        if not group.wait(timeout_seconds=timeout_s):
            res, free = ray.cluster_resources(), ray.available_resources()
            alive = sum(1 for n in ray.nodes() if n.get("Alive"))
            raise ConfigError(
                f"Ray could not place {count} server(s) of {cpus} CPU(s) ({strategy}) within "
                f"{timeout_s:.0f} s: the cluster has {alive} node(s), {res.get('CPU', 0):g} "
                f"CPUs ({free.get('CPU', 0):g} free); ask for fewer replicas or CPUs"
            )
        remote = ray.remote(ServerActor)
        for i in range(count):
            placement = strategies.PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=i
            )
            actors.append(remote.options(num_cpus=cpus, scheduling_strategy=placement).remote())
        args = {
            "target": target, "port": port, "workers": workers, "max_sessions": max_sessions,
            "drain_timeout": drain_timeout, "serve_args": list(serve_args),
        }  # fmt: skip
        where = os.fspath(cwd) if cwd is not None else os.getcwd()
        refs = [a.start.remote(args, dict(env or {}), where, timeout_s) for a in actors]
        try:
            answers = ray.get(refs, timeout=timeout_s + 30.0)
        except ray.exceptions.RayError as exc:
            raise ConfigError(f"the Stadium actors failed on Ray: {exc}") from None
        if errors := [a["error"] for a in answers if "error" in a]:
            raise ConfigError(f"{len(errors)} server(s) did not come up: " + "\n".join(errors))
    except BaseException:
        stopper(0.0)
        raise
    servers = [RayServer(a["url"], a["node_ip"], a["node_id"], a["pid"]) for a in answers]
    return RayDeployment(servers, actors, group, stopper)


__all__ = ["STRATEGIES", "RayDeployment", "RayServer", "ServerActor", "start"]
