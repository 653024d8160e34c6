"""Computing an InferenceWorkerSet's status from Kubernetes, the router's view and the previous status."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from extproc.reconcile.facts import gather_facts
from extproc.reconcile.serve_state import ModelView, SetView
from extproc.reconcile.status import RouterSide, compute_status, status_differs, status_patch

from .objects import endpoint_slice, service, worker_set

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
T1 = T0 + timedelta(minutes=5)
KV = {"port": "kv"}


def view(
    *,
    ready: int = 2,
    models: tuple[ModelView, ...] | None = None,
    subscribed: int = 0,
    mode: str = "Static",
    answered: bool = True,
    problems: tuple[str, ...] = (),
    conflicts: tuple[str, ...] = (),
) -> SetView:
    return SetView(
        routed=True,
        ready_endpoints=ready,
        models=(ModelView("llama", ("chat",), ready, (8192, 8192)),) if models is None else models,
        kv_subscribed=subscribed,
        discovery_mode=mode,
        discovery_answered=answered,
        problems=problems,
        conflicts=conflicts,
    )


def status_of(
    *objects: dict[str, Any],
    router: SetView | str | None = "default",
    routes: tuple[str, ...] = (),
    previous: dict[str, Any] | None = None,
    now: datetime = T0,
    key: str = "default/llama",
) -> dict[str, Any]:
    """The status of ``key``; ``router`` is its view, None (router does not know it) or "down"."""
    kinds = {kind: [o for o in objects if o["kind"] == kind] for kind in ("InferenceWorkerSet", "Service")}
    facts = gather_facts(
        kinds["InferenceWorkerSet"],
        kinds["Service"],
        [o for o in objects if o["kind"] == "EndpointSlice"],
    )
    side = (
        RouterSide(reachable=False, error="connection refused")
        if router == "down"
        else RouterSide(reachable=True, view=view() if router == "default" else router)  # type: ignore[arg-type]
    )
    return compute_status(facts[key], routes=list(routes), router=side, previous=previous, now=now)


def healthy(**set_args: Any) -> tuple[dict[str, Any], ...]:
    return (worker_set(**set_args), service(), endpoint_slice(ready=2, terminating=1))


def condition(status: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in status["conditions"] if c["type"] == kind), None)


def summary(status: dict[str, Any], kind: str) -> tuple[str, str] | None:
    found = condition(status, kind)
    return None if found is None else (found["status"], found["reason"])


def test_a_healthy_set_is_ready_with_counts_models_and_windows() -> None:
    """Everything resolves and the router serves the set: Ready, with what it routes."""
    status = status_of(*healthy(generation=3))
    assert status["state"] == "Ready"
    assert status["endpoints"] == {"ready": 2, "terminating": 1}
    assert status["models"] == [
        {
            "upstreamName": "llama",
            "aliases": ["chat"],
            "readyEndpoints": 2,
            "contextWindow": {"min": 8192, "max": 8192},
        }
    ]
    assert status["kvEvents"] == {"configured": False}
    assert [c["type"] for c in status["conditions"]] == ["Accepted", "ResolvedRefs", "Ready"]
    for c in status["conditions"]:
        assert c["status"] == "True"
        assert c["observedGeneration"] == 3
        assert c["lastTransitionTime"] == "2026-03-01T12:00:00Z"
    assert "referencedBy" not in status


def test_an_invalid_spec_is_not_accepted() -> None:
    """A spec the schema cannot refuse but the router does (one name, two models) is Invalid."""
    bad = worker_set(models=[{"name": "a", "aliases": ["b"]}, {"name": "b"}])
    status = status_of(bad, service(), endpoint_slice())
    assert status["state"] == "Invalid"
    assert summary(status, "Accepted") == ("False", "InvalidSpec")
    assert "spec.models[1].name" in condition(status, "Accepted")["message"]  # type: ignore[index]
    assert summary(status, "ResolvedRefs") == ("Unknown", "InvalidSpec")
    assert summary(status, "Ready") == ("False", "InvalidSpec")
    assert "models" not in status and "endpoints" not in status


def test_a_name_lost_to_an_older_set_is_a_conflict() -> None:
    """Without the router, the declared names decide; the newer claimant is not Accepted."""
    older = worker_set("old", models=[{"name": "m", "aliases": ["shared"]}], created="2025-01-01T00:00:00Z")
    newer = worker_set(models=[{"name": "llama", "aliases": ["shared"]}])
    objects = (older, newer, service(), service("old"), endpoint_slice(), endpoint_slice("old"))
    status = status_of(*objects, router="down")
    assert summary(status, "Accepted") == ("False", "NameConflict")
    assert "'shared'" in condition(status, "Accepted")["message"]  # type: ignore[index]
    assert summary(status_of(*objects, router="down", key="default/old"), "Accepted") == ("True", "Accepted")


def test_the_routers_conflicts_count_when_it_answers() -> None:
    """Conflicts over discovered names are known only to the router: a Ready set is then Degraded."""
    status = status_of(*healthy(), router=view(conflicts=("model name 'x' is claimed by ...",)))
    assert summary(status, "Accepted") == ("False", "NameConflict")
    assert status["state"] == "Degraded"


@pytest.mark.parametrize(
    ("objects", "reason", "message"),
    [
        ((worker_set(), endpoint_slice()), "ServiceNotFound", "Service default/llama not found"),
        ((worker_set(port=9999), service(), endpoint_slice()), "PortNotFound", "serviceRef.port 9999"),
        ((worker_set(port="grpc"), service(), endpoint_slice()), "PortNotFound", 'serviceRef.port "grpc"'),
        (
            (worker_set(kv_events={"port": "zmq"}), service(), endpoint_slice()),
            "PortNotFound",
            'kvEvents.port "zmq"',
        ),
        (
            (worker_set(metrics_port="prom"), service(), endpoint_slice()),
            "PortNotFound",
            'metricsPort "prom"',
        ),
    ],
    ids=["no-service", "port-number", "port-name", "kv-port-name", "metrics-port-name"],
)
def test_unresolved_references(objects: tuple[dict[str, Any], ...], reason: str, message: str) -> None:
    """A missing Service or port says which, and the set is not Ready for the same reason."""
    status = status_of(*objects)
    assert summary(status, "ResolvedRefs") == ("False", reason)
    assert message in condition(status, "ResolvedRefs")["message"]  # type: ignore[index]
    assert summary(status, "Ready") == ("False", reason)
    assert status["state"] == "NotReady"


def test_resolved_references_by_number_and_name() -> None:
    """Port numbers of the Service and names of its ports both resolve."""
    for spec_port in (80, "http"):
        status = status_of(*healthy(port=spec_port, kv_events={"port": "kv", "replayPort": 5558}))
        assert summary(status, "ResolvedRefs") == ("True", "ResolvedRefs")


@pytest.mark.parametrize(
    ("objects", "router", "expected", "state"),
    [
        (
            (worker_set(), service(), endpoint_slice(ready=0, terminating=2)),
            "default",
            ("False", "NoReadyEndpoints"),
            "NotReady",
        ),
        (healthy(), "down", ("Unknown", "RouterUnavailable"), "Pending"),
        (healthy(), None, ("False", "NotInRouter"), "Pending"),
        (
            healthy(mode="Endpoint", models=[]),
            view(models=(), mode="Endpoint", answered=False),
            ("False", "AwaitingDiscovery"),
            "Pending",
        ),
        (
            healthy(),
            view(models=(), problems=("the endpoints list no models",)),
            ("False", "NoModels"),
            "NotReady",
        ),
        (healthy(), view(models=(ModelView("llama", (), 0),)), ("False", "NoModels"), "NotReady"),
        (healthy(), "default", ("True", "Ready"), "Ready"),
    ],
    ids=[
        "no-ready-endpoints",
        "router-down",
        "not-in-router",
        "awaiting-discovery",
        "no-models",
        "model-without-endpoints",
        "ready",
    ],
)
def test_ready(
    objects: tuple[dict[str, Any], ...], router: SetView | str | None, expected: tuple[str, str], state: str
) -> None:
    """Ready needs a ready endpoint serving a model, in a set the router routes."""
    status = status_of(*objects, router=router)
    assert summary(status, "Ready") == expected
    assert status["state"] == state


def test_endpoint_counts_come_from_kubernetes_while_the_router_is_down() -> None:
    """The router being away does not hide what the cluster says."""
    status = status_of(*healthy(), router="down")
    assert status["endpoints"] == {"ready": 2, "terminating": 1}
    assert "connection refused" in condition(status, "Ready")["message"]  # type: ignore[index]


def test_router_problems_degrade_a_ready_set() -> None:
    """A set that routes but has catalog problems says so."""
    status = status_of(*healthy(), router=view(problems=("EndpointSlice default/x has addressType FQDN",)))
    assert summary(status, "Ready") == ("True", "Ready")
    assert "FQDN" in condition(status, "Ready")["message"]  # type: ignore[index]
    assert status["state"] == "Degraded"


@pytest.mark.parametrize(
    ("subscribed", "expected", "fragment"),
    [
        (2, ("True", "Subscribed"), "all 2 ready endpoints"),
        (1, ("False", "PartiallySubscribed"), "1 of 2 ready endpoints"),
        (0, ("False", "NotSubscribed"), "0 of 2 ready endpoints"),
    ],
    ids=["all", "some", "none"],
)
def test_kv_events_ready(subscribed: int, expected: tuple[str, str], fragment: str) -> None:
    """With spec.kvEvents, every ready endpoint's stream must be connected."""
    status = status_of(*healthy(kv_events=KV), router=view(subscribed=subscribed))
    assert summary(status, "KVEventsReady") == expected
    assert fragment in condition(status, "KVEventsReady")["message"]  # type: ignore[index]
    assert status["kvEvents"] == {"configured": True, "subscribedEndpoints": subscribed}
    assert status["state"] == ("Ready" if subscribed == 2 else "Degraded")


