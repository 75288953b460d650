"""``stadium deploy kubernetes``: manifests validated offline, and what they mean.

No cluster runs here. Every rendered object is validated against a schema:

* core kinds (Service, StatefulSet, Deployment, PodDisruptionBudget) with
  kubernetes-validate in strict mode (Kubernetes' own OpenAPI schemas, unknown
  fields rejected), for the oldest Kubernetes the manifests support and the
  newest the package knows;
* Gateway API kinds (HTTPRoute) against the ``openAPIV3Schema`` of the Gateway API
  CRDs (standard channel, :data:`GATEWAY_API`), fetched once through the Go module
  proxy (``go mod download``) and cached; objects made strict the same way (unknown
  fields rejected). The CRDs' CEL rules (``x-kubernetes-validations``) are not
  evaluated. Without ``go`` or the proxy these checks skip with the reason.

kubernetes-validate passes a kind it has no schema for with a warning and exit code
0; the suite shows that it does, and fails if a rendered kind is checked by neither
validator.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate import utils as kv_utils

from stadium import ConfigError
from stadium._cli.main import main
from stadium.deploy.kubernetes import (
    GRACE_MARGIN_S,
    NODE_PARAM,
    KubernetesOptions,
    Workload,
    gateway_duration,
    manifests,
    render,
)

GATEWAY_API = "v1.6.3"
"""Gateway API release whose CRDs the routes are checked against (needs Go >= 1.26 to
fetch with toolchain checks; v1.7.0 asks for Go 1.27)."""
GATEWAY_GROUP = "gateway.networking.k8s.io"
OLDEST_KUBERNETES = "1.30"
"""The oldest release the manifests are valid for (``preStop.sleep`` is beta, on by default,
from 1.30)."""
K8S_VERSIONS = (OLDEST_KUBERNETES, kv_utils.major_minor(kv_utils.latest_version()))

OPTION_SETS: dict[str, KubernetesOptions] = {
    "defaults": KubernetesOptions("wordguess", gateway="public"),
    "deployment-no-route": KubernetesOptions(
        "wordguess", workload=Workload.DEPLOYMENT, route=False, replicas=3
    ),
    "deployment-route": KubernetesOptions(
        "my_env.server:Env", workload=Workload.DEPLOYMENT, gateway="public", hostnames=("e.x.io",)
    ),
    "large": KubernetesOptions(
        "my_env.server:Env",
        name="envs",
        namespace="rl",
        replicas=20,  # 21 rules: two routes
        image="registry.example.com/team/envs:1.2.3",
        image_pull_policy="Always",
        port=9000,
        cpu="4",
        cpu_limit="6",
        memory="8Gi",
        memory_limit="12Gi",
        max_sessions=4096,
        drain_timeout=120,
        auth_secret="stadium-token",
        auth_secret_key="bearer",
        serve_args=("--step-timeout", "30", "--log-format=json"),
        gateway="shared",
        gateway_namespace="infra",
        hostnames=("envs.example.com", "*.envs.example.com"),
        route_timeout=7200,
    ),
    "small": KubernetesOptions(
        "echo", replicas=1, cpu="500m", memory="256Mi", prestop_delay=0, route=False
    ),
    "fractional": KubernetesOptions(
        "echo", cpu="2.5", workers=3, drain_timeout=0.5, gateway="gw", route_timeout=1.5
    ),
}


def documents(options: KubernetesOptions) -> list[dict[str, Any]]:
    """The objects as a user applies them: the printed YAML, parsed back."""
    return [d for d in yaml.safe_load_all(render(options)) if d is not None]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def pods_of(docs: list[dict[str, Any]]) -> dict[str, Any]:
    [workload] = [d for d in docs if d["kind"] in ("StatefulSet", "Deployment")]
    return workload


def container_of(docs: list[dict[str, Any]]) -> dict[str, Any]:
    [container] = pods_of(docs)["spec"]["template"]["spec"]["containers"]
    return container


def env_of(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container_of(docs)["env"]}


# --- validators -------------------------------------------------------------------------


def core_validated(doc: dict[str, Any], version: str) -> bool:
    """True: kubernetes-validate (strict) checked ``doc``; False: it has no schema for it.
    A violation raises."""
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        return False
    except kubernetes_validate.ValidationError as e:
        path = ".".join(str(p) for p in e.path)
        pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} @ {version}: {path}: {e.message}")
    return True


def _strict(schema: Any) -> Any:
    """A CRD schema that rejects unknown fields, as ``kubectl apply`` (strict field
    validation) does: every object with ``properties`` and nothing else allowed."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def _cache_dir() -> Path:
    root = os.environ.get("STADIUM_TEST_CACHE")
    path = Path(root) if root else Path.home() / ".cache" / "stadium-tests"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _download_crds(cache: Path) -> Path:
    """The standard-channel CRD directory of :data:`GATEWAY_API`, from the Go module proxy."""
    moddir = cache / "gomod"
    crds = moddir / f"sigs.k8s.io/gateway-api@{GATEWAY_API}/config/crd/standard"
    if crds.is_dir():
        return crds
    go = shutil.which("go")
    if go is None:
        pytest.skip(
            "no `go` command: the Gateway API CRDs come from the Go module proxy "
            "(make k8s-deps installs Go when root)"
        )
    env = {**os.environ, "GOMODCACHE": str(moddir), "GOFLAGS": "-modcacherw",
           "GOTOOLCHAIN": "local"}  # fmt: skip
    module = f"sigs.k8s.io/gateway-api@{GATEWAY_API}"
    try:
        proc = subprocess.run(
            [go, "mod", "download", "-json", module],
            cwd=cache, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.skip(f"go mod download {module} took over 300 s (Go module proxy unreachable?)")
    if proc.returncode != 0 or not crds.is_dir():
        why = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        pytest.skip(f"go mod download {module} failed: {' '.join(why)}")
    return crds


@pytest.fixture(scope="session")
def gateway_validators() -> dict[tuple[str, str], jsonschema.protocols.Validator]:
    """``(apiVersion, kind)`` → a validator of the CRD's served version, strict."""
    cache = _cache_dir()
    index = cache / f"gateway-api-{GATEWAY_API}-standard.json"
    if not index.exists():
        schemas: dict[str, Any] = {}
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        for path in sorted(_download_crds(cache).glob("*.yaml")):
            for crd in yaml.load_all(path.read_text(), Loader=loader):
                if not crd or crd.get("kind") != "CustomResourceDefinition":
                    continue
                group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
                for version in crd["spec"]["versions"]:
                    if version.get("served"):
                        key = f"{group}/{version['name']} {kind}"
                        schemas[key] = version["schema"]["openAPIV3Schema"]
        tmp = index.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(schemas))
        tmp.replace(index)  # atomic: a concurrent run never reads half a file
    validators: dict[tuple[str, str], jsonschema.protocols.Validator] = {}
    for key, schema in json.loads(index.read_text()).items():
        api_version, kind = key.split(" ")
        validators[(api_version, kind)] = jsonschema.Draft7Validator(_strict(schema))
    return validators


