"""Stadium in Podman containers: build the image, run replicas, drain and remove them.

:func:`build_image` builds Stadium's image (the ``Containerfile`` at the root of
the repository, shipped in the wheel as package data) or any other Containerfile,
optionally from a directory of wheels (offline) and on another base image::

    build_image("localhost/stadium:dev", wheels_dir="wheels", pull="never",
                base="localhost/my-debian-python:bookworm")

:func:`start` runs ``replicas`` containers of an image, each serving ``target``
on its own port, waits until every one answers ``GET /health`` and returns a
:class:`PodmanDeployment` (a :class:`~stadium.deploy.running.Running`: clients
take it wherever they take a URL; ``stop`` drains and removes the containers)::

    with start("wordguess", replicas=2, image="localhost/stadium:dev", port=0) as d:
        pool = stadium.SessionPool(d, size=64)

Networking: by default the containers share the host's network (``--network
host``), each binding ``HOST:PORT`` itself (``127.0.0.1`` unless told
otherwise): no NAT rules, no bridge, nothing published beyond what the server
binds. ``network="bridge"`` (or any Podman network) publishes each replica's
port with ``-p HOST:PORT:8000`` instead; it needs Podman's network plugins and
iptables.

Stopping: ``podman stop -t TIMEOUT`` sends the image's stop signal (SIGTERM):
sessions are served for up to ``--drain-timeout`` (``drain_timeout``, 30 s by
default), then closed with 1001 after their in-flight step, and the server
exits 0; a container still running after ``TIMEOUT`` is killed. Keep the drain
timeout under the stop timeout.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path

from stadium._errors import ConfigError
from stadium._util.health import healthy
from stadium.deploy.deployment import Deployment, refuse_token_in_argv
from stadium.deploy.running import Running, Stopper

#: The image ``start`` runs unless told otherwise (what docs/DEPLOY.md's build command tags).
DEFAULT_IMAGE = "localhost/stadium:latest"
#: The port a server listens on inside its container when the network is not the host's.
CONTAINER_PORT = 8000
#: Label on every container ``start`` runs: the deployment's id (``podman ps --filter``).
LABEL = "io.stadium.deployment"

_LOG_LINES = 30


def containerfile() -> Path:
    """Stadium's Containerfile: the wheel's copy (package data), else the checkout's."""
    packaged = resources.files("stadium.deploy") / "Containerfile"
    if packaged.is_file():
        return Path(str(packaged))
    checkout = Path(__file__).resolve().parents[3] / "Containerfile"
    if checkout.is_file():
        return checkout
    raise ConfigError(  # pragma: no cover - a broken installation
        "Stadium's Containerfile is missing from this installation; reinstall stadium-rl"
    )


def _podman(podman: str) -> str:
    path = shutil.which(podman)
    if path is None:
        raise ConfigError(
            f"{podman!r} is not installed or not on PATH: install Podman (Debian: "
            "apt-get install podman runc), or pass podman= the command's path",
            podman=podman,
        )
    return path


