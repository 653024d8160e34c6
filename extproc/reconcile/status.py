"""The ``status`` of one InferenceWorkerSet, computed from what Kubernetes and the router say. Pure.

Inputs: the set's :class:`~extproc.reconcile.facts.SetFacts` (object, parsed spec, Service, joined
endpoints), the HTTPRoutes referencing it, the router's view of it (None while ``serve`` cannot be
read), the previous status and the time. Kubernetes alone decides ``endpoints`` and ResolvedRefs,
so they stay true while the router is away; what only the router knows (models it discovered,
KV-event subscriptions) comes from its view, and from the previous status while it is away.

Conditions (each with reason, message, observedGeneration, lastTransitionTime):

- ``Accepted``: the spec is valid (False: ``InvalidSpec``), and no model name of the set loses to
  an older set (False: ``NameConflict``).
- ``ResolvedRefs``: the Service exists and ``serviceRef.port`` is one of its ports; named KV-event
  and metrics ports are its port names (False: ``ServiceNotFound`` / ``PortNotFound``).
- ``Ready``: some ready endpoint serves some model, and the router routes the set.
- ``KVEventsReady`` (only with ``spec.kvEvents``): every ready endpoint's KV-event stream is
  connected (False: ``PartiallySubscribed`` / ``NotSubscribed``).

Equal inputs, with ``previous`` the output of the same inputs, give an equal status: nothing here
depends on the time except a changed condition's transition time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from extproc.catalog.fields import IntOrString
from extproc.reconcile.conditions import Condition, listing, render_conditions, truncate
from extproc.reconcile.facts import SetFacts
from extproc.reconcile.references import MAX_REFERENCE_LENGTH, MAX_REFERENCES
from extproc.reconcile.serve_state import ModelView, SetView

#: ``status`` limits of the schema.
MAX_MODELS = 64
MAX_ALIASES = 64
MAX_NAME = 512
MAX_STATE = 256

ROUTER_UNAVAILABLE = "RouterUnavailable"


@dataclass(frozen=True, slots=True)
class RouterSide:
    """What the router said about one set: ``reachable`` False when ``serve`` could not be read."""

    reachable: bool
    #: The set as the router sees it; None when the router does not know it.
    view: SetView | None = None
    #: Why ``serve`` could not be read.
    error: str | None = None


def compute_status(
    facts: SetFacts,
    *,
    routes: Sequence[str],
    router: RouterSide,
    previous: Mapping[str, Any] | None,
    now: datetime,
) -> dict[str, Any]:
    """The new ``status`` (JSON-ready; a field without a value is left out); see the module docstring."""
    previous = previous if isinstance(previous, Mapping) else {}
    spec, joined = facts.spec, facts.joined
    view = router.view if router.reachable else None
    status: dict[str, Any] = {}
    referenced, omitted = _references(routes)
    if referenced:
        status["referencedBy"] = referenced
    if joined is not None:
        status["endpoints"] = {"ready": len(joined.endpoints), "terminating": joined.terminating}
    models, model_count = _models(facts, view, previous)
    if models is not None:
        status["models"] = models
    if spec is not None:
        status["kvEvents"] = _kv_events(facts, router, previous)
    refs = _resolved_refs(facts)
    conditions = [
        _accepted(facts, view, omitted),
        refs,
        _ready(facts, refs, router, models or [], model_count),
    ]
    if spec is not None and spec.kv_events is not None:
        conditions.append(_kv_events_ready(facts, router))
    status["state"] = truncate(_state(conditions, facts, view), MAX_STATE)
    generation = facts.obj.get("metadata", {}).get("generation")
    status["conditions"] = render_conditions(
        conditions,
        generation=generation if isinstance(generation, int) else None,
        previous=previous.get("conditions"),
        now=now,
    )
    return status


def _references(routes: Sequence[str]) -> tuple[list[str], int]:
    """The routes that fit the schema (sorted, at most 64, each at most 253 long) and how many not."""
    fitting = sorted(r for r in set(routes) if len(r) <= MAX_REFERENCE_LENGTH)
    return fitting[:MAX_REFERENCES], len(set(routes)) - min(len(fitting), MAX_REFERENCES)


def _models(
    facts: SetFacts, view: SetView | None, previous: Mapping[str, Any]
) -> tuple[list[dict[str, Any]] | None, int]:
    """``status.models`` and how many models there are in all (the list stops at 64)."""
    spec, joined = facts.spec, facts.joined
    if spec is None or joined is None:
        return None, 0
    if view is not None and view.routed:
        return [_model(m) for m in view.models[:MAX_MODELS]], len(view.models)
    if spec.discovery_mode == "Endpoint" and isinstance(previous.get("models"), list):
        # Discovered models are known only to the router: keep the last it told us.
        kept = previous["models"][:MAX_MODELS]
        return kept, len(kept)
    ready = len(joined.endpoints) if spec.discovery_mode == "Static" else None
    declared = [ModelView(m.name, tuple(m.aliases), ready or 0) for m in spec.models]
    models = [_model(m, with_count=ready is not None) for m in declared[:MAX_MODELS]]
    return models, len(declared)


def _model(model: ModelView, *, with_count: bool = True) -> dict[str, Any]:
    entry: dict[str, Any] = {"upstreamName": truncate(model.upstream_name, MAX_NAME)}
    if model.aliases:
        entry["aliases"] = [truncate(a, MAX_NAME) for a in model.aliases[:MAX_ALIASES]]
    if with_count:
        entry["readyEndpoints"] = model.ready_endpoints
    if model.context_window is not None:
        entry["contextWindow"] = {"min": model.context_window[0], "max": model.context_window[1]}
    return entry


def _kv_events(facts: SetFacts, router: RouterSide, previous: Mapping[str, Any]) -> dict[str, Any]:
    assert facts.spec is not None
    if facts.spec.kv_events is None:
        return {"configured": False}
    kv: dict[str, Any] = {"configured": True}
    view = router.view if router.reachable else None
    if view is not None and view.routed:
        kv["subscribedEndpoints"] = view.kv_subscribed
    else:
        old = previous.get("kvEvents")
        count = old.get("subscribedEndpoints") if isinstance(old, Mapping) else None
        if isinstance(count, int):
            kv["subscribedEndpoints"] = count
    return kv


def _accepted(facts: SetFacts, view: SetView | None, omitted_routes: int) -> Condition:
    if facts.spec is None:
        return Condition("Accepted", "False", "InvalidSpec", facts.invalid or "the spec is invalid")
    # The router's conflicts account for discovered models; without it, the declared ones decide.
    lost = (
        list(view.conflicts) if view is not None and view.routed else [c.message() for c in facts.conflicts]
    )
    if lost:
        return Condition("Accepted", "False", "NameConflict", listing(lost))
    message = "the spec is valid"
    if omitted_routes:
        message += (
            f"; {omitted_routes} referencing HTTPRoute(s) are not listed in status.referencedBy "
            f"(it holds at most {MAX_REFERENCES} names of at most {MAX_REFERENCE_LENGTH} characters)"
        )
    return Condition("Accepted", "True", "Accepted", message)


def _resolved_refs(facts: SetFacts) -> Condition:
    spec, service = facts.spec, facts.service
    if spec is None:
        return Condition("ResolvedRefs", "Unknown", "InvalidSpec", "the spec is invalid")
    where = f"Service {spec.namespace}/{spec.service_name}"
    if service is None:
        return Condition("ResolvedRefs", "False", "ServiceNotFound", f"{where} not found")
    names = {p.name for p in service.ports if p.name}
    ports = ", ".join(f"{p.name}={p.port}" if p.name else str(p.port) for p in service.ports) or "none"
    ref = spec.service_port
    if not any((p.port == ref) if isinstance(ref, int) else (p.name == ref) for p in service.ports):
        message = f"serviceRef.port {_show(ref)} is not a port of {where} (ports: {ports})"
        return Condition("ResolvedRefs", "False", "PortNotFound", message)
    named: list[tuple[str, IntOrString | None]] = [("metricsPort", spec.metrics_port)]
    if spec.kv_events is not None:
        named += [("kvEvents.port", spec.kv_events.port), ("kvEvents.replayPort", spec.kv_events.replay_port)]
    missing = [f"{field} {_show(v)}" for field, v in named if isinstance(v, str) and v not in names]
    if missing:
        message = f"{', '.join(missing)} not a port name of {where} (ports: {ports})"
        return Condition("ResolvedRefs", "False", "PortNotFound", message)
    return Condition("ResolvedRefs", "True", "ResolvedRefs", f"{where} port {_show(ref)}")


def _ready(
    facts: SetFacts, refs: Condition, router: RouterSide, models: list[dict[str, Any]], total: int
) -> Condition:
    if facts.spec is None or facts.joined is None:
        return Condition("Ready", "False", "InvalidSpec", "the spec is invalid")
    if refs.status != "True":
        return Condition("Ready", "False", refs.reason, refs.message)
    ready, terminating = len(facts.joined.endpoints), facts.joined.terminating
    if ready == 0:
        detail = listing(list(facts.joined.problems)) or f"{terminating} terminating"
        return Condition("Ready", "False", "NoReadyEndpoints", f"no ready endpoints ({detail})")
    if not router.reachable:
        message = f"{_endpoints(ready)} ready, but the router cannot be read ({router.error or 'no answer'})"
        return Condition("Ready", "Unknown", ROUTER_UNAVAILABLE, message)
    view = router.view
    if view is None or not view.routed:
        detail = f": {listing(list(view.rejected))}" if view is not None and view.rejected else ""
        return Condition("Ready", "False", "NotInRouter", f"the router does not route this set yet{detail}")
    serving = sum(1 for m in models if m.get("readyEndpoints", 0) > 0)
    if not serving:
        if not view.discovery_answered:
            message = f"waiting for the {_endpoints(ready)} to list their models at /v1/models"
            return Condition("Ready", "False", "AwaitingDiscovery", message)
        detail = listing(list(view.problems)) or "no ready endpoint serves a model"
        return Condition("Ready", "False", "NoModels", detail)
    message = f"{_endpoints(ready)} serve {total} model{'s' if total != 1 else ''}"
    if total > len(models):
        message += f" (status.models lists the first {len(models)})"
    if view.problems:
        message += f"; problems: {listing(list(view.problems))}"
    return Condition("Ready", "True", "Ready", message)


def _kv_events_ready(facts: SetFacts, router: RouterSide) -> Condition:
    assert facts.joined is not None
    if not router.reachable:
        message = f"the router cannot be read ({router.error or 'no answer'})"
        return Condition("KVEventsReady", "Unknown", ROUTER_UNAVAILABLE, message)
    view = router.view
    if view is None or not view.routed:
        return Condition("KVEventsReady", "Unknown", "NotInRouter", "the router does not route this set yet")
    ready = len(facts.joined.endpoints)
    subscribed = min(view.kv_subscribed, ready)
    if ready == 0:
        return Condition("KVEventsReady", "False", "NoReadyEndpoints", "no ready endpoints to subscribe to")
    if view.kv_mismatched and facts.spec is not None:
        engine, declared = view.kv_engine_block_size, facts.spec.kv_block_size
        message = (
            f"{min(view.kv_mismatched, ready)} of {_endpoints(ready)} publish KV blocks of {engine} tokens, "
            f"which spec.kvBlockSize {declared} does not divide: their events are skipped and routing "
            f"cannot see their caches; set spec.kvBlockSize to {engine} (or a divisor of it)"
        )
        return Condition("KVEventsReady", "False", "BlockSizeMismatch", message)
    if subscribed == ready:
        message = f"KV events of all {_endpoints(ready)} are subscribed"
        return Condition("KVEventsReady", "True", "Subscribed", message)
    reason = "PartiallySubscribed" if subscribed else "NotSubscribed"
    message = f"KV events of {subscribed} of {_endpoints(ready)} are subscribed"
    return Condition("KVEventsReady", "False", reason, message)


def _state(conditions: Sequence[Condition], facts: SetFacts, view: SetView | None) -> str:
    """One word for ``kubectl get``: Invalid, NotReady, Pending, Degraded or Ready."""
    if facts.spec is None:
        return "Invalid"
    ready = next(c for c in conditions if c.type == "Ready")
    if ready.status == "Unknown" or ready.reason in ("NotInRouter", "AwaitingDiscovery"):
        return "Pending"
    if ready.status == "False":
        return "NotReady"
    others_false = any(c.status == "False" for c in conditions if c.type != "Ready")
    return "Degraded" if others_false or (view is not None and view.problems) else "Ready"


def _endpoints(count: int) -> str:
    return f"{count} ready endpoint{'s' if count != 1 else ''}"


def _show(ref: IntOrString) -> str:
    return str(ref) if isinstance(ref, int) else f'"{ref}"'


#: Every field of ``status`` we write, with the fields of its nested objects: a merge patch sets the
#: ones we leave out to null, so a value we no longer report disappears whatever the server holds.
_STATUS_FIELDS: Mapping[str, tuple[str, ...]] = {
    "state": (),
    "models": (),
    "referencedBy": (),
    "endpoints": ("ready", "terminating"),
    "kvEvents": ("configured", "subscribedEndpoints"),
    "conditions": (),
}


def status_patch(status: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON merge patch (RFC 7386) that makes the object's ``status`` exactly ``status``."""
    patch: dict[str, Any] = {}
    for name, nested in _STATUS_FIELDS.items():
        value = status.get(name)
        if value is not None and nested and isinstance(value, Mapping):
            value = {field: value.get(field) for field in nested}
        patch[name] = value
    return {"status": patch}


def status_differs(old: Any, new: Mapping[str, Any]) -> bool:
    """Whether writing ``new`` would change the fields we own of the stored ``old`` status."""
    stored = old if isinstance(old, Mapping) else {}
    return {k: v for k, v in stored.items() if k in _STATUS_FIELDS} != new
