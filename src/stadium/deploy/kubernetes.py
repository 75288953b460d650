"""Kubernetes manifests for Stadium servers: ``stadium deploy kubernetes TARGET``.

A pure renderer: :class:`KubernetesOptions` (validated) → :func:`manifests`
(a list of plain dicts, one per Kubernetes object) → :func:`render` (YAML, one
document per object). Nothing here talks to a cluster.

What is rendered, for ``name`` (default ``stadium``):

* the pods, in a **StatefulSet** (default) or a **Deployment**: ``stadium serve
  TARGET`` configured by ``HOST``/``PORT``/``WORKERS``/``MAX_CONCURRENT_ENVS``
  (``WORKERS`` = the CPU request rounded, at least 1); readiness on
  ``GET /health`` every second (a draining server answers 503 or stops
  listening: unready within about two seconds), a startup probe and a liveness
  probe on the same path (the kubelet stops liveness probes once a pod is being
  deleted, so a drain is never cut short by them); a ``preStop`` sleep (the
  server closes its listener at once on SIGTERM: the sleep lets endpoint
  removal reach kube-proxy and the gateway first); ``terminationGracePeriodSeconds``
  = preStop + ``--drain-timeout`` + :data:`GRACE_MARGIN_S` (the server's final
  grace after the drain, and a margin); resources; non-root, read-only root
  filesystem (an ``emptyDir`` on ``/tmp``), no privilege escalation, no
  capabilities, the runtime's seccomp profile, no service-account token;
* ``NAME-headless``: a headless Service (``clusterIP: None``, only ready pods)
  whose DNS name lists every ready pod's address. Stadium's clients balance over
  it themselves (``AsyncClient("http://NAME-headless:8000")``) and reconnect to
  the pod that holds a session directly;
* ``NAME``: a ClusterIP Service, one address for clients that take one URL;
* ``NAME``: a PodDisruptionBudget (at most one pod evicted at a time);
* with a gateway (``--gateway``): Gateway API ``HTTPRoute`` objects. New
  sessions go to the ``NAME`` Service; a reconnect that names its node
  (``?stadium_node=NODE``, the name ``/health`` reports: the pod's host name)
  goes back to that pod. Gateway API has no per-pod backend, so with the
  StatefulSet (stable pod names ``NAME-0``, ``NAME-1`` ...) each pod gets a
  Service of its own (``NAME-0`` ..., selecting ``statefulset.kubernetes.io/pod-name``)
  and a rule matching the query parameter exactly (Extended support in the
  standard channel; a rule with a query match takes precedence over the plain
  one). A route holds 16 rules, so the pod rules are split over several routes
  attached to the same parents. ``sessionPersistence`` (GEP-1619) is not used:
  it is experimental-channel only and keys on the gateway's own cookie or
  header, not on Stadium's node name. With a Deployment (random pod names),
  the route carries new sessions only; resumed sessions then need clients that
  reach the pods themselves (the headless Service). Timeouts: the route's
  request timeout is ``0s`` (none) unless given, so long episodes are not cut;
  backend Services say ``appProtocol: kubernetes.io/ws`` (GEP-1911).

Scaling a StatefulSet with routes: render again with the new ``--replicas``
(the per-pod Services and rules follow the count).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from collections.abc import Sequence
from typing import Any

from stadium._errors import ConfigError
from stadium._version import __version__

DEFAULT_IMAGE = "stadium:latest"
NODE_PARAM = "stadium_node"
"""The query parameter a reconnect names its node with (as the HAProxy router reads it)."""
GRACE_MARGIN_S = 10
"""Seconds of termination grace beyond preStop + drain: the server's final grace (5 s)
after the drain, and a margin for process exit."""
RULES_PER_ROUTE = 16
"""Gateway API's limit of rules in one HTTPRoute."""
CONTAINER = "stadium"
WS_APP_PROTOCOL = "kubernetes.io/ws"

