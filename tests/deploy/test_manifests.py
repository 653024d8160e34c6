"""The deployment manifests, examples and Dockerfile: least privilege, hardened pods, consistent wiring."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from extproc.cli import build_parser

from .manifests import DEPLOY, EXAMPLES, ROOT, Manifest, base, load, of_kind, one

NAMESPACE = "extproc-system"
SERVICE_ACCOUNT = "extproc"

#: Everything the router may do cluster-wide: (API group, resource) -> verbs.
CLUSTER_ACCESS: dict[tuple[str, str], set[str]] = {
    ("kinference.buoyant.io", "inferenceworkersets"): {"get", "list", "watch"},
    ("kinference.buoyant.io", "inferenceworkersets/status"): {"get", "update", "patch"},
    ("", "services"): {"get", "list", "watch"},
    ("discovery.k8s.io", "endpointslices"): {"get", "list", "watch"},
    ("gateway.networking.k8s.io", "httproutes"): {"get", "list", "watch"},
    ("llm-d.ai", "inferenceobjectives"): {"get", "list", "watch"},
    ("inference.networking.x-k8s.io", "inferenceobjectives"): {"get", "list", "watch"},
}
#: ... and only in its own namespace (leader election).
NAMESPACE_ACCESS: dict[tuple[str, str], set[str]] = {
    ("coordination.k8s.io", "leases"): {"get", "create", "update"}
}

ALL_YAML = sorted(DEPLOY.rglob("*.yaml"))


def _grants(role: Manifest) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert not rule.get("nonResourceURLs"), "no non-resource URLs"
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


def _pod(docs: list[Manifest] | None = None) -> dict[str, Any]:
    template: dict[str, Any] = one(docs or base(), "Deployment", "extproc")["spec"]["template"]
    return template


def _containers() -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in _pod()["spec"]["containers"]}


def _port_names(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


@pytest.mark.parametrize("path", ALL_YAML, ids=[str(p.relative_to(DEPLOY)) for p in ALL_YAML])
def test_every_manifest_parses_into_named_objects(path: Path) -> None:
    """Each YAML document is a Kubernetes object kubectl can apply."""
    docs = load(path)
    assert docs, f"{path} is empty"
    for doc in docs:
        if path.name == "kustomization.yaml":
            assert doc["kind"] == "Kustomization"
            continue
        assert doc.get("apiVersion") and doc.get("kind") and doc["metadata"].get("name"), doc


def test_kustomization_lists_every_base_manifest() -> None:
    """Nothing in deploy/ is forgotten by `kubectl apply -k deploy/` (examples are separate)."""
    docs = base()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(
        [
            "CustomResourceDefinition",
            "Namespace",
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "Role",
            "RoleBinding",
            "Service",
            "Service",
            "Deployment",
            "PodDisruptionBudget",
            "NetworkPolicy",
        ]
    )


def test_namespaced_objects_live_in_the_router_namespace() -> None:
    """The router's objects share one namespace, which the kustomization creates."""
    docs = base()
    assert one(docs, "Namespace")["metadata"]["name"] == NAMESPACE
    cluster_scoped = {"Namespace", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding"}
    for doc in docs:
        if doc["kind"] not in cluster_scoped:
            assert doc["metadata"].get("namespace") == NAMESPACE, doc["kind"]


def test_cluster_role_grants_nothing_beyond_the_list() -> None:
    """Cluster-wide: read worker sets, Services, EndpointSlices, HTTPRoutes; write only worker-set status."""
    assert _grants(one(base(), "ClusterRole", "extproc")) == CLUSTER_ACCESS


def test_lease_access_is_limited_to_the_router_namespace() -> None:
    """Leader election uses a Role (namespaced), never a ClusterRole."""
    docs = base()
    roles = of_kind(docs, "Role")
    assert [r["metadata"]["namespace"] for r in roles] == [NAMESPACE]
    assert _grants(roles[0]) == NAMESPACE_ACCESS


@pytest.mark.parametrize("kind", ["ClusterRole", "Role"])
def test_no_wildcards_secrets_or_escalation(kind: str) -> None:
    """No `*`, no Secrets, no pods/exec, no RBAC editing: a stolen token reads routing data at most."""
    for role in of_kind(base(), kind):
        for (group, resource), verbs in _grants(role).items():
            assert "*" not in (group, resource) and "*" not in verbs
            assert resource not in {"secrets", "pods", "pods/exec", "configmaps"}
            assert group != "rbac.authorization.k8s.io"
            assert not verbs & {"escalate", "bind", "impersonate", "delete", "deletecollection"}


def test_bindings_give_the_roles_to_the_pod_service_account() -> None:
    """Both bindings name the ServiceAccount the Deployment runs as."""
    docs = base()
    sa = one(docs, "ServiceAccount")
    assert (sa["metadata"]["name"], sa["metadata"]["namespace"]) == (SERVICE_ACCOUNT, NAMESPACE)
    assert _pod(docs)["spec"]["serviceAccountName"] == SERVICE_ACCOUNT
    for kind, role_kind in (("ClusterRoleBinding", "ClusterRole"), ("RoleBinding", "Role")):
        binding = one(docs, kind)
        assert binding["roleRef"]["kind"] == role_kind
        one(docs, role_kind, binding["roleRef"]["name"])
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": NAMESPACE}
        ]


