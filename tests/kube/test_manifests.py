"""The CRD, the sample worker set and deploy/ against a real kube-apiserver (v1.20.2), with kubectl."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from .kubeenv import KubeEnv

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
WORKER_SET = DEPLOY / "examples" / "worker-set.yaml"
CRD_NAME = "inferenceworkersets.kinference.buoyant.io"
Manifest = dict[str, Any]


def _valid_worker_set(name: str) -> Manifest:
    return {
        "apiVersion": "kinference.buoyant.io/v1alpha1",
        "kind": "InferenceWorkerSet",
        "metadata": {"name": name},
        "spec": {
            "serviceRef": {"name": "llama", "port": "http"},
            "profile": "default",
            "kvBlockSize": 16,
            "kvEvents": {"port": 5557},
            "modelDiscovery": {"mode": "Endpoint", "interval": "30s"},
        },
    }


def _table(text: str) -> list[dict[str, str]]:
    """kubectl's column output as one dict per row (columns are separated by 2+ spaces)."""
    header, *rows = [re.split(r"\s{2,}", line.strip()) for line in text.strip().splitlines()]
    return [dict(zip(header, row, strict=True)) for row in rows]


def test_crd_is_established(kube_env: KubeEnv) -> None:
    """The shipped CRD is accepted as is: names accepted, established, serving v1alpha1."""
    crd = json.loads(kube_env.kubectl("get", "crd", CRD_NAME, "-o", "json").stdout)
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conditions["Established"] == "True"
    assert conditions["NamesAccepted"] == "True"
    assert crd["status"]["acceptedNames"]["shortNames"] == ["iws"]


def test_crd_folder_applies_as_is(kube_env: KubeEnv) -> None:
    """`kubectl apply -f deploy/crds/` finds only the CRD, identical to the one installed."""
    out = kube_env.kubectl("apply", "--dry-run=server", "-f", str(DEPLOY / "crds")).stdout
    assert (
        out.strip() == f"customresourcedefinition.apiextensions.k8s.io/{CRD_NAME} unchanged (server dry run)"
    )


def test_sample_worker_set_applies_and_is_listed_by_short_name(kube_env: KubeEnv, namespace: str) -> None:
    """The example (Deployment, Service, worker set) applies cleanly and `kubectl get iws` lists it."""
    out = kube_env.kubectl("apply", "-n", namespace, "-f", str(WORKER_SET)).stdout
    assert "inferenceworkerset.kinference.buoyant.io/llama-3-8b created" in out
    assert "service/llama-3-8b created" in out
    names = kube_env.kubectl("get", "iws", "-n", namespace, "-o", "name").stdout.split()
    assert names == ["inferenceworkerset.kinference.buoyant.io/llama-3-8b"]


def test_model_discovery_defaults_are_filled_in(kube_env: KubeEnv, namespace: str) -> None:
    """An empty modelDiscovery becomes mode Endpoint every 30s, as the schema's defaults say."""
    body = _valid_worker_set("defaults")
    body["spec"]["modelDiscovery"] = {}
    kube_env.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(body))
    got = kube_env.kubectl("get", "iws", "defaults", "-n", namespace, "-o", "json").stdout
    assert json.loads(got)["spec"]["modelDiscovery"] == {"mode": "Endpoint", "interval": "30s"}


def _set(path: str, value: object) -> Callable[[Manifest], None]:
    def apply(body: Manifest) -> None:
        *parents, leaf = path.split(".")
        node = body
        for key in parents:
            node = node[key]
        node[leaf] = value

    return apply


def _drop(path: str) -> Callable[[Manifest], None]:
    def apply(body: Manifest) -> None:
        *parents, leaf = path.split(".")
        node = body
        for key in parents:
            node = node[key]
        del node[leaf]

    return apply


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (_set("spec.kvBlockSize", 0), "spec.kvBlockSize"),
        (_set("spec.kvBlockSize", 4097), "spec.kvBlockSize"),
        (_drop("spec.serviceRef"), "spec.serviceRef"),
        (_drop("spec.serviceRef.port"), "spec.serviceRef.port"),
        (_set("spec.modelDiscovery.interval", "30 seconds"), "spec.modelDiscovery.interval"),
        (_set("spec.profile", "p" * 254), "spec.profile"),
        (_set("spec.modelDiscovery.mode", "Sometimes"), "spec.modelDiscovery.mode"),
        (_set("spec.kvEvents", {"replayPort": 5558}), "spec.kvEvents.port"),
        (_set("spec.models", [{"name": f"m{i}"} for i in range(65)]), "spec.models"),
    ],
    ids=[
        "kvBlockSize-0",
        "kvBlockSize-too-big",
        "no-serviceRef",
        "no-serviceRef-port",
        "bad-interval",
        "profile-too-long",
        "mode-not-in-enum",
        "kvEvents-without-port",
        "too-many-models",
    ],
)
def test_invalid_worker_set_is_rejected_naming_the_field(
    kube_env: KubeEnv, namespace: str, mutate: Callable[[Manifest], None], field: str
) -> None:
    """The API server refuses the object with the offending field in the message; nothing is stored.

    ``--validate=false``: kubectl's own schema check (from the server's OpenAPI, published a moment
    after the CRD) may otherwise answer first, in other words; the server is what every client meets.
    """
    body = _valid_worker_set("bad")
    mutate(body)
    proc = kube_env.kubectl(
        "apply", "--validate=false", "-n", namespace, "-f", "-", input=json.dumps(body), check=False
    )
    assert proc.returncode != 0
    assert field in proc.stderr, proc.stderr
    missing = kube_env.kubectl("get", "iws", "bad", "-n", namespace, check=False)
    assert "NotFound" in missing.stderr


