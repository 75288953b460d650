"""``--untrusted-env-code`` without a sandbox: its settings, the limits on the description a
sandboxed process sends (untrusted input), and actions passed through the worker undecoded
and validated by the env's own codec as in-process."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from stadium import ConfigError, ServerConfig
from stadium._env.spec import EnvSpec
from stadium._errors import InvalidMessageError, ValidationError
from stadium._server.isolation import remote
from stadium._server.loader import target_files
from stadium.envs import EchoEnv


def test_the_mode_needs_the_sandbox_and_its_filter() -> None:
    with pytest.raises(ConfigError, match="needs --isolation sandbox"):
        ServerConfig(target="echo", untrusted_env_code=True)
    with pytest.raises(ConfigError, match="needs --isolation sandbox"):
        ServerConfig(target="echo", isolation="process", untrusted_env_code=True)
    with pytest.raises(ConfigError, match="--preload is for --untrusted-env-code"):
        ServerConfig(target="echo", isolation="sandbox", preload=("numpy",))
    with pytest.raises(ConfigError, match="module names"):
        ServerConfig(
            target="echo", isolation="sandbox", untrusted_env_code=True, preload=("os; x",)
        )
    options = ServerConfig.from_options(
        target="echo", isolation="sandbox", untrusted_env_code=True, preload=("numpy,json", "re")
    )
    assert options.preload == ("numpy", "json", "re")


def test_the_worker_finds_a_target_without_importing_it(tmp_path: Any) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise SystemExit('imported')\n")
    (pkg / "env.py").write_text("raise SystemExit('imported')\n")
    folders, file = target_files(f"{pkg / 'env.py'}:Env")
    assert (folders, file) == ([str(tmp_path)], str(pkg / "env.py"))
    assert target_files("echo")[1] is not None  # a built-in: stadium's own file
    assert target_files("gymnasium:CartPole-v1") == ([], None)


def _described(**changes: Any) -> bytes:
    good = msgspec.msgpack.decode(remote.describe(EnvSpec.of(EchoEnv)))
    good.update(changes)
    return msgspec.msgpack.encode(good)


def test_a_description_is_decoded_with_limits() -> None:
    described = remote.decode_description(_described())
    spec = remote.remote_spec(described)
    assert spec.schemas() == EnvSpec.of(EchoEnv).schemas()
    assert (spec.name, spec.version) == ("echo", EchoEnv.version)
    with pytest.raises(ConfigError, match="over the"):
        remote.decode_description(_described(description="x" * remote.MAX_DESCRIPTION_BYTES))
    with pytest.raises(ConfigError, match="invalid"):
        remote.decode_description(_described(name="x" * 1000))  # text past its limit
    with pytest.raises(ConfigError, match="invalid"):
        remote.decode_description(_described(name="echo\x1b[2J"))  # to the operator's terminal
    with pytest.raises(ConfigError, match="invalid"):
        remote.decode_description(_described(surprise=1))  # unknown field
    with pytest.raises(ConfigError, match="invalid"):
        remote.decode_description(_described(tools="yes"))
    deep: Any = {}
    for _ in range(remote.MAX_SCHEMA_DEPTH + 1):
        deep = {"x": deep}
    with pytest.raises(ConfigError, match="past the limits"):
        remote.decode_description(_described(action=deep))
    wide = {"enum": [[]] * (remote.MAX_SCHEMA_NODES + 1)}  # 1 byte each: many objects
    with pytest.raises(ConfigError, match="past the limits"):
        remote.decode_description(_described(state=wide))
    with pytest.raises(ConfigError, match="not bytes"):
        remote.decode_description(["not", "bytes"])


def test_actions_pass_through_and_are_validated_as_in_process() -> None:
    spec = remote.remote_spec(remote.decode_description(_described()))
    decode = remote.action_decoder(EnvSpec.of(EchoEnv))
    wire = spec.msgpack_encoder.encode
    as_json = spec.action.json_decoder.decode(b'{"message": "hi"}')
    assert decode(wire(as_json)).message == "hi"
    as_msgpack = spec.action.msgpack_decoder.decode(msgspec.msgpack.encode({"message": "m"}))
    assert decode(wire(as_msgpack)).message == "m"
    assert decode(wire(spec.action.convert({"message": "v"}, "action"))).message == "v"
    with pytest.raises(ValidationError) as err:
        decode(wire(spec.action.json_decoder.decode(b'{"message": "hi", "extra": 1}')))
    assert err.value.context["field"] == "$.extra"
    with pytest.raises(ValidationError) as err:
        decode(wire(spec.action.convert({"message": 3}, "action")))
    assert err.value.context["field"] == "$.message"
    with pytest.raises(InvalidMessageError):
        decode(wire(spec.action.json_decoder.decode(b"{nope")))