def _run(
    cmd: Sequence[str],
    *,
    timeout: float,
    check: bool = True,
    what: str = "",
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a Podman command; ``env``: variables added to its environment (never its argv,
    which every local user can read: ``--env=NAME`` passes one on to a container)."""
    try:
        out = subprocess.run(
            list(cmd), capture_output=True, text=True, timeout=timeout, check=False,
            env=None if env is None else {**os.environ, **env},
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise ConfigError(
            f"{what or cmd[1]} did not finish within {timeout:.0f} s: {' '.join(cmd)}"
        ) from None
    if check and out.returncode != 0:
        detail = (out.stderr.strip() or out.stdout.strip())[-3000:]
        raise ConfigError(f"{what or ' '.join(cmd[:2])} failed ({out.returncode}): {detail}")
    return out


def build_image(
    tag: str = DEFAULT_IMAGE,
    *,
    base: str | None = None,
    wheels_dir: str | os.PathLike[str] | None = None,
    context: str | os.PathLike[str] | None = None,
    file: str | os.PathLike[str] | None = None,
    extras: Sequence[str] = (),
    packages: Sequence[str] = (),
    build_args: Mapping[str, str] | None = None,
    pull: str = "missing",
    layers: bool = True,
    podman: str = "podman",
    timeout_s: float = 1800.0,
) -> str:
    """Build an image with ``podman build``; return ``tag``.

    Args:
        tag: the image's name.
        base: the ``BASE_IMAGE`` build argument (default: the file's own, ``python:3.12-slim``
            for Stadium's); any image with ``python3`` (>= 3.11) and its ``venv`` module.
        wheels_dir: wheels to install from, offline: stadium-rl and every dependency, built
            for the base's Python (``pip wheel -w DIR '.[gym]'``). Copied into the build
            context as ``wheels/``; without it the build installs from PyPI.
        context: the build context (default: an empty temporary directory, plus the wheels).
            Stadium's Containerfile needs nothing from it but ``wheels/``; a project's
            Dockerfile (``stadium init``) needs the project: pass its directory and ``file``.
        file: the Containerfile (default: Stadium's, see :func:`containerfile`).
        extras: stadium-rl's extras to install (``("gym",)``); Stadium's Containerfile only.
        packages: more requirements to install beside it (your env's distribution).
        build_args: more ``--build-arg`` values.
        pull: Podman's ``--pull`` policy for the base: ``missing``, ``always`` or ``never``
            (a base that exists only in local storage, with no registry to ask).
        layers: keep intermediate images to reuse as a cache (``False``: only the image is
            left behind, so removing it frees everything the build made).
        podman: the command.
        timeout_s: seconds the build may take.

    The image is built in the docker format (Podman drops ``HEALTHCHECK`` from OCI images).

    Raises:
        ConfigError: Podman is missing, a path does not exist, or the build failed (with the
            end of its output).
    """
    exe = _podman(podman)
    if pull not in ("missing", "always", "never", "newer"):
        raise ConfigError("pull must be missing, always, newer or never", pull=pull)
    recipe = Path(file) if file is not None else containerfile()
    if not recipe.is_file():
        raise ConfigError(f"no Containerfile at {recipe}", path=str(recipe))
    args = dict(build_args or {})
    if base is not None:
        args["BASE_IMAGE"] = base
    if extras:
        args["EXTRAS"] = ",".join(extras)
    if packages:
        args["PACKAGES"] = " ".join(packages)
    with contextlib.ExitStack() as stack:
        if context is None:
            ctx = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="stadium-build-")))
        else:
            ctx = Path(context)
            if not ctx.is_dir():
                raise ConfigError(f"build context {ctx} is not a directory", path=str(ctx))
        if wheels_dir is not None:
            _add_wheels(ctx, Path(wheels_dir), temporary=context is None)
        cmd = [
            exe, "build", "--format", "docker", f"--pull={pull}", f"--layers={str(layers).lower()}",
            "--tag", tag,
            "--file", str(recipe),
            *(f"--build-arg={k}={v}" for k, v in args.items()),
            str(ctx),
        ]  # fmt: skip
        _run(cmd, timeout=timeout_s, what=f"podman build of {tag}")
    return tag


def _add_wheels(ctx: Path, wheels: Path, *, temporary: bool) -> None:
    if not wheels.is_dir() or not any(wheels.glob("*.whl")):
        raise ConfigError(f"wheels_dir {wheels} holds no .whl files", path=str(wheels))
    dest = ctx / "wheels"
    if dest.resolve() == wheels.resolve():
        return
    if not temporary:
        raise ConfigError(
            f"wheels_dir must be the build context's wheels/ ({dest}) when a context is "
            "given: copy the wheels there",
            path=str(wheels),
        )
    dest.mkdir()
    for whl in wheels.glob("*.whl"):
        try:
            os.link(whl, dest / whl.name)
        except OSError:
            shutil.copy2(whl, dest / whl.name)


class _PodmanStopper(Stopper[dict[str, int | None]]):
    """Stops the containers (``podman stop``), reads their exit codes, removes them."""

    def __init__(self, podman: str, names: Sequence[str]) -> None:
        super().__init__()
        self.podman = podman
        self.names = list(names)

    def stop(self, timeout: float) -> dict[str, int | None]:
        self.codes = dict.fromkeys(self.names)
        seconds = max(0, math.ceil(timeout))
        try:
            _run(
                [self.podman, "stop", "--ignore", "-t", str(seconds), *self.names],
                timeout=seconds + 60, check=False, what="podman stop",
            )  # fmt: skip
            return _exit_codes(self.podman, self.names)
        finally:
            _run(
                [self.podman, "rm", "--force", "--ignore", "-t", "0", *self.names],
                timeout=60, check=False, what="podman rm",
            )  # fmt: skip


class PodmanDeployment(Running):
    """Containers started by :func:`start`; :meth:`stop` drains and removes them. A
    deployment dropped without ``stop`` is stopped when collected or at exit (10 s)."""

    def __init__(
        self, deployment: Deployment, containers: Sequence[str], *, podman: str, ident: str
    ) -> None:
        super().__init__(deployment)
        #: The containers' names, one per node, in the order of ``deployment.nodes``.
        self.containers = tuple(containers)
        #: The value of the ``io.stadium.deployment`` label on every container.
        self.ident = ident
        self._podman = podman
        self._stopper = _PodmanStopper(podman, self.containers)
        self._finalizer = self._stop_when_dropped(self._stopper)

    @property
    def exit_codes(self) -> dict[str, int | None] | None:
        """Each container's exit code once stopped (0: drained and exited; None: unknown)."""
        return self._stopper.codes

    def logs(self, container: str, lines: int = _LOG_LINES) -> str:
        """The last ``lines`` lines a container wrote (stdout and stderr)."""
        return _logs(self._podman, container, lines)

    def stop(self, timeout: float = 30.0) -> None:
        """``podman stop -t TIMEOUT`` every container at once (SIGTERM: each drains; killed
        after ``timeout``), record the exit codes, remove the containers. Idempotent."""
        self._finalizer.detach()
        self._stopper(timeout)


def _exit_codes(podman: str, names: Sequence[str]) -> dict[str, int | None]:
    codes: dict[str, int | None] = dict.fromkeys(names)
    out = _run(
        [podman, "inspect", "--format", "json", *names], timeout=60, check=False, what="inspect"
    )
    with contextlib.suppress(ValueError, TypeError):
        for item in json.loads(out.stdout or "[]"):
            name = str(item.get("Name", "")).lstrip("/")
            state = item.get("State") or {}
            code = state.get("ExitCode")
            if name in codes and not state.get("Running", False) and code is not None:
                codes[name] = int(code)
    return codes


def _logs(podman: str, container: str, lines: int) -> str:
    out = _run(
        [podman, "logs", "--tail", str(lines), container], timeout=30, check=False, what="logs"
    )
    return (out.stdout + out.stderr).strip() or "(no output)"


def _free_ports(host: str, count: int) -> list[int]:
    """``count`` distinct ports the kernel calls free on ``host`` now (held until all chosen)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with contextlib.ExitStack() as stack:
        socks = [
            stack.enter_context(socket.socket(family, socket.SOCK_STREAM)) for _ in range(count)
        ]
        for s in socks:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in socks]


def _url_host(host: str) -> str:
    """The address clients reach a server bound to ``host`` at."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def _running(podman: str, name: str) -> tuple[bool, int | None]:
    out = _run(
        [podman, "inspect", "--format", "{{.State.Running}} {{.State.ExitCode}}", name],
        timeout=30, check=False, what="inspect",
    )  # fmt: skip
    running, _, code = out.stdout.strip().partition(" ")
    if out.returncode != 0:
        return False, None
    return running == "true", int(code) if code.lstrip("-").isdigit() else None


def start(
    target: str,
    *,
    replicas: int = 1,
    image: str = DEFAULT_IMAGE,
    port: int = 0,
    host: str = "127.0.0.1",
    workers: int | None = None,
    max_sessions: int | None = None,
    drain_timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    serve_args: Sequence[str] = (),
    run_args: Sequence[str] = (),
    network: str = "host",
    name: str = "stadium",
    podman: str = "podman",
    timeout_s: float = 120.0,
) -> PodmanDeployment:
    """Run ``replicas`` containers of ``image`` serving ``target``; wait until all are healthy.

    Args:
        target: what each container serves (``stadium serve TARGET``): a built-in name, or a
            module / file the image holds (mount one with ``run_args=("-v", "SRC:/app:ro")``).
        replicas: how many containers (one server each, on its own port).
        image: an image built from Stadium's Containerfile (or one with the same entry point).
        port: the first replica's port, the next ones counting up from it; 0 (default):
            ports free on ``host`` now.
        host: the address each server binds (host network) or is published on (others).
        workers: ``WORKERS`` per container (default: the image's, 1).
        max_sessions: ``MAX_CONCURRENT_ENVS`` per container (default: the image's).
        drain_timeout: ``--drain-timeout`` (default: the server's, 30 s); keep it under the
            timeout given to :meth:`PodmanDeployment.stop`.
        env: more environment variables for every container.
        serve_args: more ``stadium serve`` options (``("--drain-timeout", "20")``).
        run_args: more ``podman run`` options (volumes, CPU limits, ...).
        network: ``host`` (default) or a Podman network, the port then published with ``-p``.
        name: the containers' name prefix (``NAME-ID-0``, ``NAME-ID-1``, ...).
        podman: the command.
        timeout_s: seconds for every container to answer ``/health``.

    Raises:
        ConfigError: a bad argument, Podman or the image missing, or a container that did
            not come up in time (with its last log lines); every container started is
            removed first.
    """
    if replicas < 1:
        raise ConfigError("replicas must be at least 1", replicas=replicas)
    if not 0 <= port <= 65535 or port + replicas - 1 > 65535:
        raise ConfigError("port must be 0 (free ports) or 1..65535 for every replica", port=port)
    if workers is not None and workers < 1:
        raise ConfigError("workers must be at least 1", workers=workers)
    if max_sessions is not None and max_sessions < 1:
        raise ConfigError("max_sessions must be at least 1", max_sessions=max_sessions)
    if drain_timeout is not None and drain_timeout < 0:
        raise ConfigError("drain_timeout must be >= 0", drain_timeout=drain_timeout)
    refuse_token_in_argv(serve_args)
    extra = () if drain_timeout is None else ("--drain-timeout", str(drain_timeout))
    exe = _podman(podman)
    if _run([exe, "image", "exists", image], timeout=60, check=False).returncode != 0:
        raise ConfigError(
            f"no image {image} in Podman's storage: build it first "
            "(stadium.deploy.podman.build_image, or podman build -f Containerfile)",
            image=image,
        )
    host_net = network == "host"
    ports = _free_ports(host, replicas) if port == 0 else [port + i for i in range(replicas)]
    ident = secrets.token_hex(4)
    names = [f"{name}-{ident}-{i}" for i in range(replicas)]
    nodes = [f"http://{_url_host(host)}:{p}" for p in ports]
    common = dict(env or {})
    if workers is not None:
        common["WORKERS"] = str(workers)
    if max_sessions is not None:
        common["MAX_CONCURRENT_ENVS"] = str(max_sessions)
    d = PodmanDeployment(
        Deployment(nodes=tuple(nodes), max_sessions_per_node=max_sessions),
        names, podman=exe, ident=ident,
    )  # fmt: skip
    try:
        for cname, p in zip(names, ports, strict=True):
            values = dict(common)
            if host_net:
                values.update(HOST=host, PORT=str(p))
                net = ["--network", "host"]
            else:
                values.update(HOST="0.0.0.0", PORT=str(CONTAINER_PORT))
                net = ["--network", network, "--publish", f"{host}:{p}:{CONTAINER_PORT}"]
            cmd = [
                exe, "run", "--detach", "--name", cname, "--label", f"{LABEL}={ident}", *net,
                *(f"--env={k}" for k in values),  # values from podman's environment
                *run_args, image, target, *serve_args, *extra,
            ]  # fmt: skip
            _run(cmd, timeout=120, what=f"podman run of {cname}", env=values)
        _wait_healthy(d, exe, timeout_s)
    except BaseException:
        d.stop(timeout=0)
        raise
    return d


def _wait_healthy(d: PodmanDeployment, podman: str, timeout: float) -> None:
    pending = dict(zip(d.containers, d.endpoints, strict=True))
    deadline = time.monotonic() + timeout
    while pending:
        for cname, url in list(pending.items()):
            if healthy(url, 2.0):
                del pending[cname]
                continue
            running, code = _running(podman, cname)
            if not running:
                raise ConfigError(
                    f"container {cname} exited (code {code}) before {url}/health answered; "
                    f"its last log lines:\n{_logs(podman, cname, _LOG_LINES)}",
                    container=cname,
                )
        if not pending:
            return
        if time.monotonic() >= deadline:
            cname, url = next(iter(pending.items()))
            raise ConfigError(
                f"container {cname} did not answer {url}/health within {timeout:.0f} s; "
                f"its last log lines:\n{_logs(podman, cname, _LOG_LINES)}",
                container=cname,
            )
        time.sleep(0.25)


__all__ = [
    "CONTAINER_PORT",
    "DEFAULT_IMAGE",
    "LABEL",
    "PodmanDeployment",
    "build_image",
    "containerfile",
    "start",
]
