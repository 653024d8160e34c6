"""Which Gateway API HTTPRoutes point at which worker sets (``status.referencedBy``).

A route references a set when any ``spec.rules[].backendRefs[]`` has group
``kinference.buoyant.io``, kind ``InferenceWorkerSet`` and the set's name, in the backendRef's
``namespace`` or, without one, the route's own. Cross-namespace references count even without a
ReferenceGrant: the status says who points here, not whether the gateway honours it. Routes of any
shape are read tolerantly, since the API server may hold objects of a Gateway API version we do
not know.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

WORKER_SET_GROUP = "kinference.buoyant.io"
WORKER_SET_KIND = "InferenceWorkerSet"
#: ``status.referencedBy`` limits of the schema.
MAX_REFERENCES = 64
MAX_REFERENCE_LENGTH = 253


def referenced_sets(route: Mapping[str, Any]) -> set[str]:
    """``namespace/name`` of every worker set one HTTPRoute object names in a backendRef."""
    metadata = _mapping(route.get("metadata"))
    route_namespace = metadata.get("namespace")
    if not isinstance(route_namespace, str) or not route_namespace:
        return set()
    rules = _mapping(route.get("spec")).get("rules")
    found: set[str] = set()
    for rule in rules if isinstance(rules, list) else ():
        refs = _mapping(rule).get("backendRefs")
        for ref in refs if isinstance(refs, list) else ():
            ref = _mapping(ref)
            name, namespace = ref.get("name"), ref.get("namespace", route_namespace)
            if (
                ref.get("group") == WORKER_SET_GROUP
                and ref.get("kind") == WORKER_SET_KIND
                and isinstance(name, str)
                and name
                and isinstance(namespace, str)
                and namespace
            ):
                found.add(f"{namespace}/{name}")
    return found


def references_by_set(routes: Iterable[Mapping[str, Any]]) -> dict[str, list[str]]:
    """Worker set ``namespace/name`` -> the sorted ``namespace/name`` of routes referencing it."""
    by_set: dict[str, set[str]] = {}
    for route in routes:
        metadata = _mapping(route.get("metadata"))
        route_key = f"{metadata.get('namespace')}/{metadata.get('name')}"
        for key in referenced_sets(route):
            by_set.setdefault(key, set()).add(route_key)
    return {key: sorted(names) for key, names in by_set.items()}


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}
