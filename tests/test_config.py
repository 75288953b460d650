"""ServerConfig is the one home of serve's settings: the CLI's options, their help and their
defaults come from its fields, and its module loads no click."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import pytest

from stadium import ConfigError, ServerConfig
from stadium._cli.main import cli
from stadium._server import config as config_module
from stadium._server.config import FLAG, Flag, field_default, flags, option_name

SERVE = cli.commands["serve"]

#: The options of `stadium serve` that set a field of ServerConfig (all but --auth-token-file).
FIELD_OPTIONS = [
    p for p in SERVE.params if isinstance(p, click.Option) and p.name != "auth_token_file"
]

FIELDS = {f.name: f for f in dataclasses.fields(ServerConfig)}


def _serve_context(monkeypatch: pytest.MonkeyPatch, *args: str) -> click.Context:
    """`stadium serve echo ARGS` parsed (not run), with no option's env var set."""
    for param in SERVE.params:
        if isinstance(param, click.Option) and isinstance(param.envvar, str):
            monkeypatch.delenv(param.envvar, raising=False)
    return SERVE.make_context("serve", ["echo", *args])


def test_every_flagged_field_is_an_option_and_every_option_a_field() -> None:
    assert {p.name for p in FIELD_OPTIONS} == {f.name for f, _ in flags()}
    assert {f.name for f in FIELDS.values() if FLAG not in f.metadata} == {"target", "given"}