_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_HOSTNAME = re.compile(r"^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
_CPU = re.compile(r"^(?:(\d+)m|(\d+(?:\.\d+)?|\.\d+))$")
_MEMORY = re.compile(r"^(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
_MEMORY_UNITS = {
    None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}  # fmt: skip
# Set from the options (env vars or --drain-timeout): not to be given again in serve_args.
_OWNED_SERVE_OPTIONS = ("--host", "--port", "--workers", "--max-sessions", "--drain-timeout",
                        "--auth-token", "--auth-token-file")  # fmt: skip


class Workload(enum.StrEnum):
    """What runs the pods."""

    STATEFULSET = "statefulset"
    """Stable pod names (``NAME-0`` ...): resumed sessions route back through the gateway."""
    DEPLOYMENT = "deployment"
    """Random pod names, surge rollouts: resume only for clients on the headless Service."""


def _server_drain_default() -> float:
    from stadium._server.config import ServerConfig  # the one home of serve's defaults

    default = next(f.default for f in dataclasses.fields(ServerConfig) if f.name == "drain_timeout")
    assert isinstance(default, float)
    return default


def cpu_cores(quantity: str, *, option: str = "--cpu") -> float:
    """A Kubernetes CPU quantity (``2``, ``1.5``, ``500m``) in cores; ConfigError if not one."""
    m = _CPU.fullmatch(quantity)
    if m is None:
        raise ConfigError(
            f"{option} {quantity!r} is not a CPU quantity: give cores (2, 1.5) or millicores (500m)"
        )
    cores = int(m[1]) / 1000 if m[1] is not None else float(m[2])
    if cores <= 0:
        raise ConfigError(f"{option} must be more than 0 CPU", value=quantity)
    return cores


def memory_bytes(quantity: str, *, option: str = "--memory") -> int:
    """A Kubernetes memory quantity (``512Mi``, ``2Gi``, ``1G``) in bytes; ConfigError if not."""
    m = _MEMORY.fullmatch(quantity)
    if m is None:
        raise ConfigError(
            f"{option} {quantity!r} is not a memory quantity: give e.g. 512Mi, 2Gi or 1G"
        )
    size = int(float(m[1]) * _MEMORY_UNITS[m[2]])
    if size <= 0:
        raise ConfigError(f"{option} must be more than 0 bytes", value=quantity)
    return size


def gateway_duration(seconds: float) -> str:
    """Seconds as a Gateway API duration (GEP-2257: ``1h2m3s``, ``500ms``; ``0s``: none)."""
    ms = round(seconds * 1000)
    if ms <= 0:
        return "0s"
    parts = []
    for unit, size in (("h", 3_600_000), ("m", 60_000), ("s", 1000), ("ms", 1)):
        count, ms = divmod(ms, size)
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts)


@dataclasses.dataclass(frozen=True, slots=True)
class KubernetesOptions:
    """What :func:`manifests` is told. Quantities as Kubernetes writes them; seconds.

    ``workers`` defaults to the CPU request rounded (at least 1); ``cpu_limit`` and
    ``memory_limit`` to the requests; ``drain_timeout`` to ``stadium serve``'s.
    ``route`` needs ``gateway`` (the parent Gateway's name); ``route=False`` renders
    no HTTPRoute.
    """

    target: str
    name: str = "stadium"
    namespace: str | None = None
    replicas: int = 2
    image: str = DEFAULT_IMAGE
    image_pull_policy: str = "IfNotPresent"
    port: int = 8000
    cpu: str = "1"
    cpu_limit: str | None = None
    memory: str = "1Gi"
    memory_limit: str | None = None
    workers: int | None = None
    max_sessions: int | None = None
    drain_timeout: float | None = None
    prestop_delay: float = 5.0
    auth_secret: str | None = None
    auth_secret_key: str = "token"
    serve_args: tuple[str, ...] = ()
    workload: Workload = Workload.STATEFULSET
    route: bool = True
    gateway: str | None = None
    gateway_namespace: str | None = None
    hostnames: tuple[str, ...] = ()
    route_timeout: float = 0.0
    run_as_user: int = 10001

    def __post_init__(self) -> None:
        if not self.target.strip():
            raise ConfigError("TARGET is empty: name the environment to serve")
        if len(self.name) > 40 or not _DNS_LABEL.fullmatch(self.name):
            raise ConfigError(
                f"--name {self.name!r} must be a DNS label of at most 40 characters (lower-case "
                "letters, digits and '-', starting with a letter): it names the objects and pods"
            )
        if self.namespace is not None and (
            len(self.namespace) > 63 or not _DNS_LABEL.fullmatch(self.namespace)
        ):
            raise ConfigError(f"--namespace {self.namespace!r} is not a valid namespace name")
        if self.replicas < 1:
            raise ConfigError(f"--replicas must be at least 1 (got {self.replicas})")
        if not self.image or any(c.isspace() for c in self.image):
            raise ConfigError(f"--image {self.image!r} is not an image reference")
        if self.image_pull_policy not in ("Always", "IfNotPresent", "Never"):
            raise ConfigError("--image-pull-policy must be Always, IfNotPresent or Never")
        if not 1 <= self.port <= 65535:
            raise ConfigError(f"--port must be 1..65535 (got {self.port})")
        cpu = cpu_cores(self.cpu)
        if self.cpu_limit is not None and cpu_cores(self.cpu_limit, option="--cpu-limit") < cpu:
            raise ConfigError(f"--cpu-limit {self.cpu_limit} is below --cpu {self.cpu}")
        memory = memory_bytes(self.memory)
        if self.memory_limit is not None and (
            memory_bytes(self.memory_limit, option="--memory-limit") < memory
        ):
            raise ConfigError(f"--memory-limit {self.memory_limit} is below --memory {self.memory}")
        if self.workers is not None and self.workers < 1:
            raise ConfigError(f"--workers must be at least 1 (got {self.workers})")
        if self.max_sessions is not None and self.max_sessions < 1:
            raise ConfigError(f"--max-sessions must be at least 1 (got {self.max_sessions})")
        if self.drain_timeout is not None and self.drain_timeout < 0:
            raise ConfigError("--drain-timeout must be >= 0")
        if self.prestop_delay < 0:
            raise ConfigError("--prestop-delay must be >= 0")
        if self.route_timeout < 0:
            raise ConfigError("--route-timeout must be >= 0 (0: none)")
        if self.run_as_user < 1:
            raise ConfigError("--run-as-user must be a non-root user id (1 or more)")
        if self.auth_secret is not None and not _DNS_SUBDOMAIN.fullmatch(self.auth_secret):
            raise ConfigError(f"--auth-secret {self.auth_secret!r} is not a valid Secret name")
        if not _SECRET_KEY.fullmatch(self.auth_secret_key):
            raise ConfigError(f"--auth-secret-key {self.auth_secret_key!r} is not a valid key")
        for arg in self.serve_args:
            if arg.split("=", 1)[0] in _OWNED_SERVE_OPTIONS:
                raise ConfigError(
                    f"--serve-arg {arg!r}: set this with deploy kubernetes' own option "
                    "(the manifests derive probes, grace period and env vars from it)"
                )
        if self.route and self.gateway is None:
            raise ConfigError(
                "the HTTPRoute needs its parent Gateway: give --gateway NAME (and "
                "--gateway-namespace if it lives elsewhere), or --no-route for no HTTPRoute"
            )
        for ref, what in ((self.gateway, "--gateway"), (self.gateway_namespace,
                                                        "--gateway-namespace")):  # fmt: skip
            if ref is not None and not _DNS_SUBDOMAIN.fullmatch(ref):
                raise ConfigError(f"{what} {ref!r} is not a valid object name")
        for host in self.hostnames:
            if len(host) > 253 or not _HOSTNAME.fullmatch(host):
                raise ConfigError(
                    f"--hostname {host!r} is not a host name (lower-case, e.g. envs.example.com)"
                )

    @property
    def worker_count(self) -> int:
        """``WORKERS``: as given, else the CPU request rounded half up, at least 1."""
        if self.workers is not None:
            return self.workers
        return max(1, math.floor(cpu_cores(self.cpu) + 0.5))

    @property
    def effective_drain_timeout(self) -> float:
        """The server's ``--drain-timeout``: as given, else ``stadium serve``'s default."""
        return _server_drain_default() if self.drain_timeout is None else self.drain_timeout

    @property
    def grace_period(self) -> int:
        """``terminationGracePeriodSeconds``: preStop + drain + :data:`GRACE_MARGIN_S`."""
        return math.ceil(self.prestop_delay + self.effective_drain_timeout) + GRACE_MARGIN_S

    @property
    def per_pod_routes(self) -> bool:
        """Whether resumed sessions route back to their pod through the gateway."""
        return self.route and self.workload is Workload.STATEFULSET

    def pod_names(self) -> list[str]:
        """The StatefulSet's pod names (each pod's host name, the node ``/health`` reports)."""
        return [f"{self.name}-{i}" for i in range(self.replicas)]


def selector_labels(options: KubernetesOptions) -> dict[str, str]:
    """The labels that select this deployment's pods (never changed by an upgrade)."""
    return {"app.kubernetes.io/name": "stadium", "app.kubernetes.io/instance": options.name}


def labels(options: KubernetesOptions) -> dict[str, str]:
    """Kubernetes' recommended labels (``app.kubernetes.io/*``) on every object."""
    return {
        **selector_labels(options),
        "app.kubernetes.io/component": "server",
        "app.kubernetes.io/version": __version__,
        "app.kubernetes.io/managed-by": "stadium",
    }


def _metadata(options: KubernetesOptions, name: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if options.namespace is not None:
        meta["namespace"] = options.namespace
    meta["labels"] = labels(options)
    return meta


def _serve_args(options: KubernetesOptions) -> list[str]:
    args = [options.target]
    if options.drain_timeout is not None:
        args += ["--drain-timeout", f"{options.drain_timeout:g}"]
    return [*args, *options.serve_args]


def _env(options: KubernetesOptions) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "HOST", "value": "0.0.0.0"},
        {"name": "PORT", "value": str(options.port)},
        {"name": "WORKERS", "value": str(options.worker_count)},
    ]
    if options.max_sessions is not None:
        env.append({"name": "MAX_CONCURRENT_ENVS", "value": str(options.max_sessions)})
    if options.auth_secret is not None:
        ref = {"name": options.auth_secret, "key": options.auth_secret_key}
        env.append({"name": "STADIUM_AUTH_TOKEN", "valueFrom": {"secretKeyRef": ref}})
    env += [
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
    ]
    return env


