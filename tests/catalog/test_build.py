"""Joining worker sets, Services and EndpointSlices into routes."""

from __future__ import annotations

import random
from typing import Any

import pytest

from extproc.catalog.build import build_catalog
from extproc.catalog.model import Catalog, NameConflict, ObjectProblem
from extproc.catalog.resources import (
    EndpointSlice,
    InferenceObjective,
    InferenceWorkerSet,
    Service,
    parse_object,
)
from extproc.types import ModelName, WorkerSetKey


def iws(
    name: str,
    *,
    models: list[dict[str, Any]] | None = None,
    port: int | str = "http",
    service: str | None = None,
    namespace: str = "default",
    created: str | None = None,
) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "namespace": namespace}
    if created is not None:
        metadata["creationTimestamp"] = created
    spec: dict[str, Any] = {
        "serviceRef": {"name": service or name, "port": port},
        "profile": "p",
        "kvBlockSize": 16,
    }
    spec["models"] = [{"name": name}] if models is None else models
    return {
        "apiVersion": "kinference.buoyant.io/v1alpha1",
        "kind": "InferenceWorkerSet",
        "metadata": metadata,
        "spec": spec,
    }


def svc(name: str, ports: list[dict[str, Any]] | None = None, namespace: str = "default") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"ports": [{"name": "http", "port": 80}] if ports is None else ports},
    }


def eps(
    name: str,
    service: str,
    endpoints: list[Any],
    *,
    ports: list[dict[str, Any]] | None = None,
    address_type: str = "IPv4",
    namespace: str = "default",
) -> dict[str, Any]:
    """A slice; an endpoint given as a string is a ready pod at that address."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": namespace, "labels": {"kubernetes.io/service-name": service}},
        "addressType": address_type,
        "ports": [{"name": "http", "port": 8000}] if ports is None else ports,
        "endpoints": [
            {"addresses": [e], "conditions": {"ready": True}} if isinstance(e, str) else e for e in endpoints
        ],
    }


def build(*objects: dict[str, Any], problems: tuple[ObjectProblem, ...] = ()) -> Catalog:
    parsed = [parse_object(o) for o in objects]
    return build_catalog(
        [p for p in parsed if isinstance(p, InferenceWorkerSet)],
        [p for p in parsed if isinstance(p, Service)],
        [p for p in parsed if isinstance(p, EndpointSlice)],
        problems,
        [p for p in parsed if isinstance(p, InferenceObjective)],
    )


def addresses(catalog: Catalog, client_name: str) -> list[str]:
    route = catalog.resolve(client_name)
    assert route is not None
    return [e.address for e in route.endpoints]


LLAMA = WorkerSetKey("default/llama")


@pytest.mark.parametrize(
    ("ref", "service_ports", "slice_ports", "expected"),
    [
        (80, [{"name": "http", "port": 80}], [{"name": "http", "port": 8000}], ["127.0.0.1:8000"]),
        ("http", [{"name": "http", "port": 80}], [{"name": "http", "port": 8000}], ["127.0.0.1:8000"]),
        (8000, [{"port": 8000}], [{"name": "", "port": 8000}], ["127.0.0.1:8000"]),
        (8000, [{"port": 8000}], [{"port": 8000}], ["127.0.0.1:8000"]),
        (
            "metrics",
            [{"name": "http", "port": 80}, {"name": "metrics", "port": 9400}],
            [{"name": "http", "port": 8000}, {"name": "metrics", "port": 9100}],
            ["127.0.0.1:9100"],
        ),
        (
            9400,
            [{"name": "http", "port": 80}, {"name": "metrics", "port": 9400}],
            [{"name": "metrics", "port": 9100}, {"name": "http", "port": 8000}],
            ["127.0.0.1:9100"],
        ),
    ],
    ids=[
        "number-named",
        "name",
        "number-unnamed",
        "unnamed-slice-port-absent",
        "name-of-two",
        "number-of-two",
    ],
)
def test_service_port_selects_the_pods_port(
    ref: int | str, service_ports: list[Any], slice_ports: list[Any], expected: list[str]
) -> None:
    """serviceRef.port (number or name) picks the Service port whose pods' port Envoy gets."""
    catalog = build(
        iws("llama", port=ref),
        svc("llama", service_ports),
        eps("llama-a", "llama", ["127.0.0.1"], ports=slice_ports),
    )
    assert [e.address for e in catalog.worker_sets[LLAMA].endpoints] == expected
    assert catalog.worker_sets[LLAMA].problems == ()
    assert addresses(catalog, "llama") == expected