@pytest.mark.parametrize("option", FIELD_OPTIONS, ids=lambda p: p.opts[0])
def test_cli_default_is_the_configs(option: click.Option, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not given, an option leaves the config's default; --help shows that default."""
    assert option.name is not None
    field = FIELDS[option.name]
    flag: Flag = field.metadata[FLAG]
    default = field_default(field)
    ctx = _serve_context(monkeypatch)
    parsed = ServerConfig.from_options(target="echo", **{option.name: ctx.params[option.name]})
    assert getattr(parsed, option.name) == default
    assert option.name not in parsed.given
    assert option.opts == [option_name(field)]
    assert option.envvar == (flag.env or None)
    if option.hidden:
        return
    record = option.get_help_record(ctx)
    assert record is not None
    shown = re.fullmatch(r".* \[(?:env (\S+); )?([^\[\]]+)\]\.", record[1], re.DOTALL)
    assert shown, f"{option.opts[0]}'s help does not end with its default in brackets"
    env, said = shown.group(1), " ".join(shown.group(2).split())
    assert env == (flag.env or None)
    value = re.split(r": | \(", said, maxsplit=1)[0]
    if isinstance(default, bool):
        assert value == ("on" if default else "off")
    elif default is None or default in ("", (), {}):
        assert said  # what an unset default means
        assert said == " ".join(flag.means.split())
    elif isinstance(default, int | float):
        assert float(value) == default
    else:
        assert value == default


def test_slurm_gives_each_server_serves_default_sessions() -> None:
    """`stadium slurm` passes --max-sessions to every server: its default is serve's."""
    from stadium.deploy.slurm import SlurmOptions

    (option,) = [p for p in cli.commands["slurm"].params if p.name == "max_sessions_per_node"]
    default = field_default(FIELDS["max_sessions"])
    assert option.default == default
    assert SlurmOptions(target="echo").max_sessions_per_node == default


@pytest.mark.parametrize(
    ("args", "name", "value"),
    [
        (["--port", "9000"], "port", 9000),
        (["--max-message-bytes", "2048"], "max_message_bytes", 2048),
        (["--allow-origin", "https://a.example", "--allow-origin", "*"], "allowed_origins",
         ("https://a.example", "*")),
        (["--preload", "numpy,json", "--untrusted-env-code", "--isolation", "sandbox"], "preload",
         ("numpy", "json")),
        (["--durable"], "durable", True),
        (["--env-kwargs", '{"size": 4}'], "env_kwargs", {"size": 4}),
        (["--sandbox-cpus", "0.5"], "sandbox_cpus", 0.5),
    ],
)  # fmt: skip
def test_options_set_their_fields(
    args: list[str], name: str, value: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctx = _serve_context(monkeypatch, *args)
    parsed = ServerConfig.from_options(**ctx.params)
    assert getattr(parsed, name) == value
    assert name in parsed.given


def test_env_vars_feed_their_options(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = _serve_context(monkeypatch)
    monkeypatch.setenv("PORT", "8123")
    monkeypatch.setenv("STADIUM_ISOLATION", "process")
    ctx = SERVE.make_context("serve", ["echo"])
    parsed = ServerConfig.from_options(**ctx.params)
    assert (parsed.port, parsed.isolation) == (8123, "process")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("log_level", "--log-level must be debug, info, warning or error"),
        ("log_format", "--log-format must be text or json"),
        ("isolation", "--isolation must be none, process, sandbox or vm"),
        ("sandbox_network", "--sandbox-network must be none, allowlist or public"),
        ("sandbox_seccomp", "--sandbox-seccomp must be on or off"),
        ("sandbox_output", "--sandbox-output must be log or drop"),
    ],
)
def test_a_value_outside_the_choices_is_refused(name: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        ServerConfig(target="echo", **{name: "loud"})


def test_the_config_module_loads_no_click() -> None:
    """The config is a plain dataclass: code that builds one (a launcher, a test, the ASGI
    app) does not pay for, or depend on, the command line."""
    probe = (
        "import json, sys\nimport stadium._server.config\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'click')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert json.loads(out.stdout) == []
    assert "click" not in vars(config_module)


ROOT = Path(__file__).resolve().parents[1]
OPTIONS_BY_FLAG = {option_name(f): f for f, _ in flags()}


def _documented_defaults() -> list[tuple[str, str, str, str]]:
    """Each serve option in the docs' option tables (header ``| option | env var | default |``):
    (file:line, option, its env var cell, its default) — a row naming several options
    (``--host``, ``--port``) gives each the default at its place (``127.0.0.1, 8000``)."""
    rows = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        in_table = False
        for number, line in enumerate(path.read_text().splitlines(), 1):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if [c.lower() for c in cells[:3]] == ["option", "env var", "default"]:
                in_table = True
                continue
            if not in_table or not line.startswith("|"):
                in_table = False
                continue
            names = re.findall(r"`(--[a-z][a-z-]*)", cells[0])
            defaults = [d.strip() for d in cells[2].split(",")] if cells[2] else []
            if len(defaults) != len(names):  # one default for all, or none: not per option
                defaults = [cells[2]] * len(names)
            where = f"{path.relative_to(ROOT)}:{number}"
            rows += [(where, n, cells[1], d) for n, d in zip(names, defaults, strict=True)]
    return rows


def test_the_docs_option_tables_state_the_configs_defaults() -> None:
    """A default written in the docs' option tables is the config's: a number (``10 MiB``
    in bytes), ``off``, or a word whose meaning the field's Flag states."""
    rows = _documented_defaults()
    assert rows, "no `| option | env var | default |` table found in README.md or docs/"
    checked = 0
    for where, name, env_cell, said in rows:
        field = OPTIONS_BY_FLAG.get(name)
        if field is None:  # --auth-token-file, or another command's option
            continue
        default, flag = field_default(field), field.metadata[FLAG]
        assert not flag.env or f"`{flag.env}`" in env_cell, f"{where}: {name} reads {flag.env}"
        number = re.match(r"(\d+(?:\.\d+)?)\s*(MiB)?", said)
        if isinstance(default, str) and default:
            assert said.split()[0] == default, f"{where}: {name} is documented as {said}"
        elif number:
            value = float(number.group(1)) * (1 << 20 if number.group(2) else 1)
            assert value == default, f"{where}: {name} is documented as {said}, is {default}"
        elif said.startswith("off"):
            assert not default, f"{where}: {name} is documented as off, is {default}"
        checked += 1
    assert checked >= 20
