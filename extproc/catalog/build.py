"""Join validated objects into one :class:`Catalog`: endpoints per set, then routes per model name.

A pure function of its inputs, so both sources (file and Kubernetes) share it and tests need no
I/O. Everything that can go wrong with a reference between objects (a missing Service, a port that
is not the Service's, two sets claiming one name) becomes a human-readable problem or a
:class:`NameConflict` in the result instead of an exception: one bad set never hides the others.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

from extproc.addresses import join_host_port
from extproc.catalog.fields import IntOrString
from extproc.catalog.model import (
    Catalog,
    Endpoint,
    NameConflict,
    Objective,
    ObjectProblem,
    Route,
    WorkerSet,
)
from extproc.catalog.resources import EndpointSlice, InferenceObjective, InferenceWorkerSet, Service
from extproc.types import EndpointAddress, ModelName, WorkerSetKey

#: The Service port names the CRD falls back to (see inferenceworkerset.schema.json).
KV_REPLAY_PORT_NAME = "kv-replay"
METRICS_PORT_NAME = "metrics"

_Claim = tuple[WorkerSet, ModelName]

#: The problem of an Endpoint-mode set that lists no models, until its endpoints say what they serve.
AWAITING_DISCOVERY = "spec.models is empty; the set serves nothing until model discovery finds its models"


def build_catalog(
    worker_sets: Iterable[InferenceWorkerSet],
    services: Iterable[Service],
    slices: Iterable[EndpointSlice],
    problems: Iterable[ObjectProblem] = (),
    objectives: Iterable[InferenceObjective] = (),
    pools: Iterable[WorkerSet] = (),
    picks_for: WorkerSetKey | None = None,
) -> Catalog:
    """Build the routing table; equal inputs in any order give an equal Catalog.

    Objects are identified by namespace/name; if one appears twice, the later one is used. An
    objective whose pool is no worker set is kept (the set may come later) and said in problems.
    ``pools`` are InferencePools already joined with their pods (:func:`~extproc.catalog.pools.join_pool`);
    one named like a worker set is left out, with a problem. ``picks_for`` is the InferencePool
    serve was told to pick for (``--pool-name``), present or not.
    """
    specs = {ws.key: ws for ws in worker_sets}
    services_by_name = {(s.namespace, s.name): s for s in services}
    unique_slices = {(s.namespace, s.name): s for s in slices}
    slices_by_service: dict[tuple[str, str], list[EndpointSlice]] = {}
    for ns_name in sorted(unique_slices):
        endpoint_slice = unique_slices[ns_name]
        if endpoint_slice.service_name is not None:
            service_key = (endpoint_slice.namespace, endpoint_slice.service_name)
            slices_by_service.setdefault(service_key, []).append(endpoint_slice)
    built = {
        key: _join(
            specs[key],
            services_by_name.get((specs[key].namespace, specs[key].service_name)),
            slices_by_service.get((specs[key].namespace, specs[key].service_name), []),
        )
        for key in sorted(specs)
    }
    problems = list(problems)
    for joined in sorted(pools, key=lambda ws: ws.key):
        if joined.key in built:
            namespace, name = joined.key.split("/", 1)
            detail = "an InferenceWorkerSet of the same name exists; the pool is not routed"
            problems.append(ObjectProblem("InferencePool", namespace, name, detail))
        else:
            built[joined.key] = joined
    routes, conflicts = build_routes(built.values())
    named: dict[str, list[Objective]] = {}
    # One objective per namespace/name: the llm-d.ai one over a legacy one of the same name.
    chosen = {(o.namespace, o.name): o for o in sorted(objectives, key=lambda o: not o.legacy)}
    for o in sorted(chosen.values(), key=lambda o: (o.namespace, o.name)):
        pool = WorkerSetKey(f"{o.namespace}/{o.pool}")
        if pool not in built:
            detail = f"spec.poolRef.name: no InferenceWorkerSet {pool}; requests naming it get priority 0"
            problems.append(ObjectProblem("InferenceObjective", o.namespace, o.name, detail))
        named.setdefault(o.name, []).append(Objective(o.namespace, o.name, o.priority, pool))
    return Catalog(
        worker_sets=built,
        routes=routes,
        conflicts=conflicts,
        problems=tuple(sorted(problems, key=lambda p: (p.kind, p.namespace, p.name, p.message))),
        objectives={name: tuple(found) for name, found in named.items()},
        picks_for=picks_for,
    )


def _join(spec: InferenceWorkerSet, service: Service | None, slices: list[EndpointSlice]) -> WorkerSet:
    """One set's ready endpoints, terminating count and problems."""
    problems: list[str] = []
    ready: dict[str, Endpoint] = {}
    terminating: set[str] = set()
    port_name = _service_port_name(spec, service, problems)
    if port_name is not None:
        if not slices:
            problems.append(f"no EndpointSlices for Service {spec.namespace}/{spec.service_name} yet")
        for endpoint_slice in slices:
            _collect(spec, endpoint_slice, port_name, ready, terminating, problems)
    if not spec.models and spec.discovery_mode == "Static":
        problems.append("modelDiscovery.mode is Static but spec.models is empty; the set serves nothing")
    elif not spec.models:
        problems.append(AWAITING_DISCOVERY)
    return WorkerSet(
        key=spec.key,
        profile=spec.profile,
        kv_block_size=spec.kv_block_size,
        models=spec.models,
        endpoints=tuple(ready[address] for address in sorted(ready)),
        # An address ready in one slice and terminating in another is mid-move: count it once, as ready.
        terminating=len(terminating - ready.keys()),
        problems=tuple(problems),
        created=spec.created,
        data_parallel_size=spec.data_parallel_size,
        engine_kind=spec.engine_kind,
        discovery_mode=spec.discovery_mode,
        discovery_interval=spec.discovery_interval,
    )