def _probe(period: int, timeout: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": "/health", "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def pod_template(options: KubernetesOptions) -> dict[str, Any]:
    """The pod template both workloads share."""
    requests = {"cpu": options.cpu, "memory": options.memory}
    limits = {
        "cpu": options.cpu_limit or options.cpu,
        "memory": options.memory_limit or options.memory,
    }
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": options.image,
        "imagePullPolicy": options.image_pull_policy,
        # Explicit, so that any image with `stadium` on its PATH serves the same way.
        "command": ["stadium", "serve"],
        "args": _serve_args(options),
        "env": _env(options),
        "ports": [{"name": "http", "containerPort": options.port, "protocol": "TCP"}],
        "resources": {"requests": requests, "limits": limits},
        # Unready within ~2 s of a drain (503, then no listener); one slow answer is forgiven.
        "readinessProbe": {**_probe(period=1, timeout=1, failures=2), "successThreshold": 1},
        # Env imports may be slow: up to 2 minutes to the first answer.
        "startupProbe": _probe(period=1, timeout=2, failures=120),
        "livenessProbe": _probe(period=10, timeout=5, failures=3),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "privileged": False,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    if options.prestop_delay > 0:
        container["lifecycle"] = {
            "preStop": {"sleep": {"seconds": math.ceil(options.prestop_delay)}}
        }
    spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": options.grace_period,
        "automountServiceAccountToken": False,
        # No {SERVICE}_PORT variables: a Service named like the app would set STADIUM_PORT.
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": options.run_as_user,
            "runAsGroup": options.run_as_user,
            "fsGroup": options.run_as_user,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "256Mi"}}],
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": selector_labels(options)},
            }
        ],
    }
    return {"metadata": {"labels": labels(options)}, "spec": spec}


