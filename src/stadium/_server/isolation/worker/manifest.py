"""The limits an env's ``openenv.yaml`` declares, and how they combine with the flags.

OpenEnv 0.10's manifest (``openenv.validation``) declares, under its ``validation:``
block::

    validation:
      resources: {cpu: 1, memory_mb: 512, disk_mb: 128, episode_timeout_s: 600}
      network: {mode: allowlist, allowed_hosts: [api.example.com, 10.0.0.0/8]}

(``network.mode``: ``public`` (OpenEnv's default when the block is there),
``no-network`` or ``allowlist``). The same two sections at the top level of the file
are read too (one place or the other, not both). Every field is optional here.

Precedence, per limit: a flag the operator gave (``--sandbox-memory``...) over the
manifest over the safe defaults (:class:`~stadium._server.isolation.sandbox.Limits`).
Which limits each isolation level enforces is in :func:`unenforced`.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stadium._errors import ConfigError
from stadium._server.isolation.sandbox import Limits

if TYPE_CHECKING:
    from stadium._server.config import ServerConfig as Settings

MANIFEST = "openenv.yaml"
#: ``network.mode`` in the manifest, as Stadium names it (``--sandbox-network``).
NETWORK_MODES = {"no-network": "none", "allowlist": "allowlist", "public": "public"}
FIX = "see OpenEnv's manifest schema (validation.resources, validation.network)"


@dataclasses.dataclass(frozen=True, slots=True)
class Manifest:
    """What an ``openenv.yaml`` declares about limits (``None``: not declared)."""

    path: Path
    cpus: float | None = None
    memory_mib: int | None = None
    disk_mib: int | None = None
    episode_timeout: float | None = None
    network: str | None = None
    """``none``, ``allowlist`` or ``public`` (Stadium's names)."""
    allowed_hosts: tuple[str, ...] = ()

    def declared(self) -> list[str]:
        """The manifest fields declared, as written there (``resources.memory_mb``...)."""
        names = []
        for attr, field in (
            ("cpus", "resources.cpu"),
            ("memory_mib", "resources.memory_mb"),
            ("disk_mib", "resources.disk_mb"),
            ("episode_timeout", "resources.episode_timeout_s"),
            ("network", "network.mode"),
        ):
            if getattr(self, attr) is not None:
                names.append(field)
        return names


def find_manifest(target: str) -> Path | None:
    """The ``openenv.yaml`` of what ``target`` serves, if it has one.

    An env directory: its own. ``module:attr`` or ``file.py:Class``: the one in the
    folder of the module's file or in a folder above it, going up while the folder is
    a package (``__init__.py``) and one more (OpenEnv's layout: ``my_env/openenv.yaml``
    beside ``my_env/server/app.py``). Built-in and ``gymnasium:`` targets have none.
    The module must have been imported already (``load_target``) for a dotted name.
    """
    from stadium.envs import BUILTIN

    if target in BUILTIN or target.startswith("gymnasium:"):
        return None
    if os.path.isdir(target):
        path = Path(target) / MANIFEST
        return path.resolve() if path.is_file() else None
    module, sep, _attr = target.rpartition(":")
    if not sep:
        return None
    if module.endswith(".py") or "/" in module:
        file: str | None = module
    else:
        file = getattr(sys.modules.get(module), "__file__", None)
    if not file:
        return None
    folder = Path(file).expanduser().resolve().parent
    while True:
        if (folder / MANIFEST).is_file():
            return folder / MANIFEST
        if not (folder / "__init__.py").is_file() or folder.parent == folder:
            return None
        folder = folder.parent


def read_manifest(path: Path) -> Manifest:
    """The limits ``path`` declares.

    Raises:
        ConfigError: the file cannot be read, or a value is malformed (the message
            names the field and what to write).
    """
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}", path=str(path)) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a YAML mapping", path=str(path))
    validation = data.get("validation")
    if validation is None:
        validation = {}
    if not isinstance(validation, dict):
        raise ConfigError(f"{path}: validation must be a mapping ({FIX})", path=str(path))
    sections: dict[str, Any] = {}
    for name in ("resources", "network"):
        inner, top = validation.get(name), data.get(name)
        if inner is not None and top is not None:
            raise ConfigError(
                f"{path}: {name} is declared both at the top level and under validation: "
                "keep one (OpenEnv reads validation.{name})".replace("{name}", name),
                path=str(path),
            )
        value = inner if inner is not None else top
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"{path}: {name} must be a mapping ({FIX})", path=str(path))
        sections[name] = value
    res: dict[str, Any] = sections["resources"] or {}
    where = str(path)
    net = sections["network"]
    network: str | None = None
    hosts: tuple[str, ...] = ()
    if net is not None:
        mode = net.get("mode", "public")  # OpenEnv's default when the block is there
        if mode not in NETWORK_MODES:
            raise ConfigError(
                f"{where}: network.mode is {mode!r}; write public, no-network or allowlist",
                path=where, field="network.mode",
            )  # fmt: skip
        network = NETWORK_MODES[mode]
        raw = net.get("allowed_hosts") or []
        if not isinstance(raw, list) or not all(isinstance(h, str) and h for h in raw):
            raise ConfigError(
                f"{where}: network.allowed_hosts must be a list of host names, addresses "
                "or CIDR ranges, e.g. [api.example.com, 10.0.0.0/8]",
                path=where, field="network.allowed_hosts",
            )  # fmt: skip
        hosts = tuple(raw)
        if network != "allowlist" and hosts:
            raise ConfigError(
                f"{where}: network.allowed_hosts is only for mode allowlist (mode is {mode})",
                path=where, field="network.allowed_hosts",
            )  # fmt: skip
        if network == "allowlist":
            for host in hosts:
                check_host(host, f"{where}: network.allowed_hosts")
            if not hosts:
                raise ConfigError(
                    f"{where}: network mode allowlist names no host; list them in "
                    "network.allowed_hosts",
                    path=where, field="network.allowed_hosts",
                )  # fmt: skip
    unknown = set(res) - {"cpu", "memory_mb", "disk_mb", "episode_timeout_s", "gpus", "gpu_types"}
    if unknown:
        raise ConfigError(
            f"{where}: resources has unknown field(s) {', '.join(sorted(unknown))}; the "
            "fields are cpu, memory_mb, disk_mb, episode_timeout_s (gpus, gpu_types)",
            path=where, field="resources",
        )  # fmt: skip
    return Manifest(
        path=path,
        cpus=_number(res, "cpu", where, "a number of cores above 0, e.g. 1 or 0.5"),
        memory_mib=_integer(res, "memory_mb", where, "a whole number of MB, at least 16"),
        disk_mib=_integer(res, "disk_mb", where, "a whole number of MB, at least 1"),
        episode_timeout=_number(
            res, "episode_timeout_s", where, "a number of seconds above 0, e.g. 600"
        ),
        network=network,
        allowed_hosts=hosts,
    )