@pytest.mark.parametrize(
    ("ref", "service", "problem"),
    [
        (8000, svc("llama"), "serviceRef.port 8000 is not a port of Service default/llama (ports: http=80)"),
        (
            "grpc",
            svc("llama", [{"name": "http", "port": 80}, {"port": 9400, "name": "metrics"}]),
            'serviceRef.port "grpc" is not a port of Service default/llama (ports: http=80, metrics=9400)',
        ),
        (
            80,
            svc("llama", [{"port": 8000}]),
            "serviceRef.port 80 is not a port of Service default/llama (ports: 8000)",
        ),
        (80, svc("llama", []), "serviceRef.port 80 is not a port of Service default/llama (ports: none)"),
        (80, svc("other"), "Service default/llama not found; the set has no endpoints"),
        (80, svc("llama", namespace="prod"), "Service default/llama not found; the set has no endpoints"),
    ],
    ids=["wrong-number", "wrong-name", "unnamed", "no-ports", "missing", "other-namespace"],
)
def test_broken_service_reference_leaves_set_without_endpoints(
    ref: int | str, service: Any, problem: str
) -> None:
    """A wrong port or a missing Service is reported on the set, and its route answers 503 not 404."""
    catalog = build(iws("llama", port=ref), service, eps("llama-a", "llama", ["127.0.0.1"]))
    ws = catalog.worker_sets[LLAMA]
    assert ws.endpoints == ()
    assert ws.problems == (problem,)
    assert addresses(catalog, "llama") == []


@pytest.mark.parametrize(
    ("conditions", "ready", "terminating"),
    [
        (None, 1, 0),
        ({}, 1, 0),
        ({"ready": True}, 1, 0),
        ({"ready": False}, 0, 0),
        ({"terminating": False}, 1, 0),
        ({"ready": False, "serving": True, "terminating": True}, 0, 1),
        ({"ready": True, "terminating": True}, 0, 1),
        ({"terminating": True}, 0, 1),
    ],
    ids=[
        "no-conditions",
        "empty",
        "ready",
        "not-ready",
        "not-terminating",
        "draining",
        "ready-but-terminating",
        "terminating-only",
    ],
)
def test_endpoint_conditions(conditions: dict[str, Any] | None, ready: int, terminating: int) -> None:
    """Unknown readiness routes (Kubernetes: nil means unknown); terminating never does but is counted."""
    endpoint: dict[str, Any] = {"addresses": ["127.0.0.1"]}
    if conditions is not None:
        endpoint["conditions"] = conditions
    ws = build(iws("llama"), svc("llama"), eps("llama-a", "llama", [endpoint])).worker_sets[LLAMA]
    assert (len(ws.endpoints), ws.terminating) == (ready, terminating)


def test_addresses_are_deduplicated_across_slices_and_sorted() -> None:
    """A pod listed in two slices (mid-move) counts once; endpoints come out sorted by address."""
    catalog = build(
        iws("llama"),
        svc("llama"),
        eps("llama-b", "llama", ["127.0.0.3", "127.0.0.1"]),
        eps("llama-a", "llama", ["127.0.0.2", "127.0.0.3"]),
        eps("llama-c", "llama", [{"addresses": ["127.0.0.2"], "conditions": {"terminating": True}}]),
    )
    ws = catalog.worker_sets[LLAMA]
    assert [e.address for e in ws.endpoints] == ["127.0.0.1:8000", "127.0.0.2:8000", "127.0.0.3:8000"]
    assert ws.terminating == 0


