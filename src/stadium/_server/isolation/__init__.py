"""Isolated sessions: each session's env in its own process (``--isolation process``), or in
its own sandboxed process (``--isolation sandbox``), forked from a per-worker template.

:mod:`.host` is the worker's side (the template, the warm pool, the env processes),
:mod:`.proc` one env process as the worker holds it, :mod:`.proxy` the env a session
drives (each call a request to its process), :mod:`.reaper` the teardown off the event
loop, :mod:`.child` the template's and the env processes' side, :mod:`.sandbox` the
namespaces, mounts, uids and cgroups, :mod:`.seccomp` the sandboxed sessions' seccomp
filter, :mod:`.wire` the frames between them. ``--isolation vm`` (a microVM per session, the
same wire over virtio-serial): :mod:`.vm`, :mod:`.vmimage`, :mod:`.vmguest`,
:mod:`.vmchild`, :mod:`.vmsnap`.
"""

from stadium._server.isolation.host import MODES, Isolation, IsolationConfig
from stadium._server.isolation.proxy import ProcessEnv, isolated_spec
from stadium._server.isolation.sandbox import Limits, sandbox_unavailable

__all__ = [
    "MODES",
    "Isolation",
    "IsolationConfig",
    "Limits",
    "ProcessEnv",
    "isolated_spec",
    "sandbox_unavailable",
]