def _service_port_name(spec: InferenceWorkerSet, service: Service | None, problems: list[str]) -> str | None:
    """The Service port's name ("" if unnamed), which is how EndpointSlices name the pods' port."""
    where = f"Service {spec.namespace}/{spec.service_name}"
    if service is None:
        problems.append(f"{where} not found; the set has no endpoints")
        return None
    ref = spec.service_port
    for port in service.ports:
        if (port.port == ref) if isinstance(ref, int) else (port.name == ref):
            return port.name
    listing = ", ".join(f"{p.name}={p.port}" if p.name else str(p.port) for p in service.ports) or "none"
    shown = str(ref) if isinstance(ref, int) else f'"{ref}"'
    problems.append(f"serviceRef.port {shown} is not a port of {where} (ports: {listing})")
    return None


def _collect(
    spec: InferenceWorkerSet,
    endpoint_slice: EndpointSlice,
    port_name: str,
    ready: dict[str, Endpoint],
    terminating: set[str],
    problems: list[str],
) -> None:
    """Add one slice's endpoints; an address seen in an earlier slice keeps its first record."""
    where = f"EndpointSlice {endpoint_slice.namespace}/{endpoint_slice.name}"
    if endpoint_slice.address_type == "FQDN":
        problems.append(f"{where} has addressType FQDN; only IPv4 and IPv6 endpoints are routed")
        return
    port = next((p.port for p in endpoint_slice.ports if p.name == port_name), None)
    if port is None:
        # Kubernetes publishes an empty slice without ports while a Service has no pods: not a problem.
        if endpoint_slice.endpoints:
            named = f'named "{port_name}"' if port_name else "without a name"
            problems.append(f"{where} has no port number {named}; its endpoints are not used")
        return
    ports = _SidePorts.resolve(spec, endpoint_slice, default_metrics=port, problems=problems)
    for endpoint in endpoint_slice.endpoints:
        address = join_host_port(endpoint.address, port)  # IPv4 or IPv6 (FQDN slices are skipped)
        if endpoint.terminating:
            terminating.add(address)
        # ready=None means "unknown" in Kubernetes; routing to it beats refusing the request.
        elif endpoint.ready is not False and address not in ready:
            ready[address] = Endpoint(
                EndpointAddress(address),
                endpoint.address,
                port,
                spec.key,
                endpoint.pod,
                kv_events_port=ports.kv_events,
                kv_replay_port=ports.kv_replay,
                metrics_port=ports.metrics,
            )