def crd_errors(
    validators: dict[tuple[str, str], jsonschema.protocols.Validator], doc: dict[str, Any]
) -> list[str] | None:
    """The CRD schema's complaints about ``doc`` ([] = valid); None: no CRD for its kind."""
    validator = validators.get((doc["apiVersion"], doc["kind"]))
    if validator is None:
        return None
    return [
        f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}"
        for e in validator.iter_errors(doc)
    ]


# --- schemas ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("case", OPTION_SETS)
def test_core_kinds_pass_kubernetes_schemas_strict(case: str, version: str) -> None:
    docs = documents(OPTION_SETS[case])
    checked = [d["kind"] for d in docs if core_validated(d, version)]
    unchecked = {d["kind"] for d in docs} - set(checked)
    assert {"Service", "PodDisruptionBudget"} <= set(checked)
    assert {"StatefulSet", "Deployment"} & set(checked)
    # Only Gateway API kinds may lack a core schema.
    assert all(
        d["apiVersion"].startswith(GATEWAY_GROUP + "/") for d in docs if d["kind"] in unchecked
    )


@pytest.mark.parametrize("case", OPTION_SETS)
def test_gateway_kinds_pass_the_gateway_api_crds(
    case: str, gateway_validators: dict[tuple[str, str], Any]
) -> None:
    routes = by_kind(documents(OPTION_SETS[case]), "HTTPRoute")
    if not OPTION_SETS[case].route:
        assert routes == []
        return
    assert routes
    for route in routes:
        assert crd_errors(gateway_validators, route) == [], route["metadata"]["name"]


