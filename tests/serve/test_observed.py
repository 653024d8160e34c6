"""The per-worker-set observation serve gives the reconciler (``workerSetStatus``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from extproc.catalog.build import build_catalog
from extproc.catalog.discovered import DiscoveredModel, EndpointModels, apply_discovery
from extproc.catalog.model import Catalog, ObjectProblem
from extproc.catalog.resources import EndpointSlice, InferenceWorkerSet, Service, parse_object
from extproc.kvindex.events import Source
from extproc.serve.observed import observe_worker_sets
from extproc.types import EndpointAddress, ModelName


@dataclass(frozen=True)
class Sub:
    connected: bool


def objects(
    name: str,
    *,
    ips: list[str],
    models: list[dict[str, Any]],
    mode: str = "Static",
    kv: bool = False,
    dp: int = 1,
    created: str = "2026-01-01T00:00:00Z",
) -> list[dict[str, Any]]:
    spec: dict[str, Any] = {
        "serviceRef": {"name": name, "port": "http"},
        "profile": "p",
        "kvBlockSize": 16,
        "models": models,
        "modelDiscovery": {"mode": mode},
    }
    if kv:
        spec["kvEvents"] = {"port": 5557}
    metadata: dict[str, Any] = {"name": name, "namespace": "ns", "creationTimestamp": created}
    if dp > 1:
        metadata["annotations"] = {"kinference.buoyant.io/data-parallel-size": str(dp)}
    return [
        {"apiVersion": "kinference.buoyant.io/v1alpha1", "kind": "InferenceWorkerSet",
         "metadata": metadata, "spec": spec},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": "ns"},
         "spec": {"ports": [{"name": "http", "port": 80}]}},
        {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
         "metadata": {"name": name, "namespace": "ns", "labels": {"kubernetes.io/service-name": name}},
         "addressType": "IPv4", "ports": [{"name": "http", "port": 8000}],
         "endpoints": [{"addresses": [ip], "conditions": {"ready": True}} for ip in ips]
         + [{"addresses": ["10.9.9.9"], "conditions": {"ready": False, "terminating": True}}]},
    ]  # fmt: skip


def catalog(*groups: list[dict[str, Any]], problems: tuple[ObjectProblem, ...] = ()) -> Catalog:
    parsed = [parse_object(o) for group in groups for o in group]
    return build_catalog(
        [p for p in parsed if isinstance(p, InferenceWorkerSet)],
        [p for p in parsed if isinstance(p, Service)],
        [p for p in parsed if isinstance(p, EndpointSlice)],
        problems,
    )


def test_static_set_serves_its_models_on_every_ready_endpoint() -> None:
    """Counts, models and aliases as routed; Static sets need no discovery answer."""
    observed = observe_worker_sets(
        catalog(objects("a", ips=["10.0.0.1", "10.0.0.2"], models=[{"name": "m", "aliases": ["x"]}])), {}
    )
    assert observed == {
        "ns/a": {
            "routed": True,
            "endpoints": {"ready": 2, "terminating": 1},
            "models": [{"upstreamName": "m", "aliases": ["x"], "readyEndpoints": 2}],
            "kvEvents": {"configured": False, "subscribedEndpoints": 0},
            "discovery": {"mode": "Static", "answered": True},
            "profile": {"name": "p", "known": True},
            "problems": [],
            "conflicts": [],
            "rejected": [],
        }
    }


def test_a_set_naming_an_unknown_profile_routes_and_reports_it() -> None:
    observed = observe_worker_sets(
        catalog(objects("a", ips=["10.0.0.1"], models=[{"name": "m"}])), {}, profile_known=lambda n: n != "p"
    )["ns/a"]
    assert observed["routed"] is True
    assert observed["profile"] == {"name": "p", "known": False}
    assert observed["problems"] == [
        'profile "p" is not defined in --profiles; TTFT predictions use the built-in "default"'
    ]


def test_discovered_models_have_per_model_endpoints_and_context_windows() -> None:
    """An adapter on one pod counts one endpoint; windows span the serving pods' max_model_len."""
    declared = catalog(objects("a", ips=["10.0.0.1", "10.0.0.2"], models=[], mode="Endpoint"))
    before = observe_worker_sets(declared, {})["ns/a"]
    assert before["discovery"] == {"mode": "Endpoint", "answered": False}
    assert before["models"] == []
    base = DiscoveredModel(ModelName("llama"), None, 4096)
    wide = DiscoveredModel(ModelName("llama"), None, 8192)
    adapter = DiscoveredModel(ModelName("sql"), ModelName("llama"), None)
    learned = {
        EndpointAddress("10.0.0.1:8000"): EndpointModels((base, adapter)),
        EndpointAddress("10.0.0.2:8000"): EndpointModels((wide,)),
    }
    after = observe_worker_sets(apply_discovery(declared, learned), {})["ns/a"]
    assert after["discovery"] == {"mode": "Endpoint", "answered": True}
    assert after["models"] == [
        {
            "upstreamName": "llama",
            "aliases": [],
            "readyEndpoints": 2,
            "contextWindow": {"min": 4096, "max": 8192},
        },
        {
            "upstreamName": "sql",
            "aliases": [],
            "readyEndpoints": 1,
            "contextWindow": {"min": 4096, "max": 4096},
        },
    ]