def test_engines_publishing_blocks_the_spec_does_not_divide_are_a_block_size_mismatch() -> None:
    """SGLang's default page size is 1: under kvBlockSize 16 its events are skipped, and the set says so."""
    router = dataclasses.replace(view(subscribed=2), kv_mismatched=2, kv_engine_block_size=1)
    status = status_of(*healthy(kv_events=KV), router=router)
    assert summary(status, "KVEventsReady") == ("False", "BlockSizeMismatch")
    message = condition(status, "KVEventsReady")["message"]  # type: ignore[index]
    assert "2 of 2 ready endpoints publish KV blocks of 1 tokens" in message
    assert "set spec.kvBlockSize to 1" in message
    assert status["state"] == "Degraded"


def test_kv_events_ready_is_unknown_without_the_router_and_absent_without_kv_events() -> None:
    """The router alone knows subscriptions; sets without kvEvents have no such condition."""
    assert summary(status_of(*healthy(kv_events=KV), router="down"), "KVEventsReady") == (
        "Unknown",
        "RouterUnavailable",
    )
    assert summary(status_of(*healthy()), "KVEventsReady") is None


def test_what_only_the_router_knows_is_kept_while_it_is_down() -> None:
    """Discovered models and subscription counts stay at their last known values."""
    first = status_of(*healthy(kv_events=KV, mode="Endpoint"), router=view(subscribed=2, mode="Endpoint"))
    later = status_of(*healthy(kv_events=KV, mode="Endpoint"), router="down", previous=first, now=T1)
    assert later["models"] == first["models"]
    assert later["kvEvents"] == {"configured": True, "subscribedEndpoints": 2}