def workload(options: KubernetesOptions) -> dict[str, Any]:
    """The StatefulSet or Deployment that runs the pods."""
    spec: dict[str, Any] = {
        "replicas": options.replicas,
        "selector": {"matchLabels": selector_labels(options)},
    }
    if options.workload is Workload.STATEFULSET:
        kind = "StatefulSet"
        spec |= {
            "serviceName": f"{options.name}-headless",
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "RollingUpdate"},
        }
    else:
        kind = "Deployment"
        # A new pod is ready before an old one starts draining: capacity never dips.
        rolling = {"maxSurge": 1, "maxUnavailable": 0}
        spec["strategy"] = {"type": "RollingUpdate", "rollingUpdate": rolling}
    spec["template"] = pod_template(options)
    return {
        "apiVersion": "apps/v1",
        "kind": kind,
        "metadata": _metadata(options, options.name),
        "spec": spec,
    }


def _service(
    options: KubernetesOptions, name: str, selector: dict[str, str], *, headless: bool
) -> dict[str, Any]:
    port: dict[str, Any] = {"name": "http", "port": options.port, "targetPort": "http",
                            "protocol": "TCP"}  # fmt: skip
    spec: dict[str, Any] = {"selector": selector, "ports": [port]}
    if headless:
        spec |= {"clusterIP": "None", "publishNotReadyAddresses": False}
    else:
        spec["type"] = "ClusterIP"
        port["appProtocol"] = WS_APP_PROTOCOL  # a gateway backend: WebSocket upgrades (GEP-1911)
    return {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(options, name),
            "spec": spec}  # fmt: skip