def test_an_endpoint_is_subscribed_when_every_rank_is_connected() -> None:
    """With two data-parallel ranks, a pod with one rank disconnected does not count."""
    built = catalog(objects("a", ips=["10.0.0.1", "10.0.0.2"], models=[{"name": "m"}], kv=True, dp=2))
    subs = {
        Source(EndpointAddress("10.0.0.1:8000"), 0): Sub(True),
        Source(EndpointAddress("10.0.0.1:8000"), 1): Sub(True),
        Source(EndpointAddress("10.0.0.2:8000"), 0): Sub(True),
        Source(EndpointAddress("10.0.0.2:8000"), 1): Sub(False),
    }
    assert observe_worker_sets(built, subs)["ns/a"]["kvEvents"] == {
        "configured": True,
        "subscribedEndpoints": 1,
    }


def test_endpoints_publishing_blocks_kv_block_size_does_not_divide_are_counted() -> None:
    """An SGLang pod with its default page size of 1 under a set declared 16: its events are skipped."""
    built = catalog(objects("a", ips=["10.0.0.1", "10.0.0.2"], models=[{"name": "m"}], kv=True, dp=2))
    mismatched = {Source(EndpointAddress("10.0.0.2:8000"), 1): (16, 1)}
    observed = observe_worker_sets(built, {}, block_size_mismatch=mismatched.get)["ns/a"]
    assert observed["kvEvents"]["blockSizeMismatch"] == {"endpoints": 1, "engineBlockSize": 1}
    assert "blockSizeMismatch" not in observe_worker_sets(built, {})["ns/a"]["kvEvents"]


def test_lost_name_conflicts_and_rejections_are_reported_per_set() -> None:
    """The loser of a name lists the conflict; a rejected set appears with its reason."""
    older = objects(
        "old", ips=["10.0.0.1"], models=[{"name": "m1", "aliases": ["chat"]}], created="2025-01-01T00:00:00Z"
    )
    newer = objects("new", ips=["10.0.0.2"], models=[{"name": "m2", "aliases": ["chat"]}])
    rejected = ObjectProblem("InferenceWorkerSet", "ns", "bad", "spec.kvBlockSize: must be at most 4096")
    observed = observe_worker_sets(catalog(older, newer, problems=(rejected,)), {})
    assert observed["ns/old"]["conflicts"] == []
    assert len(observed["ns/new"]["conflicts"]) == 1 and "'chat'" in observed["ns/new"]["conflicts"][0]
    assert observed["ns/bad"] == {
        "routed": False,
        "conflicts": [],
        "rejected": ["spec.kvBlockSize: must be at most 4096"],
    }
