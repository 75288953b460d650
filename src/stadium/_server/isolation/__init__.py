"""Isolated sessions: each session's env in its own process (``--isolation process``), or in
its own sandboxed process (``--isolation sandbox``), forked from a per-worker template.

Two sides and what they share: ``worker/`` is the worker's side (:mod:`.worker.isolation`:
the warm pool, the env processes sessions get; :mod:`.worker.template_host` the template and
the processes' bookkeeping; :mod:`.worker.proc` one env process as the
worker holds it; :mod:`.worker.proxy` the env a session drives; :mod:`.worker.reaper` the
teardown off the event loop; ...), ``template/`` the env's side (:mod:`.template.child`: the
template and the env processes; :mod:`.template.seccomp` the sandboxed sessions' filter;
:mod:`.template.rootfs` a task image's root). Beside them, what both use: :mod:`.wire` the
messages and frames between them, :mod:`.sandbox` the namespaces, mounts, uids and cgroups,
:mod:`.remote` an env known only by its description (``--untrusted-env-code``).
``--isolation vm`` (a microVM per session, the same wire over virtio-serial):
:mod:`.worker.vm`, :mod:`.worker.vmimage`, :mod:`.worker.vmsnap` (the worker's side),
:mod:`.template.vmguest`, :mod:`.template.vmchild` (the guest's).
"""

from stadium._server.isolation.sandbox import Limits, sandbox_unavailable
from stadium._server.isolation.worker.isolation import Isolation
from stadium._server.isolation.worker.proxy import ProcessEnv, isolated_spec
from stadium._server.isolation.worker.template_host import MODES, IsolationConfig

__all__ = [
    "MODES",
    "Isolation",
    "IsolationConfig",
    "Limits",
    "ProcessEnv",
    "isolated_spec",
    "sandbox_unavailable",
]