def test_terminating_addresses_are_counted_once() -> None:
    """The same terminating pod in two slices is one terminating endpoint."""
    gone = {"addresses": ["127.0.0.9"], "conditions": {"ready": False, "terminating": True}}
    catalog = build(
        iws("llama"), svc("llama"), eps("llama-a", "llama", [gone]), eps("llama-b", "llama", [gone])
    )
    assert catalog.worker_sets[LLAMA].terminating == 1


def test_ipv6_endpoints_are_bracketed() -> None:
    """IPv6 pods are addressed as [ip]:port, the form Envoy's override_host expects."""
    endpoint = {"addresses": ["fd00::1"], "targetRef": {"kind": "Pod", "name": "llama-0"}}
    catalog = build(iws("llama"), svc("llama"), eps("llama-a", "llama", [endpoint], address_type="IPv6"))
    (only,) = catalog.worker_sets[LLAMA].endpoints
    assert (only.address, only.ip, only.port, only.pod, only.worker_set) == (
        "[fd00::1]:8000",
        "fd00::1",
        8000,
        "llama-0",
        LLAMA,
    )


@pytest.mark.parametrize(
    ("slice_", "problem"),
    [
        (
            eps("llama-f", "llama", ["pod.example"], address_type="FQDN"),
            "EndpointSlice default/llama-f has addressType FQDN; only IPv4 and IPv6 endpoints are routed",
        ),
        (
            eps("llama-p", "llama", ["127.0.0.1"], ports=[{"name": "grpc", "port": 9000}]),
            'EndpointSlice default/llama-p has no port number named "http"; its endpoints are not used',
        ),
        (
            eps("llama-p", "llama", ["127.0.0.1"], ports=[{"name": "http", "port": None}]),
            'EndpointSlice default/llama-p has no port number named "http"; its endpoints are not used',
        ),
    ],
    ids=["fqdn", "port-name-missing", "all-ports"],
)
def test_unusable_slices_are_reported(slice_: dict[str, Any], problem: str) -> None:
    """Slices whose endpoints cannot be addressed are skipped with a problem, not silently."""
    catalog = build(iws("llama"), svc("llama"), slice_, eps("llama-a", "llama", ["127.0.0.2"]))
    ws = catalog.worker_sets[LLAMA]
    assert [e.address for e in ws.endpoints] == ["127.0.0.2:8000"]
    assert ws.problems == (problem,)


@pytest.mark.parametrize(
    ("slices", "problems"),
    [
        ([], ("no EndpointSlices for Service default/llama yet",)),
        ([eps("llama-a", "llama", [], ports=[])], ()),
        ([eps("llama-a", "other", ["127.0.0.1"])], ("no EndpointSlices for Service default/llama yet",)),
        (
            [eps("llama-a", "llama", ["127.0.0.1"], namespace="prod")],
            ("no EndpointSlices for Service default/llama yet",),
        ),
    ],
    ids=["none", "empty-slice-is-fine", "other-service", "other-namespace"],
)
def test_sets_without_pods(slices: list[dict[str, Any]], problems: tuple[str, ...]) -> None:
    """Only slices labelled with the Service's name in its namespace count; an empty slice is normal."""
    catalog = build(iws("llama"), svc("llama"), *slices)
    assert catalog.worker_sets[LLAMA].endpoints == ()
    assert catalog.worker_sets[LLAMA].problems == problems
    assert addresses(catalog, "llama") == []


@pytest.mark.parametrize(
    ("mode", "problem"),
    [
        (None, "spec.models is empty; the set serves nothing until model discovery finds its models"),
        ("Static", "modelDiscovery.mode is Static but spec.models is empty; the set serves nothing"),
    ],
    ids=["endpoint-discovery", "static"],
)
def test_set_without_models_waits_for_discovery(mode: str | None, problem: str) -> None:
    """A set that lists no models routes nothing yet, and says why."""
    obj = iws("llama", models=[])
    if mode is not None:
        obj["spec"]["modelDiscovery"] = {"mode": mode}
    catalog = build(obj, svc("llama"), eps("llama-a", "llama", ["127.0.0.1"]))
    assert catalog.routes == {}
    assert catalog.worker_sets[LLAMA].problems == (problem,)
    assert len(catalog.worker_sets[LLAMA].endpoints) == 1