def test_kubectl_get_shows_the_status_columns(kube_env: KubeEnv, namespace: str) -> None:
    """After a status write, `kubectl get iws` shows profile, ready, model, KV, state; -o wide adds more."""
    kube_env.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(_valid_worker_set("llama")))
    status = {
        "state": "Ready",
        "endpoints": {"ready": 3, "terminating": 1},
        "models": [
            {"upstreamName": "meta-llama/Meta-Llama-3-8B-Instruct", "aliases": ["chat"], "readyEndpoints": 3},
            {"upstreamName": "sql-lora", "readyEndpoints": 1},
        ],
        "kvEvents": {"configured": True, "subscribedEndpoints": 2},
    }
    kube_env.kubectl(
        "patch", "iws", "llama", "-n", namespace, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": status}),
    )  # fmt: skip
    (row,) = _table(kube_env.kubectl("get", "iws", "-n", namespace).stdout)
    assert list(row) == ["NAME", "PROFILE", "READY", "MODEL", "KV", "STATE", "AGE"]
    assert row["NAME"] == "llama"
    assert row["PROFILE"] == "default"
    assert row["READY"] == "3"
    assert row["MODEL"] == "meta-llama/Meta-Llama-3-8B-Instruct"
    assert row["KV"] == "2"
    assert row["STATE"] == "Ready"
    (wide,) = _table(kube_env.kubectl("get", "iws", "-n", namespace, "-o", "wide").stdout)
    assert (wide["SERVICE"], wide["TERMINATING"]) == ("llama", "1")
    by_category = kube_env.kubectl("get", "kinference", "-n", namespace, "-o", "name").stdout.split()
    assert by_category == ["inferenceworkerset.kinference.buoyant.io/llama"]


# -- deploy/ ---------------------------------------------------------------------------------------


def _for_this_server(doc: Manifest, namespace: str) -> Manifest | None:
    """``doc`` as it can be applied to the 1.20 test server, in ``namespace`` instead of extproc-system.

    Only what v1.20 lacks is changed: PodDisruptionBudget is served as policy/v1beta1 (same fields),
    and gRPC probes (Kubernetes >= 1.24) become the same readiness question over HTTP, serve's
    ``/readyz``. Cluster-scoped RBAC names get the namespace as a suffix so tests do not collide.
    """
    doc = copy.deepcopy(doc)
    kind = doc["kind"]
    if kind == "Namespace":
        return None
    if kind in ("ClusterRole", "ClusterRoleBinding"):
        doc["metadata"]["name"] += f"-{namespace}"
    elif kind != "CustomResourceDefinition":
        doc["metadata"]["namespace"] = namespace
    if kind == "ClusterRoleBinding":
        doc["roleRef"]["name"] += f"-{namespace}"
    for subject in doc.get("subjects", []):
        subject["namespace"] = namespace
    if kind == "PodDisruptionBudget":
        doc["apiVersion"] = "policy/v1beta1"
    if kind == "Deployment":
        for container in doc["spec"]["template"]["spec"]["containers"]:
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                if "grpc" in container.get(probe, {}):
                    del container[probe]["grpc"]
                    container[probe]["httpGet"] = {"path": "/readyz", "port": "admin"}
    return doc


@pytest.fixture(scope="module")
def router_namespace(kube_env: KubeEnv) -> str:
    """deploy/ (built by kustomize, adapted to v1.20) applied into a fresh namespace."""
    namespace = kube_env.new_namespace("router")
    built = kube_env.kubectl("kustomize", str(DEPLOY)).stdout
    docs = [_for_this_server(doc, namespace) for doc in yaml.safe_load_all(built) if doc]
    kube_env.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([d for d in docs if d is not None]))
    return namespace


def test_router_manifests_apply(kube_env: KubeEnv, router_namespace: str) -> None:
    """ServiceAccount, RBAC, Service, Deployment and PDB (and the CRD in the build) are accepted."""
    ns = router_namespace
    namespaced = [
        "serviceaccount/extproc",
        "service/extproc",
        "deployment/extproc",
        "poddisruptionbudget/extproc",
    ]
    namespaced += ["role/extproc-leader-election", "rolebinding/extproc-leader-election"]
    for what in namespaced:
        kube_env.kubectl("get", "-n", ns, what)
    for what in (f"clusterrole/extproc-{ns}", f"clusterrolebinding/extproc-{ns}"):
        kube_env.kubectl("get", what)
    service = json.loads(kube_env.kubectl("get", "-n", ns, "service/extproc", "-o", "json").stdout)
    grpc = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert grpc["appProtocol"] == "kubernetes.io/h2c"