def services(options: KubernetesOptions) -> list[dict[str, Any]]:
    """The headless Service, the ClusterIP Service and, with per-pod routes, one per pod."""
    sel = selector_labels(options)
    out = [
        _service(options, f"{options.name}-headless", sel, headless=True),
        _service(options, options.name, sel, headless=False),
    ]
    if options.per_pod_routes:
        for pod in options.pod_names():
            pod_sel = {**sel, "statefulset.kubernetes.io/pod-name": pod}
            out.append(_service(options, pod, pod_sel, headless=False))
    return out


def disruption_budget(options: KubernetesOptions) -> dict[str, Any]:
    """At most one pod evicted at a time (node drains, cluster upgrades)."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(options, options.name),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(options)},
            # A pod that is not ready serves nothing: evicting it never costs a session.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def _rule(options: KubernetesOptions, backend: str, node: str | None) -> dict[str, Any]:
    match: dict[str, Any] = {"path": {"type": "PathPrefix", "value": "/"}}
    if node is not None:
        match["queryParams"] = [{"type": "Exact", "name": NODE_PARAM, "value": node}]
    return {
        "matches": [match],
        "backendRefs": [{"name": backend, "port": options.port}],
        "timeouts": {"request": gateway_duration(options.route_timeout)},
    }


def routes(options: KubernetesOptions) -> list[dict[str, Any]]:
    """The HTTPRoutes: new sessions to the ClusterIP Service, ``?stadium_node=POD`` to POD."""
    if not options.route:
        return []
    assert options.gateway is not None
    parent: dict[str, Any] = {"group": "gateway.networking.k8s.io", "kind": "Gateway",
                              "name": options.gateway}  # fmt: skip
    if options.gateway_namespace is not None:
        parent["namespace"] = options.gateway_namespace
    rules = [_rule(options, options.name, None)]
    if options.per_pod_routes:
        rules += [_rule(options, pod, pod) for pod in options.pod_names()]
    out = []
    for i in range(0, len(rules), RULES_PER_ROUTE):
        name = options.name if i == 0 else f"{options.name}-nodes-{i // RULES_PER_ROUTE}"
        spec: dict[str, Any] = {"parentRefs": [parent]}
        if options.hostnames:
            spec["hostnames"] = list(options.hostnames)
        spec["rules"] = rules[i : i + RULES_PER_ROUTE]
        out.append({
            "apiVersion": "gateway.networking.k8s.io/v1",
            "kind": "HTTPRoute",
            "metadata": _metadata(options, name),
            "spec": spec,
        })  # fmt: skip
    return out


def manifests(options: KubernetesOptions) -> list[dict[str, Any]]:
    """Every object, in the order ``kubectl apply`` should create them."""
    return [*services(options), workload(options), disruption_budget(options), *routes(options)]


def render(options: KubernetesOptions, documents: Sequence[dict[str, Any]] | None = None) -> str:
    """The manifests as YAML documents, with a header saying what made them."""
    import yaml  # PyYAML, only when rendering

    docs = manifests(options) if documents is None else documents
    how = "StatefulSet" if options.workload is Workload.STATEFULSET else "Deployment"
    header = (
        f"# Stadium {__version__}: `stadium deploy kubernetes {options.target}`\n"
        f"# {how} {options.name}: {options.replicas} pods, {options.worker_count} workers each, "
        f"drain {options.effective_drain_timeout:g} s, grace {options.grace_period} s.\n"
        f"# Apply: kubectl apply -f FILE. Stadium's clients: http://{options.name}-headless:"
        f"{options.port} (in the cluster).\n"
    )
    body = yaml.safe_dump_all(docs, sort_keys=False, default_flow_style=False, explicit_start=True)
    return header + body


__all__ = [
    "DEFAULT_IMAGE",
    "GRACE_MARGIN_S",
    "NODE_PARAM",
    "KubernetesOptions",
    "Workload",
    "cpu_cores",
    "disruption_budget",
    "gateway_duration",
    "labels",
    "manifests",
    "memory_bytes",
    "pod_template",
    "render",
    "routes",
    "selector_labels",
    "services",
    "workload",
]