@pytest.mark.parametrize("case", OPTION_SETS)
def test_every_rendered_kind_is_checked_by_a_validator(
    case: str, gateway_validators: dict[tuple[str, str], Any]
) -> None:
    for doc in documents(OPTION_SETS[case]):
        by_core = core_validated(doc, K8S_VERSIONS[-1])
        by_crd = crd_errors(gateway_validators, doc)
        assert by_core or by_crd is not None, f"{doc['kind']}: no validator checks this kind"
        assert by_crd in (None, [])


def _broken_route() -> dict[str, Any]:
    [route] = by_kind(documents(OPTION_SETS["defaults"]), "HTTPRoute")
    route["spec"]["rules"][0]["timeouts"] = {"request": "5 minutes"}
    route["spec"]["hostnames"] = ["Not_A_Host"]
    route["spec"]["retries"] = 3  # no such field
    return route


@pytest.mark.slow
def test_kubernetes_validate_passes_a_kind_it_has_no_schema_for_silently(tmp_path: Path) -> None:
    route = _broken_route()
    # The library: "no schema" (not "invalid"); its CLI code path: 0, like a pass.
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(route, K8S_VERSIONS[-1], strict=True)
    assert kv_utils.validate_resource(route, "-", K8S_VERSIONS[-1], True, True, True) == 0
    # The command, on a file with the broken route: exit 0 and a warning.
    path = tmp_path / "route.yaml"
    path.write_text(yaml.safe_dump(route))
    proc = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", str(path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Couldn't find schema for kind HTTPRoute" in proc.stdout


def test_the_crd_check_finds_what_kubernetes_validate_let_through(
    gateway_validators: dict[tuple[str, str], Any],
) -> None:
    errors = " | ".join(crd_errors(gateway_validators, _broken_route()) or [])
    assert "spec.rules.0.timeouts.request" in errors
    assert "spec.hostnames.0" in errors
    assert "'retries' was unexpected" in errors


def test_the_crd_check_rejects_what_gateway_api_forbids(
    gateway_validators: dict[tuple[str, str], Any],
) -> None:
    [route, extra] = by_kind(documents(OPTION_SETS["large"]), "HTTPRoute")
    assert len(route["spec"]["rules"]) == 16
    too_many = {**route, "spec": {**route["spec"], "rules": route["spec"]["rules"] + [
        extra["spec"]["rules"][0]]}}  # fmt: skip
    assert any("is too long" in e for e in crd_errors(gateway_validators, too_many) or [])
    bad_param = json.loads(json.dumps(extra))
    bad_param["spec"]["rules"][0]["matches"][0]["queryParams"][0]["type"] = "Prefix"
    assert crd_errors(gateway_validators, bad_param)


