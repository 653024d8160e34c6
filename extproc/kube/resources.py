"""The Kubernetes resource types this project reads, and where the API serves each of them.

A :class:`ResourceType` is the group/version/plural triple of the REST API plus the ``kind`` its
objects carry, so that list items (which the API sends without ``kind`` and ``apiVersion``) can be
completed into what ``kubectl get -o json`` shows. Paths are built here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote


@dataclass(frozen=True, slots=True)
class ResourceType:
    """One namespaced resource of the Kubernetes REST API."""

    #: API group; "" for the core group (``/api/v1``).
    group: str
    version: str
    #: The lower-case plural of the URL (``inferenceworkersets``).
    plural: str
    #: The ``kind`` of one object (``InferenceWorkerSet``).
    kind: str
    #: True for resources a cluster may not have (Gateway API CRDs): their absence (404) is a state
    #: to report and retry slowly, not an error.
    optional: bool = False
    #: Only objects with these labels (the API's ``labelSelector``, ``k=v,k2=v2``); None: all.
    label_selector: str | None = None

    @property
    def api_version(self) -> str:
        """``apiVersion`` of the objects: ``v1`` for the core group, else ``group/version``."""
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def name(self) -> str:
        """``plural.group`` as kubectl and RBAC name it (just ``plural`` for the core group)."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    def path(self, namespace: str | None = None, name: str | None = None) -> str:
        """The collection path for one namespace (``None``: all namespaces), or one object's path."""
        root = f"/apis/{self.api_version}" if self.group else f"/api/{self.version}"
        if namespace is None:
            if name is not None:
                raise ValueError(f"{self.kind} {name!r}: a namespaced object needs its namespace")
            return f"{root}/{self.plural}"
        collection = f"{root}/namespaces/{quote(namespace, safe='')}/{self.plural}"
        return collection if name is None else f"{collection}/{quote(name, safe='')}"


WORKER_SETS = ResourceType("kinference.buoyant.io", "v1alpha1", "inferenceworkersets", "InferenceWorkerSet")
SERVICES = ResourceType("", "v1", "services", "Service")
ENDPOINT_SLICES = ResourceType("discovery.k8s.io", "v1", "endpointslices", "EndpointSlice")
#: Optional: clusters without the llm-d router's CRDs have none (the group since 2026-06)...
INFERENCE_OBJECTIVES = ResourceType(
    "llm-d.ai", "v1alpha2", "inferenceobjectives", "InferenceObjective", optional=True
)
#: ... or the Gateway API Inference Extension's, where they came from.
LEGACY_INFERENCE_OBJECTIVES = ResourceType(
    "inference.networking.x-k8s.io", "v1alpha2", "inferenceobjectives", "InferenceObjective", optional=True
)
HTTP_ROUTES = ResourceType("gateway.networking.k8s.io", "v1", "httproutes", "HTTPRoute", optional=True)
PODS = ResourceType("", "v1", "pods", "Pod")
#: The Gateway API Inference Extension's pool (GA); optional: clusters without its CRD have none.
INFERENCE_POOLS = ResourceType(
    "inference.networking.k8s.io", "v1", "inferencepools", "InferencePool", optional=True
)
LEASES = ResourceType("coordination.k8s.io", "v1", "leases", "Lease")