def test_alias_resolves_to_upstream_model() -> None:
    """A client asking for an alias is routed to the pods of the upstream model."""
    catalog = build(
        iws("llama", models=[{"name": "meta-llama/Llama-3-8B", "aliases": ["chat", "llama"]}]),
        svc("llama"),
        eps("llama-a", "llama", ["127.0.0.1"]),
    )
    assert sorted(catalog.routes) == ["chat", "llama", "meta-llama/Llama-3-8B"]
    route = catalog.resolve("chat")
    assert route is not None
    assert (route.upstream_model, route.is_alias, route.worker_sets) == (
        "meta-llama/Llama-3-8B",
        True,
        (LLAMA,),
    )
    upstream = catalog.resolve("meta-llama/Llama-3-8B")
    assert upstream is not None
    assert not upstream.is_alias
    assert catalog.resolve("unknown") is None


def test_sets_serving_the_same_model_are_merged() -> None:
    """Two sets serving one upstream model share its name and alias: one route over both sets' pods."""
    models = [{"name": "llama-3", "aliases": ["chat"]}]
    catalog = build(
        iws("llama-b", models=models, service="shared", created="2025-02-01T00:00:00Z"),
        iws("llama-a", models=models, service="shared", created="2025-01-01T00:00:00Z"),
        iws("llama-c", models=models, service="other"),
        svc("shared"),
        svc("other"),
        eps("shared-a", "shared", ["127.0.0.2", "127.0.0.1"]),
        eps("other-a", "other", ["127.0.0.3", "127.0.0.1"]),
    )
    assert catalog.conflicts == ()
    for name in ("chat", "llama-3"):
        route = catalog.resolve(name)
        assert route is not None
        assert route.worker_sets == ("default/llama-a", "default/llama-b", "default/llama-c")
        assert addresses(catalog, name) == ["127.0.0.1:8000", "127.0.0.2:8000", "127.0.0.3:8000"]
        # The oldest set's record of a shared address is kept.
        assert route.endpoints[0].worker_set == "default/llama-a"


def _claim(name: str, model: str, aliases: list[str], created: str | None, namespace: str = "default") -> Any:
    return iws(name, models=[{"name": model, "aliases": aliases}], created=created, namespace=namespace)