def test_static_models_without_the_router_come_from_the_spec() -> None:
    """A Static set serves its spec's models on every ready endpoint, router or not."""
    status = status_of(*healthy(models=[{"name": "llama", "aliases": ["chat"]}]), router="down")
    assert status["models"] == [{"upstreamName": "llama", "aliases": ["chat"], "readyEndpoints": 2}]


def test_unchanged_inputs_give_an_identical_status() -> None:
    """Recomputing later with the stored status as previous changes nothing: no write."""
    objects = healthy(kv_events=KV)
    first = status_of(*objects, router=view(subscribed=1), routes=("default/r",))
    again = status_of(*objects, router=view(subscribed=1), routes=("default/r",), previous=first, now=T1)
    assert again == first
    assert not status_differs(first, again)


def test_transition_time_changes_only_with_the_status() -> None:
    """A new reason or message keeps the time; a new status takes the current time."""
    objects = healthy(kv_events=KV)
    first = status_of(*objects, router=view(subscribed=0))
    second = status_of(*objects, router=view(subscribed=1), previous=first, now=T1)
    assert summary(second, "KVEventsReady") == ("False", "PartiallySubscribed")
    assert condition(second, "KVEventsReady")["lastTransitionTime"] == "2026-03-01T12:00:00Z"  # type: ignore[index]
    third = status_of(*objects, router=view(subscribed=2), previous=second, now=T1)
    assert condition(third, "KVEventsReady")["lastTransitionTime"] == "2026-03-01T12:05:00Z"  # type: ignore[index]
    assert condition(third, "Ready")["lastTransitionTime"] == "2026-03-01T12:00:00Z"  # type: ignore[index]
    assert status_differs(second, third)


def test_limits_of_the_schema_are_kept() -> None:
    """At most 64 models and names of at most 512 characters; the Ready message tells how many."""
    many = tuple(ModelView(f"m{i:03d}", tuple(f"a{i}-{j}" for j in range(70)), 2) for i in range(70))
    long = (ModelView("x" * 600, ("y" * 600,), 2),)
    status = status_of(*healthy(), router=view(models=long + many))
    assert len(status["models"]) == 64
    assert len(status["models"][0]["upstreamName"]) == 512
    assert status["models"][0]["upstreamName"].endswith("…")
    assert len(status["models"][1]["aliases"]) == 64
    assert "71 models (status.models lists the first 64)" in condition(status, "Ready")["message"]  # type: ignore[index]


def test_referenced_by_is_sorted_and_capped() -> None:
    """Sorted route names, 64 at most, too-long names left out; Accepted says how many are missing."""
    routes = (*tuple(f"ns/route-{i:03d}" for i in range(70)), "ns/" + "r" * 260)
    status = status_of(*healthy(), routes=tuple(reversed(routes)))
    assert status["referencedBy"] == sorted(routes[:70])[:64]
    message = condition(status, "Accepted")["message"]  # type: ignore[index]
    assert "7 referencing HTTPRoute(s) are not listed" in message


def test_the_patch_clears_what_is_no_longer_reported() -> None:
    """The merge patch nulls every status field we own but did not set this time."""
    patch = status_patch({"state": "Invalid", "kvEvents": {"configured": False}, "conditions": []})
    assert patch == {
        "status": {
            "state": "Invalid",
            "models": None,
            "referencedBy": None,
            "endpoints": None,
            "kvEvents": {"configured": False, "subscribedEndpoints": None},
            "conditions": [],
        }
    }


def test_fields_we_do_not_own_do_not_count_as_a_difference() -> None:
    """Only our fields are compared with the stored status."""
    status = status_of(*healthy())
    assert not status_differs({**status, "somethingElse": 1}, status)
    assert status_differs(None, status)
