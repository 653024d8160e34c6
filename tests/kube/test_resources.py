"""Resource types: API versions, names and the REST paths the reflectors list and watch."""

from __future__ import annotations

import pytest

from extproc.kube.resources import ENDPOINT_SLICES, HTTP_ROUTES, LEASES, SERVICES, WORKER_SETS, ResourceType


@pytest.mark.parametrize(
    ("resource", "namespace", "name", "path"),
    [
        (SERVICES, None, None, "/api/v1/services"),
        (SERVICES, "prod", None, "/api/v1/namespaces/prod/services"),
        (SERVICES, "prod", "llama", "/api/v1/namespaces/prod/services/llama"),
        (WORKER_SETS, None, None, "/apis/kinference.buoyant.io/v1alpha1/inferenceworkersets"),
        (
            WORKER_SETS,
            "ml",
            "llama",
            "/apis/kinference.buoyant.io/v1alpha1/namespaces/ml/inferenceworkersets/llama",
        ),
        (ENDPOINT_SLICES, "ml", None, "/apis/discovery.k8s.io/v1/namespaces/ml/endpointslices"),
        (HTTP_ROUTES, None, None, "/apis/gateway.networking.k8s.io/v1/httproutes"),
        (
            LEASES,
            "extproc-system",
            "extproc",
            "/apis/coordination.k8s.io/v1/namespaces/extproc-system/leases/extproc",
        ),
        (SERVICES, "a/b", "c d", "/api/v1/namespaces/a%2Fb/services/c%20d"),
    ],
    ids=[
        "core-all",
        "core-ns",
        "core-object",
        "crd-all",
        "crd-object",
        "slices",
        "routes",
        "lease",
        "quoted",
    ],
)
def test_paths(resource: ResourceType, namespace: str | None, name: str | None, path: str) -> None:
    """The collection for one namespace or all of them, or one object, as the API server serves them."""
    assert resource.path(namespace, name) == path


def test_object_path_needs_a_namespace() -> None:
    """A namespaced object cannot be addressed without its namespace."""
    with pytest.raises(ValueError, match="needs its namespace"):
        SERVICES.path(None, "llama")


@pytest.mark.parametrize(
    ("resource", "api_version", "name"),
    [
        (SERVICES, "v1", "services"),
        (WORKER_SETS, "kinference.buoyant.io/v1alpha1", "inferenceworkersets.kinference.buoyant.io"),
        (ENDPOINT_SLICES, "discovery.k8s.io/v1", "endpointslices.discovery.k8s.io"),
    ],
    ids=["core", "crd", "slices"],
)
def test_api_version_and_name(resource: ResourceType, api_version: str, name: str) -> None:
    """apiVersion is what objects carry; the name is what kubectl and RBAC call the resource."""
    assert (resource.api_version, resource.name) == (api_version, name)


def test_only_gateway_routes_are_optional() -> None:
    """A cluster without the Gateway API CRDs is normal; the other types must exist."""
    assert [r.kind for r in (WORKER_SETS, SERVICES, ENDPOINT_SLICES, HTTP_ROUTES, LEASES) if r.optional] == [
        "HTTPRoute"
    ]