def check_host(host: str, what: str) -> None:
    """Refuse what an allowlist cannot hold: wildcards, ports, URLs.

    Raises:
        ConfigError: names ``what`` and says what to write.
    """
    bad = "*" in host or "://" in host or " " in host
    if "/" in host or ":" in host:
        try:
            if ipaddress.ip_network(host, strict=False).version == 6:
                raise ConfigError(
                    f"{what}: {host!r} is an IPv6 address; sandboxed sessions reach IPv4 "
                    "only: list IPv4 addresses or host names",
                    host=host,
                )
        except ValueError:
            bad = True  # host:port, a URL
    if bad:
        raise ConfigError(
            f"{what}: {host!r} is not a host name, an address or a CIDR range (wildcards, "
            "ports and URLs cannot be enforced: list each host, e.g. api.example.com)",
            host=host,
        )


def _number(res: dict[str, Any], key: str, where: str, hint: str) -> float | None:
    value = res.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(
            f"{where}: resources.{key} is {value!r}; write {hint}",
            path=where, field=f"resources.{key}",
        )  # fmt: skip
    if value <= 0:
        raise ConfigError(
            f"{where}: resources.{key} must be above 0 (is {value}); write {hint}",
            path=where, field=f"resources.{key}",
        )  # fmt: skip
    return float(value)


