"""Which HTTPRoutes reference which worker sets (status.referencedBy)."""

from __future__ import annotations

from typing import Any

import pytest

from extproc.reconcile.references import referenced_sets, references_by_set

from .objects import http_route, set_ref


@pytest.mark.parametrize(
    ("refs", "expected"),
    [
        ([set_ref("llama")], {"apps/llama"}),
        ([set_ref("llama", "models")], {"models/llama"}),
        ([{"name": "llama", "port": 80}], set()),
        ([set_ref("llama", kind="Service")], set()),
        ([set_ref("llama", group="inference.networking.k8s.io")], set()),
        ([set_ref("")], set()),
        ([set_ref("a"), {"kind": "Service", "name": "b"}, set_ref("c", "x")], {"apps/a", "x/c"}),
    ],
    ids=[
        "same-namespace",
        "cross-namespace",
        "plain-service",
        "other-kind",
        "other-group",
        "no-name",
        "mixed",
    ],
)
def test_backend_refs_that_name_a_worker_set(refs: list[dict[str, Any]], expected: set[str]) -> None:
    """Only backendRefs of our group and kind count; the namespace defaults to the route's."""
    assert referenced_sets(http_route("r", "apps", refs)) == expected


def test_any_rule_counts_and_routes_are_sorted_and_unique() -> None:
    """A set named in several rules of one route lists that route once; routes come sorted."""
    routes = [
        http_route("zeta", "apps", [set_ref("llama")], rules=3),
        http_route("alpha", "other", [set_ref("llama", "apps")]),
        {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
         "metadata": {"name": "multi", "namespace": "apps"},
         "spec": {"rules": [{"backendRefs": [{"name": "svc"}]}, {"backendRefs": [set_ref("qwen")]}]}},
    ]  # fmt: skip
    assert references_by_set(routes) == {
        "apps/llama": ["apps/zeta", "other/alpha"],
        "apps/qwen": ["apps/multi"],
    }


@pytest.mark.parametrize(
    "route",
    [
        {"metadata": {"name": "r", "namespace": "apps"}},
        {"metadata": {"name": "r", "namespace": "apps"}, "spec": {"rules": "nope"}},
        {"metadata": {"name": "r", "namespace": "apps"}, "spec": {"rules": [None, {"backendRefs": [7]}]}},
        {"metadata": {"name": "r"}, "spec": {"rules": [{"backendRefs": [set_ref("llama")]}]}},
    ],
    ids=["no-spec", "rules-not-a-list", "junk-entries", "no-namespace"],
)
def test_odd_shapes_reference_nothing(route: dict[str, Any]) -> None:
    """Routes of a shape we do not know are read without failing."""
    assert referenced_sets(route) == set()
