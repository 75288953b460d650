"""The ``stadium`` command line: serve, check, init, demo, bench.

Errors print one line (``error: ...``) and exit non-zero: 2 for a bad argument
or configuration, 1 for anything else.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import click

from stadium._errors import StadiumError
from stadium._version import __version__

# Subcommands defined in other modules, imported only when used (keeps `stadium --help` fast).
_LAZY = {
    "bench": "stadium.bench._cli:bench",
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


def _serve_options(fn: Any) -> Any:
    from stadium._config import serve_click_options

    return serve_click_options(fn)


@cli.command()
@click.argument("target")
@_serve_options
def serve(target: str, **options: Any) -> None:
    """Serve TARGET: a built-in name (echo, benchmark, wordguess),
    package.module:Class or path/to/file.py:Class (a Stadium, OpenEnv or
    Gymnasium environment class), or gymnasium:ENV_ID (e.g. gymnasium:CartPole-v1;
    --env-kwargs go to gymnasium.make).

    Environment variables HOST, PORT, WORKERS and MAX_CONCURRENT_ENVS (OpenEnv's)
    are read when the matching option is not given.
    """
    from stadium._config import ServerConfig
    from stadium._server import run_server

    config = ServerConfig.from_options(target=target, **options)
    sys.exit(run_server(config))


@cli.command()
@click.argument("target")
@click.option("--steps", default=5, show_default=True, help="Steps per episode to try.")
@click.option("--seed", default=0, show_default=True, help="Seed for the determinism check.")
def check(target: str, steps: int, seed: int) -> None:
    """Check that TARGET honours the environment contract (an env class or a ws:// URL)."""
    from stadium._check import check_target

    report = check_target(target, steps=steps, seed=seed)
    for line in report:
        click.echo(f"ok  {line}")
    click.echo(f"{target}: all {len(report)} checks passed")


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
    from stadium._scaffold import create_project, module_name

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
    from stadium._demo import run_demo

    sys.exit(run_demo(sessions=sessions, steps=steps, wait=wait, bench=bench))


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
    except StadiumError as exc:
        click.echo(f"error: {exc.message}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