def test_strict_core_validation_rejects_unknown_fields() -> None:
    [service, *_] = by_kind(documents(OPTION_SETS["defaults"]), "Service")
    service["spec"]["sessionStickiness"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(service, K8S_VERSIONS[-1], strict=True)


# --- what the manifests say ----------------------------------------------------------------


@pytest.mark.parametrize("case", OPTION_SETS)
def test_termination_grace_covers_prestop_and_drain(case: str) -> None:
    options = OPTION_SETS[case]
    docs = documents(options)
    spec = pods_of(docs)["spec"]["template"]["spec"]
    drain = options.effective_drain_timeout
    grace = spec["terminationGracePeriodSeconds"]
    assert grace >= drain + options.prestop_delay + 5  # the server's final grace after a drain
    assert grace == math.ceil(drain + options.prestop_delay) + GRACE_MARGIN_S
    assert f"grace {grace} s" in render(options)
    args = container_of(docs)["args"]
    if options.drain_timeout is None:
        assert "--drain-timeout" not in args
        assert drain == 30.0  # stadium serve's default
    else:
        assert args[args.index("--drain-timeout") + 1] == f"{options.drain_timeout:g}"
    prestop = container_of(docs).get("lifecycle", {}).get("preStop")
    assert prestop == ({"sleep": {"seconds": math.ceil(options.prestop_delay)}}
                       if options.prestop_delay else None)  # fmt: skip


def test_the_grace_margin_covers_the_servers_final_grace() -> None:
    from stadium._server.server import FINAL_GRACE_S  # sessions still open after the drain get this

    assert GRACE_MARGIN_S >= FINAL_GRACE_S + 2


@pytest.mark.parametrize("case", OPTION_SETS)
def test_probes_read_health_and_readiness_drops_within_two_seconds(case: str) -> None:
    container = container_of(documents(OPTION_SETS[case]))
    [port] = container["ports"]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/health"
        assert get["port"] == port["name"] == "http"
    ready = container["readinessProbe"]
    assert ready["periodSeconds"] * ready["failureThreshold"] <= 2
    live = container["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > ready["periodSeconds"] * 2


@pytest.mark.parametrize(
    ("cpu", "workers", "expected"),
    [("1", None, 1), ("2", None, 2), ("4", None, 4), ("500m", None, 1), ("100m", None, 1),
     ("1500m", None, 2), ("2.4", None, 2), ("2.5", None, 3), ("8", 3, 3)],
)  # fmt: skip
def test_workers_follow_the_cpu_request(cpu: str, workers: int | None, expected: int) -> None:
    docs = documents(KubernetesOptions("echo", cpu=cpu, workers=workers, route=False))
    env = env_of(docs)
    assert env["WORKERS"] == str(expected)
    assert container_of(docs)["resources"]["requests"]["cpu"] == cpu
    if workers is None and cpu.isdigit():
        assert env["WORKERS"] == cpu  # a whole CPU request: one worker per CPU


@pytest.mark.parametrize("case", OPTION_SETS)
def test_env_and_command_serve_the_target(case: str) -> None:
    options = OPTION_SETS[case]
    docs = documents(options)
    container = container_of(docs)
    env = env_of(docs)
    assert container["command"] == ["stadium", "serve"]
    assert container["args"][0] == options.target
    if options.serve_args:
        assert container["args"][-len(options.serve_args) :] == list(options.serve_args)
    assert container["image"] == options.image
    assert env["HOST"] == "0.0.0.0"
    assert env["PORT"] == str(options.port) == str(container["ports"][0]["containerPort"])
    if options.max_sessions is None:
        assert "MAX_CONCURRENT_ENVS" not in env
    else:
        assert env["MAX_CONCURRENT_ENVS"] == str(options.max_sessions)
    if options.auth_secret is None:
        assert "STADIUM_AUTH_TOKEN" not in env
    else:
        ref = {"name": options.auth_secret, "key": options.auth_secret_key}
        assert env["STADIUM_AUTH_TOKEN"] == {"secretKeyRef": ref}
    resources = container["resources"]
    assert resources["requests"] == {"cpu": options.cpu, "memory": options.memory}
    assert resources["limits"] == {"cpu": options.cpu_limit or options.cpu,
                                   "memory": options.memory_limit or options.memory}  # fmt: skip


@pytest.mark.parametrize("case", OPTION_SETS)
def test_services_select_the_pods(case: str) -> None:
    options = OPTION_SETS[case]
    docs = documents(options)
    workload = pods_of(docs)
    pod_labels = workload["spec"]["template"]["metadata"]["labels"]
    selector = workload["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod_labels.items()
    services = {s["metadata"]["name"]: s for s in by_kind(docs, "Service")}
    headless = services[f"{options.name}-headless"]
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is False
    assert headless["spec"]["selector"] == selector
    cluster_ip = services[options.name]
    assert cluster_ip["spec"]["type"] == "ClusterIP"
    assert cluster_ip["spec"]["selector"] == selector
    for service in services.values():
        [port] = service["spec"]["ports"]
        assert (port["port"], port["targetPort"]) == (options.port, "http")
    if workload["kind"] == "StatefulSet":
        assert workload["spec"]["serviceName"] == headless["metadata"]["name"]
        assert workload["spec"]["podManagementPolicy"] == "Parallel"
    else:
        assert workload["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1,
                                                                 "maxUnavailable": 0}  # fmt: skip
    [pdb] = by_kind(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"] == selector
    assert pdb["spec"]["maxUnavailable"] == 1


@pytest.mark.parametrize("case", OPTION_SETS)
def test_routes_send_new_sessions_to_the_service_and_resumed_ones_to_their_pod(case: str) -> None:
    options = OPTION_SETS[case]
    docs = documents(options)
    routes = by_kind(docs, "HTTPRoute")
    services = {s["metadata"]["name"]: s for s in by_kind(docs, "Service")}
    if not options.route:
        assert routes == []
        assert set(services) == {options.name, f"{options.name}-headless"}
        return
    rules = [rule for route in routes for rule in route["spec"]["rules"]]
    per_pod = options.workload is Workload.STATEFULSET
    assert len(routes) == math.ceil((1 + options.replicas * per_pod) / 16)
    nodes: dict[str, str] = {}
    for rule in rules:
        [match] = rule["matches"]
        [backend] = rule["backendRefs"]
        assert match["path"] == {"type": "PathPrefix", "value": "/"}
        assert rule["timeouts"] == {"request": gateway_duration(options.route_timeout)}
        service = services[backend["name"]]
        assert backend["port"] == service["spec"]["ports"][0]["port"]
        assert service["spec"]["ports"][0]["appProtocol"] == "kubernetes.io/ws"
        if "queryParams" not in match:
            assert backend["name"] == options.name  # new sessions: any ready pod
            continue
        [param] = match["queryParams"]
        assert (param["name"], param["type"]) == (NODE_PARAM, "Exact")
        # The node name /health reports is the pod's host name: a StatefulSet pod's name.
        assert service["spec"]["selector"]["statefulset.kubernetes.io/pod-name"] == param["value"]
        nodes[param["value"]] = backend["name"]
    assert sum("queryParams" not in r["matches"][0] for r in rules) == 1
    expected = [f"{options.name}-{i}" for i in range(options.replicas)] if per_pod else []
    assert sorted(nodes) == sorted(expected)
    for route in routes:
        [parent] = route["spec"]["parentRefs"]
        assert parent["name"] == options.gateway
        assert parent.get("namespace") == options.gateway_namespace
        assert route["spec"].get("hostnames", []) == list(options.hostnames)


@pytest.mark.parametrize("case", OPTION_SETS)
def test_pods_run_locked_down(case: str) -> None:
    docs = documents(OPTION_SETS[case])
    spec = pods_of(docs)["spec"]["template"]["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] > 0
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["automountServiceAccountToken"] is False
    assert spec["enableServiceLinks"] is False
    context = container_of(docs)["securityContext"]
    assert context["allowPrivilegeEscalation"] is False
    assert context["readOnlyRootFilesystem"] is True
    assert context["capabilities"] == {"drop": ["ALL"]}
    mounts = {m["mountPath"]: m["name"] for m in container_of(docs)["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]  # multiprocessing's shared memory, temp files


_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


@pytest.mark.parametrize("case", OPTION_SETS)
def test_every_object_carries_the_recommended_labels_and_namespace(case: str) -> None:
    options = OPTION_SETS[case]
    for doc in documents(options):
        meta = doc["metadata"]
        assert meta.get("namespace") == options.namespace
        labels = meta["labels"]
        assert labels["app.kubernetes.io/name"] == "stadium"
        assert labels["app.kubernetes.io/instance"] == options.name
        assert {"app.kubernetes.io/version", "app.kubernetes.io/component",
                "app.kubernetes.io/managed-by"} <= labels.keys()  # fmt: skip
        assert all(len(v) <= 63 and _LABEL_VALUE.match(v) for v in labels.values())


def test_the_yaml_is_the_manifests() -> None:
    for options in OPTION_SETS.values():
        assert documents(options) == manifests(options)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (1.5, "1s500ms"), (30, "30s"), (3600, "1h"), (7200, "2h"), (90061, "25h1m1s")],
)
def test_gateway_durations(seconds: float, text: str) -> None:
    assert gateway_duration(seconds) == text
    assert re.fullmatch(r"([0-9]{1,5}(h|m|s|ms)){1,4}", text)  # GEP-2257's pattern


# --- bad options -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"replicas": 0}, "--replicas must be at least 1"),
        ({"cpu": "abc"}, "--cpu 'abc' is not a CPU quantity"),
        ({"cpu": "0"}, "--cpu must be more than 0"),
        ({"cpu": "-1"}, "is not a CPU quantity"),
        ({"cpu": "2\n"}, "is not a CPU quantity"),
        ({"cpu": "1.5m"}, "is not a CPU quantity"),
        ({"memory": "lots"}, "--memory 'lots' is not a memory quantity"),
        ({"cpu": "2", "cpu_limit": "1"}, "--cpu-limit 1 is below --cpu 2"),
        ({"memory_limit": "512Mi"}, "--memory-limit 512Mi is below --memory 1Gi"),
        ({"name": "My_Env"}, "--name 'My_Env' must be a DNS label"),
        ({"name": "x" * 41}, "at most 40 characters"),
        ({"name": "stadium\n"}, "must be a DNS label"),
        ({"namespace": "Bad NS"}, "--namespace"),
        ({"gateway": None}, "give --gateway NAME"),
        ({"hostnames": ("UPPER.example.com",)}, "--hostname 'UPPER.example.com'"),
        ({"port": 0}, "--port must be 1..65535"),
        ({"workers": 0}, "--workers must be at least 1"),
        ({"max_sessions": 0}, "--max-sessions must be at least 1"),
        ({"drain_timeout": -1.0}, "--drain-timeout must be >= 0"),
        ({"run_as_user": 0}, "non-root"),
        ({"serve_args": ("--port", "9")}, "--serve-arg '--port'"),
        ({"serve_args": ("--drain-timeout=9",)}, "deploy kubernetes' own option"),
        ({"image": "has space"}, "--image"),
    ],
)
def test_bad_options_say_what_to_fix(changes: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"target": "echo", "gateway": "gw", **changes}
    with pytest.raises(ConfigError, match=re.escape(message)):
        KubernetesOptions(**args)


# --- the command ------------------------------------------------------------------------


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, str, str]]:
    def run(*argv: str) -> tuple[int, str, str]:
        code = 0
        try:
            main(["deploy", "kubernetes", *argv])
        except SystemExit as e:
            code = int(e.code or 0)
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_command_prints_the_rendered_manifests(run_cli: Callable[..., Any]) -> None:
    # The command's defaults are the options' defaults.
    code, out, _ = run_cli("wordguess", "--gateway", "public")
    assert code == 0
    assert out == render(OPTION_SETS["defaults"])
    code, out, _ = run_cli(
        "my_env.server:Env", "--workload", "deployment", "--gateway", "public",
        "--hostname", "e.x.io",
    )  # fmt: skip
    assert (code, out) == (0, render(OPTION_SETS["deployment-route"]))


def test_command_writes_a_file(run_cli: Callable[..., Any], tmp_path: Path) -> None:
    path = tmp_path / "stadium.yaml"
    code, out, err = run_cli(
        "my_env.server:Env", "--name", "envs", "--namespace", "rl", "--replicas", "20",
        "--image", "registry.example.com/team/envs:1.2.3", "--image-pull-policy", "Always",
        "--port", "9000", "--cpu", "4", "--cpu-limit", "6", "--memory", "8Gi",
        "--memory-limit", "12Gi", "--max-sessions", "4096", "--drain-timeout", "120",
        "--auth-secret", "stadium-token", "--auth-secret-key", "bearer",
        "--serve-arg", "--step-timeout", "--serve-arg", "30", "--serve-arg=--log-format=json",
        "--gateway", "shared", "--gateway-namespace", "infra",
        "--hostname", "envs.example.com", "--hostname", "*.envs.example.com",
        "--route-timeout", "7200", "-o", str(path),
    )  # fmt: skip
    assert (code, out) == (0, "")
    assert f"wrote {path}" in err
    assert path.read_text() == render(OPTION_SETS["large"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["echo", "--replicas", "0", "--no-route"], "error: --replicas must be at least 1"),
        (["echo", "--cpu", "abc", "--no-route"], "error: --cpu 'abc' is not a CPU quantity"),
        (["echo", "--replicas", "two"], "'two' is not a valid integer"),
        (["echo"], "give --gateway NAME"),
        (["echo", "--workload", "daemonset", "--no-route"], "'daemonset' is not one of"),
    ],
)
def test_command_refuses_bad_options(
    run_cli: Callable[..., Any], argv: list[str], message: str
) -> None:
    code, out, err = run_cli(*argv)
    assert code == 2
    assert out == ""
    assert message in err