def _integer(res: dict[str, Any], key: str, where: str, hint: str) -> int | None:
    value = res.get(key)
    if value is None:
        return None
    low = 16 if key == "memory_mb" else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(
            f"{where}: resources.{key} is {value!r}; write {hint}",
            path=where, field=f"resources.{key}",
        )  # fmt: skip
    return value


#: Which manifest fields each isolation level enforces.
ENFORCED = {
    "none": frozenset(),
    "process": frozenset({"resources.episode_timeout_s"}),
    "sandbox": frozenset(
        {
            "resources.cpu",
            "resources.memory_mb",
            "resources.disk_mb",
            "resources.episode_timeout_s",
            "network.mode",
        }
    ),
    # vm: the guest's RAM, /tmp and vCPUs; no network device at all (a declared network
    # is left unmet, so it is said)
    "vm": frozenset(
        {
            "resources.cpu",
            "resources.memory_mb",
            "resources.disk_mb",
            "resources.episode_timeout_s",
        }
    ),
}


def unenforced(manifest: Manifest, mode: str) -> list[str]:
    """The fields ``manifest`` declares that isolation ``mode`` does not enforce
    (``network: public`` needs nothing enforced)."""
    return [
        field
        for field in manifest.declared()
        if field not in ENFORCED[mode]
        and not (field == "network.mode" and manifest.network == "public")
    ]


def limits_for(settings: Settings, manifest: Manifest | None, call_timeout: float) -> Limits:
    """Each limit from the flag the operator gave, else the manifest, else the default.

    Raises:
        ConfigError: an ``allowlist`` with no host, or a limit out of range.
    """
    given = settings.given
    m = manifest
    default = Limits()

    def pick(flag: str, declared: Any, fallback: Any) -> Any:
        if flag in given:
            return getattr(settings, flag)
        return declared if declared is not None else fallback

    network = settings.sandbox_network
    hosts = tuple(settings.sandbox_allow)
    if network is None:
        if hosts:
            network = "allowlist"
        elif m is not None and m.network is not None:
            network = m.network
        else:
            network = default.network
    if network == "allowlist" and not hosts and m is not None:
        hosts = m.allowed_hosts
    if network == "allowlist" and not hosts:
        raise ConfigError(
            "--sandbox-network allowlist names no host: give --sandbox-allow HOST (one "
            "per host), or list them in openenv.yaml's network.allowed_hosts"
        )
    for host in settings.sandbox_allow:
        check_host(host, "--sandbox-allow")
    if network != "allowlist":
        if settings.sandbox_allow:
            raise ConfigError(
                f"--sandbox-allow is for --sandbox-network allowlist (the network is {network})"
            )
        hosts = ()
    return Limits(
        memory_mib=int(pick("sandbox_memory", m and m.memory_mib, default.memory_mib)),
        cpus=float(pick("sandbox_cpus", m and m.cpus, default.cpus)),
        pids=settings.sandbox_pids,
        disk_mib=int(pick("sandbox_disk", m and m.disk_mib, default.disk_mib)),
        call_timeout=call_timeout,
        episode_timeout=float(pick("episode_timeout", m and m.episode_timeout, 0.0)),
        network=network,
        allowed_hosts=hosts,
    )


def manifest_warning(manifest: Manifest, mode: str) -> str | None:
    """The startup warning for a manifest whose limits ``mode`` leaves unenforced."""
    left = unenforced(manifest, mode)
    if not left:
        return None
    how = (
        "serve with --isolation sandbox to enforce them"
        if mode != "none" or left != ["resources.episode_timeout_s"]
        else "serve with --isolation process or sandbox to enforce it"
    )
    return (
        f"{manifest.path} declares {', '.join(left)}, which --isolation {mode} does not "
        f"enforce: {how}"
    )
