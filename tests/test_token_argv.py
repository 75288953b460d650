"""The bearer token never in a command line (issue 30, item 6): ``stadium serve`` refuses
``--auth-token VALUE`` (every local user can read ``/proc/PID/cmdline``); the launchers
refuse it among a server's arguments and hand the token over in the environment; a token
from ``STADIUM_AUTH_TOKEN`` or ``--auth-token-file`` is served."""

from __future__ import annotations

import os
import stat
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner

from stadium._cli.main import AUTH_TOKEN_ON_COMMAND_LINE, cli
from stadium._errors import ConfigError
from stadium.deploy import local, podman, ray_cluster
from stadium.deploy.deployment import TOKEN_IN_ARGV
from stadium.deploy.slurm import SlurmOptions
from tests.conftest import UNIT

TOKEN = "tok-0123456789abcdef-never-in-argv"


@pytest.mark.parametrize("given", [["--auth-token", TOKEN], [f"--auth-token={TOKEN}"]])
def test_serve_refuses_the_token_on_its_command_line(given: list[str]) -> None:
    # --port 70000: a serve that took the token stops at its configuration (never serves).
    out = CliRunner().invoke(cli, ["serve", "echo", *given, "--port", "70000"])
    assert out.exit_code == 2
    assert f"Error: {AUTH_TOKEN_ON_COMMAND_LINE}" in out.output
    assert TOKEN not in out.output
    assert "STADIUM_AUTH_TOKEN" in AUTH_TOKEN_ON_COMMAND_LINE
    assert "--auth-token-file" in AUTH_TOKEN_ON_COMMAND_LINE


def test_serve_takes_the_token_from_the_environment_or_a_file(tmp_path: Path) -> None:
    # --port 70000 stops serve at its configuration, after the token was taken.
    from_env = CliRunner().invoke(
        cli, ["serve", "echo", "--port", "70000"], env={"STADIUM_AUTH_TOKEN": TOKEN}
    )
    assert isinstance(from_env.exception, ConfigError)
    assert "port" in str(from_env.exception)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    both = CliRunner().invoke(
        cli, ["serve", "echo", "--auth-token-file", str(token_file)],
        env={"STADIUM_AUTH_TOKEN": TOKEN},
    )  # fmt: skip
    assert "give STADIUM_AUTH_TOKEN or --auth-token-file, not both" in str(both.exception)


@pytest.mark.parametrize("arg", ["--auth-token", f"--auth-token={TOKEN}"])
def test_the_launchers_refuse_the_token_among_a_servers_arguments(arg: str) -> None:
    args = [arg, TOKEN] if arg == "--auth-token" else [arg]
    with pytest.raises(ConfigError, match="STADIUM_AUTH_TOKEN") as info:
        local.serve_command("echo", host="127.0.0.1", serve_args=args)
    assert str(info.value).startswith(TOKEN_IN_ARGV)
    with pytest.raises(ConfigError, match="STADIUM_AUTH_TOKEN"):
        SlurmOptions(target="echo", serve_args=tuple(args))
    with pytest.raises(ConfigError, match="STADIUM_AUTH_TOKEN"):  # before Podman is looked for
        podman.start("echo", serve_args=args, podman="/nonexistent/podman")
    with pytest.raises(ConfigError, match="STADIUM_AUTH_TOKEN"):  # before Ray is imported
        ray_cluster.start("echo", serve_args=args)
    # A file's path is no secret.
    cmd = local.serve_command("echo", host="127.0.0.1", serve_args=["--auth-token-file", "/t"])
    assert cmd[-2:] == ["--auth-token-file", "/t"]


def test_podman_gets_the_containers_variables_in_its_environment(tmp_path: Path) -> None:
    """``podman run --env=NAME``: the value comes from podman's environment, not its argv."""
    calls = tmp_path / "calls"
    fake = tmp_path / "podman"
    fake.write_text(
        "#!/bin/sh\n"
        f'printf "%s|%s\\n" "$*" "$STADIUM_AUTH_TOKEN" >> {calls}\n'
        'case "$1" in inspect) echo "false 1";; esac\n'
    )
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    with pytest.raises(ConfigError):  # the fake container never serves
        podman.start(
            "echo", image="img", port=18000, env={"STADIUM_AUTH_TOKEN": TOKEN},
            podman=str(fake), timeout_s=2 * UNIT,
        )  # fmt: skip
    lines = calls.read_text().splitlines()
    (run,) = [line for line in lines if line.startswith("run ")]
    argv, _, token_seen = run.partition("|")
    assert "--env=STADIUM_AUTH_TOKEN" in argv.split()
    assert TOKEN not in argv
    assert token_seen == TOKEN


@pytest.mark.slow
def test_a_local_deployment_serves_the_token_from_its_environment() -> None:
    d = local.start("echo", env={"STADIUM_AUTH_TOKEN": TOKEN}, timeout_s=60 * UNIT)
    try:
        (pid,) = d.pids
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert TOKEN.encode() not in cmdline
        url = d.endpoints[0]
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{url}/metadata", timeout=10 * UNIT)
        assert refused.value.code == 401
        refused.value.close()
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        ask = urllib.request.Request(f"{url}/metadata", headers=bearer)
        with urllib.request.urlopen(ask, timeout=10 * UNIT) as ok:
            assert ok.status == 200
    finally:
        d.stop(timeout=10 * UNIT)
    assert os.environ.get("STADIUM_AUTH_TOKEN") != TOKEN  # given to the servers only
