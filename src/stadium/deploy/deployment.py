"""The deployment file: where a deployment's nodes and router are.

A JSON object, written by a launcher (``stadium slurm``) and read by clients,
``stadium router`` and ``stadium bench``::

    {
      "nodes": ["http://10.77.0.11:8000", "http://10.77.0.12:8000"],
      "router": "http://10.77.0.11:8080",      # or null
      "job_id": "42",                          # the scheduler's id, or null
      "max_sessions_per_node": 8192            # optional
    }

Node URLs are base URLs (``http://`` or ``https://``, host and port, no path).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from stadium._core.urls import base_url
from stadium._errors import ConfigError

#: Why a launcher refuses ``--auth-token VALUE`` among a server's arguments.
TOKEN_IN_ARGV = (
    "--auth-token VALUE would put the bearer token in the server's command line (and a "
    "generated script), which every local user can read (/proc/PID/cmdline, ps): give it "
    "in the servers' environment (STADIUM_AUTH_TOKEN, e.g. env={...}) or as "
    "--auth-token-file FILE"
)


def refuse_token_in_argv(args: Iterable[str]) -> None:
    """Raise :class:`ConfigError` (:data:`TOKEN_IN_ARGV`) if ``args``, a ``stadium serve``
    command line's options, carry ``--auth-token`` (``--auth-token-file`` is fine)."""
    for arg in args:
        if arg == "--auth-token" or arg.startswith("--auth-token="):
            raise ConfigError(TOKEN_IN_ARGV)


@dataclasses.dataclass(frozen=True, slots=True)
class Deployment:
    """Where a deployment's nodes and router are (see the module docstring)."""

    nodes: tuple[str, ...]
    router: str | None = None
    job_id: str | None = None
    max_sessions_per_node: int | None = None

    def __post_init__(self) -> None:
        if not self.nodes:
            raise ConfigError("a deployment needs at least one node")
        object.__setattr__(self, "nodes", tuple(base_url(n) for n in self.nodes))
        if self.router is not None:
            object.__setattr__(self, "router", base_url(self.router))
        if self.max_sessions_per_node is not None and self.max_sessions_per_node < 1:
            raise ConfigError("max_sessions_per_node must be at least 1")

    @classmethod
    def of(cls, endpoints: Iterable[str]) -> Deployment:
        """A deployment of these node URLs (no router)."""
        return cls(nodes=tuple(endpoints))

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> Deployment:
        """Read a deployment file; :class:`ConfigError` saying what is wrong with it."""
        try:
            data: Any = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read deployment file {path}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"deployment file {path} is not JSON: {exc}") from None
        if not isinstance(data, dict) or not isinstance(data.get("nodes"), list):
            raise ConfigError(
                f'deployment file {path} must be a JSON object with "nodes": [URL, ...]'
            )
        job = data.get("job_id")
        cap = data.get("max_sessions_per_node")
        return cls(
            nodes=tuple(str(n) for n in data["nodes"]),
            router=data.get("router") or None,
            job_id=None if job is None else str(job),
            max_sessions_per_node=None if cap is None else int(cap),
        )

    def write(self, path: str | os.PathLike[str]) -> None:
        """Write the file atomically (readers never see half of it)."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(dataclasses.asdict(self), indent=2) + "\n"
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, target)

    @property
    def url(self) -> str:
        """The one URL to give a client: the router's, else the first node's."""
        return self.router or self.nodes[0]


def endpoints(specs: Sequence[str]) -> Deployment:
    """Endpoints as users give them: URLs, or a deployment file's path (one of them)."""
    nodes: list[str] = []
    router = None
    job = None
    cap = None
    for spec in specs:
        if "://" not in spec and (spec.endswith(".json") or os.path.isfile(spec)):
            d = Deployment.read(spec)
            nodes.extend(d.nodes)
            router, job, cap = d.router, d.job_id, d.max_sessions_per_node
        else:
            nodes.append(spec)
    return Deployment(nodes=tuple(nodes), router=router, job_id=job, max_sessions_per_node=cap)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m stadium.deploy.deployment FILE --job-id ID --router URL NODE...``
    (what the job runs to write its deployment file)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m stadium.deploy.deployment")
    p.add_argument("file")
    p.add_argument("nodes", nargs="+")
    p.add_argument("--job-id", default=None)
    p.add_argument("--router", default="")
    p.add_argument("--max-sessions-per-node", type=int, default=None)
    a = p.parse_args(argv)
    Deployment(
        nodes=tuple(a.nodes),
        router=a.router or None,
        job_id=a.job_id,
        max_sessions_per_node=a.max_sessions_per_node,
    ).write(a.file)
    print(json.dumps({"deployment": a.file}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