@dataclass(frozen=True, slots=True)
class _SidePorts:
    """The pod ports besides the serving one: KV events, their replay, Prometheus metrics."""

    kv_events: int | None
    kv_replay: int | None
    metrics: int

    @classmethod
    def resolve(
        cls,
        spec: InferenceWorkerSet,
        endpoint_slice: EndpointSlice,
        *,
        default_metrics: int,
        problems: list[str],
    ) -> _SidePorts:
        """Numbers are pod ports as given; names are looked up among the slice's (Service) port names."""
        named = {p.name: p.port for p in endpoint_slice.ports if p.port is not None}
        where = f"EndpointSlice {endpoint_slice.namespace}/{endpoint_slice.name}"

        def lookup(ref: IntOrString | None, field: str) -> int | None:
            if ref is None or isinstance(ref, int):
                return ref
            if ref in named:
                return named[ref]
            listing = ", ".join(sorted(n for n in named if n)) or "none"
            problems.append(f'spec.{field} "{ref}" is not a port name of {where} (names: {listing})')
            return None

        kv_events = kv_replay = None
        if spec.kv_events is not None:
            kv_events = lookup(spec.kv_events.port, "kvEvents.port")
            if spec.kv_events.replay_port is not None:
                kv_replay = lookup(spec.kv_events.replay_port, "kvEvents.replayPort")
            else:
                kv_replay = named.get(KV_REPLAY_PORT_NAME)
        if spec.metrics_port is not None:
            metrics = lookup(spec.metrics_port, "metricsPort") or default_metrics
        else:
            metrics = named.get(METRICS_PORT_NAME, default_metrics)
        return cls(kv_events, kv_replay, metrics)


def _age(ws: WorkerSet) -> tuple[bool, datetime, str]:
    """Oldest first; sets without a creation time count as newest, then namespace/name decides."""
    if ws.created is None:
        return (True, datetime.max, ws.key)
    created = datetime.fromisoformat(ws.created)
    if created.tzinfo is not None:
        created = created.astimezone(UTC).replace(tzinfo=None)
    return (False, created, ws.key)


def build_routes(sets: Iterable[WorkerSet]) -> tuple[dict[ModelName, Route], tuple[NameConflict, ...]]:
    """Every client-facing name -> one upstream model; the oldest claim wins, losers are reported.

    A route's endpoints are those of the winning sets that serve its upstream model
    (:meth:`WorkerSet.endpoints_serving`): all of a set's endpoints unless discovery learned less.
    """
    claims: dict[ModelName, list[_Claim]] = {}
    for ws in sorted(sets, key=_age):
        for model in ws.models:
            for client in (model.name, *model.aliases):
                claims.setdefault(client, []).append((ws, model.name))
    routes: dict[ModelName, Route] = {}
    conflicts: list[NameConflict] = []
    for client in sorted(claims):
        winner, upstream = claims[client][0]
        members = {ws.key: ws for ws, claimed in claims[client] if claimed == upstream}
        conflicts.extend(
            NameConflict(client, winner.key, upstream, ws.key, claimed)
            for ws, claimed in claims[client]
            if claimed != upstream
        )
        endpoints: dict[EndpointAddress, Endpoint] = {}
        for ws in members.values():
            for endpoint in ws.endpoints_serving(upstream):
                endpoints.setdefault(endpoint.address, endpoint)
        routes[client] = Route(
            client_name=client,
            upstream_model=upstream,
            worker_sets=tuple(sorted(members)),
            endpoints=tuple(endpoints[address] for address in sorted(endpoints)),
        )
    return routes, tuple(conflicts)