def test_pod_runs_as_non_root_with_the_runtime_seccomp_profile() -> None:
    """uid 65532, never root, RuntimeDefault seccomp."""
    security = _pod()["spec"]["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["runAsUser"] == 65532
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}


@pytest.mark.parametrize("name", ["serve", "reconcile"])
def test_container_is_hardened_probed_and_sized(name: str) -> None:
    """Read-only root, no capabilities, no escalation, writable /tmp, probes on its ports, resources set."""
    container = _containers()[name]
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    volumes = {v["name"]: v for v in _pod()["spec"]["volumes"]}
    tmp = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
    assert len(tmp) == 1 and "emptyDir" in volumes[tmp[0]["name"]]
    ports = _port_names(container)
    for probe_name in ("readinessProbe", "livenessProbe"):
        probe = container[probe_name]
        target = probe.get("httpGet") or probe.get("grpc")
        assert target, f"{name} {probe_name} has no handler"
        port = target["port"]
        assert port in ports or port in ports.values(), f"{name} {probe_name} probes undeclared port {port}"
    resources = container["resources"]
    assert {"cpu", "memory"} <= set(resources["requests"])
    assert "memory" in resources["limits"]


def test_serve_answers_envoy_and_health_on_9002_and_metrics_on_9090() -> None:
    """serve watches the cluster, listens for Envoy on 9002 and readiness is its gRPC health."""
    serve = _containers()["serve"]
    args = serve["args"]
    assert args[0] == "serve"
    assert args[args.index("--source") + 1] == "kube"
    assert args[args.index("--listen") + 1] == "0.0.0.0:9002"
    assert args[args.index("--admin-listen") + 1] == "0.0.0.0:9090"
    assert serve["readinessProbe"]["grpc"] == {"port": 9002, "service": "readiness"}
    assert serve["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_reconcile_reads_serve_over_loopback_and_knows_its_pod() -> None:
    """The sidecar reads serve's admin port in the same pod and gets its identity from the downward API."""
    reconcile = _containers()["reconcile"]
    args = reconcile["args"]
    assert args[0] == "reconcile"
    assert args[args.index("--serve-admin") + 1] == "http://127.0.0.1:9090"
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in reconcile["env"]}
    assert env == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}


