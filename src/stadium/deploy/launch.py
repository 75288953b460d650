"""``stadium.launch``: one Python API over the engines that run Stadium servers.

::

    with stadium.launch("benchmark", replicas=4, on="local") as d:
        async with stadium.SessionPool(d, size=256) as pool:
            ...

Every engine returns a :class:`~stadium.deploy.running.Running`: its ``deployment``
(``endpoints``, ``router`` if one was started), ``stop(timeout)`` (drain, then end what
is left) and context-manager use. Clients take it wherever they take a URL and balance
their sessions over its nodes. The engines (each imported only when used):

* ``"local"`` — :func:`stadium.deploy.local.start`: processes on this machine;
* ``"slurm"`` — :func:`stadium.deploy.slurm.launch`: one server per node of a batch
  job (``replicas`` nodes), HAProxy in front with ``router="haproxy"`` (Envoy with
  ``router="envoy"``); stop is
  ``scancel`` (the servers drain) and waits for the job to end;
* ``"ray"`` — :func:`stadium.deploy.ray_cluster.start`: one actor per server on a Ray cluster;
* ``"podman"`` — :func:`stadium.deploy.podman.start`: containers of a Stadium image.

Options beyond ``replicas`` go to the engine; an option it does not take is a
:class:`~stadium.ConfigError` listing the ones it does.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from stadium._errors import ConfigError
from stadium.deploy.deployment import Deployment
from stadium.deploy.running import Running

#: The engines ``on=`` names.
ENGINES = ("local", "slurm", "ray", "podman")

log = logging.getLogger("stadium.deploy")

_ENDED = ("GONE", "FAILED", "CANCELLED", "COMPLETED", "TIMEOUT", "NODE_FAIL", "PREEMPTED")


class SlurmJob(Running):
    """A ``stadium slurm`` job: ``job_id``; :meth:`stop` cancels it (the servers drain)."""

    def __init__(self, deployment: Deployment, env: Mapping[str, str] | None = None) -> None:
        super().__init__(deployment)
        if deployment.job_id is None:
            raise ConfigError("a SLURM deployment needs its job id")
        self.job_id: str = deployment.job_id
        self.env = None if env is None else dict(env)
        self.ended: bool = False

    def stop(self, timeout: float = 30.0) -> None:
        """``scancel`` (SIGTERM: the servers drain, the router stops softly), then wait up
        to ``timeout`` for the job to leave the queue (SLURM kills what outlives its
        ``KillWait``). Idempotent."""
        from stadium.deploy.slurm import _job_state

        if self.ended:
            return
        subprocess.run(["scancel", self.job_id], env=self.env, timeout=30, check=False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if _job_state(self.job_id, self.env) in _ENDED:
                self.ended = True
                return
            time.sleep(0.25)
        log.warning("SLURM job %s still listed %.0f s after scancel", self.job_id, timeout)


def _start_slurm(
    target: str,
    *,
    replicas: int = 1,
    port: int = 8000,
    router: str | None = None,
    router_port: int = 8080,
    workers: int | None = None,
    max_sessions: int = 8192,
    drain_timeout: float | None = None,
    serve_args: Sequence[str] = (),
    sbatch_args: Sequence[str] = (),
    deployment: str | os.PathLike[str] = "stadium-deployment.json",
    job_name: str = "stadium",
    python: str = sys.executable,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 300.0,
) -> SlurmJob:
    """``stadium slurm`` from Python (:mod:`stadium.deploy.slurm`): ``replicas`` nodes;
    ``deployment``: where the job writes its deployment file (a shared filesystem);
    ``env``: the environment of the SLURM commands (e.g. ``SLURM_CONF``)."""
    from stadium.deploy.slurm import SlurmOptions, launch

    extra = () if drain_timeout is None else ("--drain-timeout", str(drain_timeout))
    opts = SlurmOptions(
        target=target, nodes=replicas, port=port, router=router or "none",
        router_port=router_port, workers=workers, max_sessions_per_node=max_sessions,
        deployment=Path(deployment), python=python, serve_args=(*serve_args, *extra),
        sbatch_args=tuple(sbatch_args), job_name=job_name,
    )  # fmt: skip
    env_dict = None if env is None else dict(env)
    d = launch(opts, timeout_s=timeout_s, env=env_dict, echo=log.info)
    return SlurmJob(d, env_dict)


def _target_name(target: Any) -> str:
    """``stadium serve``'s TARGET for ``target``: a string as is; an env class as
    ``module:Class`` (it must be importable by that name in the servers)."""
    if isinstance(target, str):
        return target
    if isinstance(target, type):
        module, qualname = target.__module__, target.__qualname__
        if module == "__main__" or "<locals>" in qualname:
            raise ConfigError(
                f"{target.__name__} cannot be imported by name in another process: define it "
                "in a module, or pass a target string ('package.module:Class', 'file.py:Class')"
            )
        return f"{module}:{qualname}"
    raise ConfigError(f"target must be a string or an environment class, not {target!r}")


def _engine(on: str) -> Callable[..., Running]:
    if on == "local":
        from stadium.deploy import local

        return local.start
    if on == "slurm":
        return _start_slurm
    if on == "ray":
        from stadium.deploy import ray_cluster

        return ray_cluster.start
    # H1's module; by name, so this one type-checks whatever its state
    start: Callable[..., Running] = importlib.import_module("stadium.deploy.podman").start
    return start


def _check_options(on: str, fn: Callable[..., Running], options: Mapping[str, Any]) -> None:
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    known = sorted(n for n, p in params.items() if p.kind is p.KEYWORD_ONLY and n != "replicas")
    if unknown := sorted(set(options) - set(known)):
        raise ConfigError(
            f"on={on!r} takes no option {', '.join(unknown)}; its options: {', '.join(known)}",
            engine=on,
        )


def launch(target: Any, *, replicas: int = 1, on: str = "local", **options: Any) -> Running:
    """Start ``replicas`` Stadium servers of ``target`` on an engine; a :class:`Running`.

    Args:
        target: what ``stadium serve`` takes (``"echo"``, ``"pkg.module:Env"``,
            ``"gymnasium:CartPole-v1"``), or an env class importable by its module name.
        replicas: how many servers (SLURM: nodes; Ray: actors; Podman: containers).
        on: ``"local"``, ``"slurm"``, ``"ray"`` or ``"podman"``.
        **options: the engine's (``workers``, ``max_sessions``, ``serve_args``, ``env``
            everywhere; see each engine's ``start`` for the others).

    Returns once every server answers ``/health``; on failure nothing is left running
    and a :class:`~stadium.ConfigError` says why.
    """
    if on not in ENGINES:
        raise ConfigError(
            f"unknown engine on={on!r}: choose one of {', '.join(map(repr, ENGINES))}",
            engines=list(ENGINES),
        )
    if not isinstance(replicas, int) or replicas < 1:
        raise ConfigError("replicas must be an integer of at least 1", replicas=replicas)
    name = _target_name(target)
    fn = _engine(on)
    _check_options(on, fn, options)
    return fn(name, replicas=replicas, **options)


__all__ = ["ENGINES", "SlurmJob", "launch"]