def _allowed(kube_env: KubeEnv, namespace: str, attributes: dict[str, str]) -> bool:
    """The RBAC authorizer's answer for the router's ServiceAccount (a SubjectAccessReview)."""
    review = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": {
            "user": f"system:serviceaccount:{namespace}:extproc",
            "groups": [
                "system:serviceaccounts",
                f"system:serviceaccounts:{namespace}",
                "system:authenticated",
            ],
            "resourceAttributes": attributes,
        },
    }
    out = kube_env.kubectl("create", "-o", "json", "-f", "-", input=json.dumps(review)).stdout
    return bool(json.loads(out)["status"].get("allowed", False))


IWS = {"group": "kinference.buoyant.io", "resource": "inferenceworkersets"}
LEASES = {"group": "coordination.k8s.io", "resource": "leases"}


@pytest.mark.parametrize(
    ("attributes", "allowed"),
    [
        ({**IWS, "verb": "list"}, True),
        ({**IWS, "verb": "watch"}, True),
        ({**IWS, "subresource": "status", "verb": "patch", "namespace": "any"}, True),
        ({"group": "", "resource": "services", "verb": "watch"}, True),
        ({"group": "discovery.k8s.io", "resource": "endpointslices", "verb": "watch"}, True),
        ({"group": "gateway.networking.k8s.io", "resource": "httproutes", "verb": "watch"}, True),
        ({**LEASES, "verb": "create", "namespace": "{ns}"}, True),
        ({**LEASES, "verb": "update", "namespace": "{ns}"}, True),
        ({**IWS, "verb": "update", "namespace": "any"}, False),
        ({**IWS, "verb": "delete", "namespace": "any"}, False),
        ({**LEASES, "verb": "create", "namespace": "default"}, False),
        ({"group": "", "resource": "secrets", "verb": "get", "namespace": "{ns}"}, False),
        ({"group": "", "resource": "pods", "verb": "list"}, False),
        (
            {"group": "discovery.k8s.io", "resource": "endpointslices", "verb": "create", "namespace": "any"},
            False,
        ),
    ],
    ids=lambda v: "-".join(str(x) for x in v.values()) if isinstance(v, dict) else str(v),
)
def test_service_account_may_do_what_the_router_needs_and_no_more(
    kube_env: KubeEnv, router_namespace: str, attributes: dict[str, str], allowed: bool
) -> None:
    """The API server's RBAC authorizer answers for the router's ServiceAccount as the manifests intend."""
    resolved = {k: v.replace("{ns}", router_namespace) for k, v in attributes.items()}
    assert _allowed(kube_env, router_namespace, resolved) is allowed


POOL_CRD = Path(__file__).parent / "vendor" / "inference.networking.k8s.io_inferencepools.yaml"


def test_the_inferencepool_overlay_applies_and_grants_exactly_pods_and_pools_in_its_namespace(
    kube_env: KubeEnv,
) -> None:
    """deploy/inferencepool/ (kustomize) against the real InferencePool CRD: the pool is valid, its
    endpointPickerRef names the picker's Service in its namespace, serve is told the pool, and the
    ServiceAccount may read pods and pools there, and nothing more than the base allows elsewhere."""
    kube_env.kubectl("apply", "--validate=false", "-f", str(POOL_CRD))  # v1.20 lacks CEL rules
    kube_env.wait_crd("inferencepools.inference.networking.k8s.io")
    namespace = kube_env.new_namespace("pool-overlay")
    built = kube_env.kubectl("kustomize", str(DEPLOY / "inferencepool")).stdout
    docs = [_for_this_server(doc, namespace) for doc in yaml.safe_load_all(built) if doc]
    kube_env.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([d for d in docs if d is not None]))
    pool = json.loads(kube_env.kubectl("get", "inferencepool", "-n", namespace, "-o", "json").stdout)[
        "items"
    ][0]
    ref = pool["spec"]["endpointPickerRef"]
    service = json.loads(
        kube_env.kubectl("get", "-n", namespace, f"service/{ref['name']}", "-o", "json").stdout
    )
    assert ref["port"]["number"] in {p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc"}
    assert ref["failureMode"] == "FailClose"
    deployment = json.loads(
        kube_env.kubectl("get", "-n", namespace, "deployment/extproc", "-o", "json").stdout
    )
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--pool-name") + 1] == pool["metadata"]["name"]
    for resource, group in (("pods", ""), ("inferencepools", "inference.networking.k8s.io")):
        for verb in ("get", "list", "watch"):
            attributes = {"group": group, "resource": resource, "verb": verb, "namespace": namespace}
            assert _allowed(kube_env, namespace, attributes), attributes
        assert not _allowed(
            kube_env,
            namespace,
            {"group": group, "resource": resource, "verb": "update", "namespace": namespace},
        )
        assert not _allowed(
            kube_env, namespace, {"group": group, "resource": resource, "verb": "list", "namespace": "other"}
        )