def test_service_reaches_the_pods_grpc_over_h2c_and_metrics() -> None:
    """The Service selects the pods and names container ports; gateways learn h2c from appProtocol."""
    docs = base()
    service = one(docs, "Service", "extproc")
    pod_labels = _pod(docs)["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    containers = _containers()
    assert ports["grpc"]["port"] == 9002 and ports["grpc"]["appProtocol"] == "kubernetes.io/h2c"
    assert ports["grpc"]["targetPort"] in _port_names(containers["serve"])
    assert ports["metrics"]["port"] == 9090
    assert ports["metrics"]["targetPort"] in _port_names(containers["serve"])
    assert ports["reconcile-metrics"]["targetPort"] in _port_names(containers["reconcile"])


def test_two_replicas_spread_and_one_kept_through_disruptions() -> None:
    """Two replicas, spread over nodes, and a policy/v1 PDB that keeps one during drains."""
    docs = base()
    deployment = one(docs, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["replicas"] == 2
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    spread = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert "kubernetes.io/hostname" in {c["topologyKey"] for c in spread}
    for constraint in spread:
        assert constraint["labelSelector"]["matchLabels"].items() <= pod_labels.items()


def _extproc_containers() -> list[tuple[str, list[str]]]:
    deployments = of_kind(base(), "Deployment") + of_kind(load(EXAMPLES / "worker-set.yaml"), "Deployment")
    return [
        (f"{d['metadata']['name']}/{c['name']}", c["args"])
        for d in deployments
        for c in d["spec"]["template"]["spec"]["containers"]
        if c["image"].split(":")[0] == "extproc"
    ]


EXTPROC_CONTAINERS = _extproc_containers()


@pytest.mark.parametrize(("where", "args"), EXTPROC_CONTAINERS, ids=[w for w, _ in EXTPROC_CONTAINERS])
def test_container_args_are_flags_extproc_accepts(where: str, args: list[str]) -> None:
    """Every extproc container's command line parses with the real CLI (a renamed flag fails here)."""
    parsed = build_parser().parse_args(args)
    assert parsed.command == args[0], where


# -- examples --------------------------------------------------------------------------------------


def test_sample_worker_set_names_its_service_and_ports() -> None:
    """The sample set's serviceRef and KV ports resolve against its Service (replay by port name)."""
    docs = load(EXAMPLES / "worker-set.yaml")
    iws = one(docs, "InferenceWorkerSet")
    service = one(docs, "Service", iws["spec"]["serviceRef"]["name"])
    port_names = {p["name"] for p in service["spec"]["ports"]}
    assert iws["spec"]["serviceRef"]["port"] in port_names
    assert iws["spec"]["kvEvents"]["port"] in port_names
    assert "replayPort" not in iws["spec"]["kvEvents"] and "kv-replay" in port_names
    assert "metrics" in port_names
    pods = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pods.items()


def test_envoy_gateway_example_calls_our_service_in_a_mode_we_serve() -> None:
    """The ext_proc backend is our Service port, in a body mode serve supports, with envoy.lb writable."""
    docs = load(EXAMPLES / "envoy-gateway.yaml")
    service = one(base(), "Service", "extproc")
    grpc_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
    (ext_proc,) = one(docs, "EnvoyExtensionPolicy")["spec"]["extProc"]
    assert ext_proc["backendRefs"] == [
        {"name": service["metadata"]["name"], "namespace": NAMESPACE, "port": grpc_port}
    ]
    assert ext_proc["processingMode"]["request"]["body"] in {"FullDuplexStreamed", "Buffered"}
    assert ext_proc["failOpen"] is False
    assert "envoy.lb" in ext_proc["metadata"]["writableNamespaces"]
    grant = one(docs, "ReferenceGrant")
    assert grant["metadata"]["namespace"] == NAMESPACE
    assert grant["spec"]["to"] == [{"group": "", "kind": "Service", "name": service["metadata"]["name"]}]


def test_envoy_gateway_example_routes_to_the_pick_and_retries_the_fallbacks() -> None:
    """HostOverride reads our header and metadata; retries past serve's list go round robin."""
    docs = load(EXAMPLES / "envoy-gateway.yaml")
    policy = one(docs, "BackendTrafficPolicy")["spec"]
    sources = policy["loadBalancer"]["hostOverrideSettings"]["overrideHostSources"]
    assert {"header": "x-gateway-destination-endpoint"} in sources
    assert {"metadata": {"key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint"}]}} in sources
    serve_defaults = build_parser().parse_args(["serve", "--source", "file:unused.yaml"])
    assert serve_defaults.max_fallbacks == 0  # one address: valid for HostOverride and ORIGINAL_DST alike
    assert policy["retry"]["numRetries"] == 2
    assert policy["loadBalancer"]["hostOverrideSettings"]["fallbackPolicy"] == "RoundRobin"


def test_envoy_gateway_route_references_the_worker_set() -> None:
    """The HTTPRoute names the InferenceWorkerSet (for status.referencedBy) and sends it no traffic."""
    docs = load(EXAMPLES / "envoy-gateway.yaml")
    worker_set = one(load(EXAMPLES / "worker-set.yaml"), "InferenceWorkerSet")
    route = one(docs, "HTTPRoute")
    refs = [ref for rule in route["spec"]["rules"] for ref in rule["backendRefs"]]
    by_kind = {ref.get("kind", "Service"): ref for ref in refs}
    iws_ref = by_kind["InferenceWorkerSet"]
    assert (iws_ref["group"], iws_ref["name"]) == ("kinference.buoyant.io", worker_set["metadata"]["name"])
    assert iws_ref["weight"] == 0
    assert by_kind["Service"]["name"] == worker_set["spec"]["serviceRef"]["name"]
    for kind in ("EnvoyExtensionPolicy", "BackendTrafficPolicy"):
        (target,) = one(docs, kind)["spec"]["targetRefs"]
        assert (target["kind"], target["name"]) == ("HTTPRoute", route["metadata"]["name"])


# -- Dockerfile ------------------------------------------------------------------------------------


def test_dockerfile_builds_a_slim_non_root_image_running_extproc() -> None:
    """Multi-stage, python:3.11-slim, uid 65532, `extproc` as the entrypoint."""
    text = (ROOT / "Dockerfile").read_text()
    assert len(re.findall(r"^FROM ", text, re.MULTILINE)) == 2
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in text
    assert re.search(r"^USER 65532(:65532)?$", text, re.MULTILINE)
    assert 'ENTRYPOINT ["extproc"]' in text
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git", "bench/results"} <= set(ignored)
