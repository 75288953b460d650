"""Issue 22's smaller items: no word for a token from the environment; resume
parameters validated (400 RESUME_FAILED, never a 500); the SLURM script quotes every value
and refuses newlines; the router refuses node hosts that are not names or addresses."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import pytest
import websockets
from click.testing import CliRunner

from stadium._cli.main import AUTH_TOKEN_ON_COMMAND_LINE, cli
from stadium._core.resume import TOKEN_HEADER, resume_ask
from stadium._errors import ConfigError
from stadium.deploy.deployment import Deployment
from stadium.deploy.haproxy import render
from stadium.deploy.slurm import SlurmOptions, job_script
from tests.conftest import UNIT, serve

# -- --auth-token on the command line ------------------------------------------------


def test_auth_token_from_the_environment_is_taken_without_a_word() -> None:
    # --port 70000 stops serve at its configuration. (On the command line the token is
    # refused: tests/test_token_argv.py.)
    out = CliRunner().invoke(
        cli, ["serve", "echo", "--port", "70000"], env={"STADIUM_AUTH_TOKEN": "s3cret"}
    )
    assert isinstance(out.exception, ConfigError)
    assert AUTH_TOKEN_ON_COMMAND_LINE not in out.stderr


# -- resume parameters -------------------------------------------------------------------

_SID = "1f-0123456789abcdef"


@pytest.mark.parametrize(
    "received", ["\u00b2", "5" * 5000, "-1", "1.0", "\u0661", "1" * 19, "0x10"]
)
def test_a_received_count_that_is_not_a_few_ascii_digits_is_refused(received: str) -> None:
    query = f"stadium_resume={_SID}&stadium_received={received}"
    answer = resume_ask(query, "token")
    assert isinstance(answer, str)
    assert "must be a count of replies" in answer
    assert len(answer) < 200  # a 5,000-digit value is not echoed back whole


def test_good_resume_parameters_still_parse() -> None:
    ask = resume_ask(f"stadium_resume={_SID}&stadium_received=12", "token")
    assert not isinstance(ask, str)
    assert ask is not None
    assert (ask.sid, ask.received) == (_SID, 12)
    assert isinstance(resume_ask(f"stadium_resume={_SID}", "token"), type(ask))


@pytest.mark.parametrize("sid", ["\u00b2-abc", "1f-abc\u00e9", "\u0661-abc"])
def test_a_session_id_that_is_not_ascii_is_refused(sid: str) -> None:
    answer = resume_ask(f"stadium_resume={sid}", "token")
    assert isinstance(answer, str)
    assert "is not a session id" in answer


@pytest.mark.asyncio
@pytest.mark.parametrize("received", ["%C2%B2", "9" * 5000])
async def test_the_server_answers_bad_resume_parameters_400(received: str) -> None:
    async with serve("benchmark") as server:
        url = server.url.replace("http", "ws") + (
            f"/ws?stadium_resume={_SID}&stadium_received={received}"
        )
        with pytest.raises(websockets.InvalidStatus) as info:
            await asyncio.wait_for(
                websockets.connect(url, additional_headers={TOKEN_HEADER: "t"}), 10 * UNIT
            )
        response = info.value.response
        assert response.status_code == 400
        body = json.loads(response.body or b"{}")
        assert body["code"] == "RESUME_FAILED", body
        assert "must be a count of replies" in json.dumps(body)


# -- stadium slurm --------------------------------------------------------------------


def test_the_slurm_script_quotes_the_deployment_directory(tmp_path: Path) -> None:
    evil = tmp_path / "$(touch PWNED)"
    evil.mkdir()
    opts = SlurmOptions("benchmark", router="haproxy", deployment=evil / "d.json")
    script = job_script(opts)
    router = script[script.index("# The router") : script.index("stop()")]
    # Run the router's file handling with stub commands: no command substitution runs.
    stub = (
        f"cd {tmp_path}\nSLURM_JOB_ID=7\nNODES=()\nHOSTS=(h)\n"
        "haproxy() { :; }\nnode_addr() { echo x; }\n"
        f"{opts.python}() {{ :; }}\n"
    )
    body = router.replace(f"{opts.python} -m stadium router", ": router")
    body = body.replace("HAPROXY_PID=$(cat ", "HAPROXY_PID=$(: ")
    subprocess.run(["bash", "-c", stub + body], check=True, timeout=30, capture_output=True)
    assert not (tmp_path / "PWNED").exists()
    assert "'" in router  # the directory is single-quoted


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("job_name", "ok\nrm -rf /tmp/x"),
        ("sbatch_args", ("--time=1:00\necho hi",)),
        ("target", "benchmark\nid"),
        ("serve_args", ("--port", "1\nid")),
        ("python", "/usr/bin/python3\rid"),
    ],
)
def test_slurm_refuses_newlines_in_rendered_values(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match="newline"):
        SlurmOptions(**{"target": "benchmark", field: value})  # type: ignore[arg-type]


def test_slurm_refuses_a_newline_in_the_deployment_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="newline"):
        SlurmOptions("benchmark", deployment=tmp_path / "a\nb" / "d.json")


# -- stadium router -------------------------------------------------------------------


@pytest.mark.parametrize(
    "node",
    ["http://a b:8000", "http://x}:8000", "http://ho_st:8000", "http://a..b:8000", "http://-a:80"],
)
def test_the_router_refuses_node_hosts_that_are_not_names_or_addresses(node: str) -> None:
    with pytest.raises(ConfigError):
        render(Deployment(nodes=(node,)))


def test_the_router_takes_names_and_addresses() -> None:
    nodes = ("http://10.0.0.1:8000", "http://node-2.cluster.local:8000", "https://[::1]:9000")
    text = render(Deployment(nodes=nodes))
    for address in ("10.0.0.1:8000", "node-2.cluster.local:8000", "[::1]:9000"):
        assert f" {address} maxconn" in text