@pytest.mark.parametrize(
    ("sets", "name", "winner", "conflict"),
    [
        (
            [
                _claim("new", "m2", ["chat"], "2025-02-01T00:00:00Z"),
                _claim("old", "m1", ["chat"], "2025-01-01T00:00:00Z"),
            ],
            "chat",
            "m1",
            NameConflict(
                ModelName("chat"),
                WorkerSetKey("default/old"),
                ModelName("m1"),
                WorkerSetKey("default/new"),
                ModelName("m2"),
            ),
        ),
        (
            [
                _claim("new", "m2", [], "2025-02-01T00:00:00Z"),
                _claim("old", "m1", ["m2"], "2025-01-01T00:00:00Z"),
            ],
            "m2",
            "m1",
            NameConflict(
                ModelName("m2"),
                WorkerSetKey("default/old"),
                ModelName("m1"),
                WorkerSetKey("default/new"),
                ModelName("m2"),
            ),
        ),
        (
            [_claim("old", "m1", [], None), _claim("new", "m2", ["m1"], "2025-02-01T00:00:00Z")],
            "m1",
            "m2",
            NameConflict(
                ModelName("m1"),
                WorkerSetKey("default/new"),
                ModelName("m2"),
                WorkerSetKey("default/old"),
                ModelName("m1"),
            ),
        ),
        (
            [_claim("b", "m2", ["chat"], None), _claim("a", "m1", ["chat"], None)],
            "chat",
            "m1",
            NameConflict(
                ModelName("chat"),
                WorkerSetKey("default/a"),
                ModelName("m1"),
                WorkerSetKey("default/b"),
                ModelName("m2"),
            ),
        ),
        (
            [
                _claim("a", "m2", ["chat"], "2025-01-01T00:00:00Z", "beta"),
                _claim("z", "m1", ["chat"], "2025-01-01T00:00:00Z", "alpha"),
            ],
            "chat",
            "m1",
            NameConflict(
                ModelName("chat"),
                WorkerSetKey("alpha/z"),
                ModelName("m1"),
                WorkerSetKey("beta/a"),
                ModelName("m2"),
            ),
        ),
        (
            [
                _claim("a", "m2", ["chat"], "2025-01-01T02:00:00+02:00"),
                _claim("b", "m1", ["chat"], "2025-01-01T00:30:00Z"),
            ],
            "chat",
            "m2",
            NameConflict(
                ModelName("chat"),
                WorkerSetKey("default/a"),
                ModelName("m2"),
                WorkerSetKey("default/b"),
                ModelName("m1"),
            ),
        ),
    ],
    ids=[
        "alias-vs-alias",
        "alias-vs-upstream",
        "missing-timestamp-is-newest",
        "tie-by-name",
        "tie-by-namespace",
        "offsets-compared-in-utc",
    ],
)
def test_name_conflicts_go_to_the_oldest_set(
    sets: list[dict[str, Any]], name: str, winner: str, conflict: NameConflict
) -> None:
    """One name claimed for two models goes to the oldest set; the loser is reported, never shadowed."""
    catalog = build(*sets)
    route = catalog.resolve(name)
    assert route is not None
    assert route.upstream_model == winner
    assert route.worker_sets == (conflict.winner,)
    assert catalog.conflicts == (conflict,)


def test_conflict_message_names_both_sets() -> None:
    """The reported conflict says who keeps the name and why."""
    catalog = build(
        _claim("new", "m2", ["chat"], "2025-02-01T00:00:00Z"),
        _claim("old", "m1", ["chat"], "2025-01-01T00:00:00Z"),
    )
    assert [c.message() for c in catalog.conflicts] == [
        "model name 'chat' is claimed by default/old (upstream 'm1') and by default/new (upstream 'm2'); "
        "default/old is older and keeps it"
    ]
    # The loser keeps its other names.
    assert catalog.resolve("m2") is not None


def test_conflict_with_merge_keeps_all_same_model_sets() -> None:
    """Sets agreeing with the winner merge into the route; only disagreeing sets lose."""
    catalog = build(
        _claim("a", "m1", ["chat"], "2025-01-01T00:00:00Z"),
        _claim("b", "m2", ["chat"], "2025-01-02T00:00:00Z"),
        _claim("c", "m1", ["chat"], "2025-01-03T00:00:00Z"),
    )
    route = catalog.resolve("chat")
    assert route is not None
    assert route.worker_sets == ("default/a", "default/c")
    assert [(c.winner, c.loser) for c in catalog.conflicts] == [("default/a", "default/b")]


def test_problems_are_passed_through_sorted() -> None:
    """Problems from the source appear in the catalog in a stable order."""
    problems = (
        ObjectProblem("Service", "default", "b", "x"),
        ObjectProblem("ConfigMap", "default", "a", "y"),
    )
    assert build(problems=problems).problems == tuple(reversed(problems))


def test_output_is_deterministic_whatever_the_input_order() -> None:
    """Reordering the same objects yields an equal catalog (no spurious reloads, stable /debug/state)."""
    objects = [
        iws("llama", models=[{"name": "llama-3", "aliases": ["chat"]}]),
        iws("qwen", port=8000, models=[{"name": "qwen-2", "aliases": ["chat"]}]),
        svc("llama"),
        svc("qwen", [{"port": 8000}]),
        eps("llama-a", "llama", ["127.0.0.2", "127.0.0.1"]),
        eps("llama-b", "llama", ["127.0.0.1", "127.0.0.4"]),
        eps("qwen-a", "qwen", ["127.0.0.3"], ports=[{"port": 8000}]),
    ]
    expected = build(*objects)
    rng = random.Random(7)
    for _ in range(20):
        rng.shuffle(objects)
        assert build(*objects) == expected
    assert len(expected.conflicts) == 1


SIDE_SLICE_PORTS = [
    {"name": "http", "port": 8000},
    {"name": "kv", "port": 5557},
    {"name": "kv-replay", "port": 5657},
    {"name": "metrics", "port": 9100},
]


@pytest.mark.parametrize(
    ("spec", "slice_ports", "expected"),
    [
        ({}, SIDE_SLICE_PORTS, (None, None, 9100)),
        ({"kvEvents": {"port": 5557}}, [{"name": "http", "port": 8000}], (5557, None, 8000)),
        ({"kvEvents": {"port": "kv"}}, SIDE_SLICE_PORTS, (5557, 5657, 9100)),
        (
            {"kvEvents": {"port": 7000, "replayPort": 7100}, "metricsPort": 9200},
            SIDE_SLICE_PORTS,
            (7000, 7100, 9200),
        ),
        (
            {"kvEvents": {"port": "kv", "replayPort": "kv"}, "metricsPort": "http"},
            SIDE_SLICE_PORTS,
            (5557, 5557, 8000),
        ),
    ],
    ids=["no-kv-events", "number-no-replay", "name-and-default-replay", "all-numbers", "all-names"],
)
def test_side_ports_resolve_per_endpoint(
    spec: dict[str, Any], slice_ports: list[Any], expected: tuple[int | None, int | None, int]
) -> None:
    """KV-event, replay and metrics ports: numbers as given, names through the slice, CRD fallbacks."""
    ws_doc = iws("llama")
    ws_doc["spec"].update(spec)
    catalog = build(ws_doc, svc("llama"), eps("llama-a", "llama", ["127.0.0.1"], ports=slice_ports))
    (endpoint,) = catalog.worker_sets[LLAMA].endpoints
    assert (endpoint.kv_events_port, endpoint.kv_replay_port, endpoint.metrics_port) == expected
    assert catalog.worker_sets[LLAMA].problems == ()


def test_unknown_side_port_name_is_reported() -> None:
    """A kvEvents port name the slice does not have is a problem naming the field and the names."""
    ws_doc = iws("llama")
    ws_doc["spec"]["kvEvents"] = {"port": "zmq"}
    catalog = build(ws_doc, svc("llama"), eps("llama-a", "llama", ["127.0.0.1"], ports=SIDE_SLICE_PORTS))
    (endpoint,) = catalog.worker_sets[LLAMA].endpoints
    assert endpoint.kv_events_port is None
    assert catalog.worker_sets[LLAMA].problems == (
        'spec.kvEvents.port "zmq" is not a port name of EndpointSlice default/llama-a '
        "(names: http, kv, kv-replay, metrics)",
    )


def test_objectives_join_their_worker_set_and_one_naming_none_is_a_problem() -> None:
    """An objective applies to the routes of the set its poolRef names; the llm-d.ai one wins over a
    legacy one of the same name; one naming no set is kept (the set may come) and reported."""
    objectives = [
        {
            "apiVersion": f"{group}/v1alpha2",
            "kind": "InferenceObjective",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"priority": priority, "poolRef": {"name": pool}},
        }
        for group, name, priority, pool in [
            ("llm-d.ai", "premium", 10, "llama"),
            ("inference.networking.x-k8s.io", "premium", 99, "llama"),
            ("llm-d.ai", "orphan", 5, "missing"),
        ]
    ]
    catalog = build(iws("llama"), svc("llama"), eps("llama-a", "llama", ["10.0.0.1"]), *objectives)
    route = catalog.resolve("llama")
    assert route is not None
    premium = catalog.objective("premium", route)
    assert premium is not None and (premium.priority, premium.pool) == (10, WorkerSetKey("default/llama"))
    assert catalog.objective("orphan", route) is None
    assert catalog.objective("nothing", route) is None
    assert [(p.kind, p.name) for p in catalog.problems] == [("InferenceObjective", "orphan")]
    assert "no InferenceWorkerSet default/missing" in catalog.problems[0].message
