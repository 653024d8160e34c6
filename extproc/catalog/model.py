"""The routing table: immutable snapshots that the request path reads without locks.

A source (file or Kubernetes) builds a new :class:`Catalog` whenever its objects change and
publishes it whole; readers keep whatever snapshot they started with, so a reload never tears a
decision in half.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from extproc.types import EndpointAddress, EngineKind, ModelName, WorkerSetKey

#: Where a worker set's models come from (``spec.modelDiscovery.mode``).
DiscoveryMode = Literal["Endpoint", "Static"]


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One model-server pod port that can take requests."""

    address: EndpointAddress
    ip: str
    port: int
    worker_set: WorkerSetKey
    #: The pod behind the endpoint (EndpointSlice ``targetRef.name``), for people reading state.
    pod: str | None = None
    #: The pod's KV-event PUB port (``spec.kvEvents.port``), None when the set publishes none.
    kv_events_port: int | None = None
    #: The pod's KV-event replay port (``spec.kvEvents.replayPort``, else the port named ``kv-replay``).
    kv_replay_port: int | None = None
    #: The pod's Prometheus port (``spec.metricsPort``, else the port named ``metrics``, else ``port``).
    metrics_port: int | None = None


@dataclass(frozen=True, slots=True)
class Objective:
    """An InferenceObjective: the priority of requests that name it, in one worker set (pool)."""

    namespace: str
    name: str
    #: Higher is served first; negative is sheddable (refused at once while saturated).
    priority: int
    #: The worker set ``spec.poolRef.name`` names, in the objective's namespace.
    pool: WorkerSetKey


@dataclass(frozen=True, slots=True)
class ServedModel:
    """A model a worker set serves, with the extra client-facing names it answers to."""

    name: ModelName
    aliases: tuple[ModelName, ...] = ()


@dataclass(frozen=True, slots=True)
class WorkerSet:
    """A validated InferenceWorkerSet joined with its Service and EndpointSlices."""

    key: WorkerSetKey
    profile: str
    kv_block_size: int
    models: tuple[ServedModel, ...]
    #: Ready endpoints, sorted by address.
    endpoints: tuple[Endpoint, ...]
    terminating: int = 0
    #: Problems that leave the set (partly) unroutable, e.g. a missing Service; human-readable.
    problems: tuple[str, ...] = ()
    #: ``metadata.creationTimestamp`` (RFC 3339) if known; older sets win name conflicts.
    created: str | None = None
    #: Data-parallel ranks per pod, each with its own KV cache and event ports (+ rank).
    data_parallel_size: int = 1
    #: The engine its pods run, when the set declares it (``kinference.buoyant.io/engine``).
    engine_kind: EngineKind | None = None
    #: ``spec.modelDiscovery.mode``. The default is Static ("models as given") so that a set built by
    #: hand keeps its old meaning; :func:`~extproc.catalog.build.build_catalog` copies the spec's mode,
    #: whose CRD default is Endpoint.
    discovery_mode: DiscoveryMode = "Static"
    #: ``spec.modelDiscovery.interval`` as written (``30s``, ``1m30s``, ``500ms``).
    discovery_interval: str = "30s"
    #: Set by :func:`~extproc.catalog.discovered.apply_discovery` once endpoints of an Endpoint-mode set
    #: answered: address -> upstream names that endpoint serves (answered endpoints only). None means
    #: ``models`` came from the spec and every ready endpoint serves every one of them.
    served: Mapping[EndpointAddress, tuple[ModelName, ...]] | None = None

    def endpoints_serving(self, model: ModelName) -> tuple[Endpoint, ...]:
        """The ready endpoints that serve ``model``: all of them unless discovery said otherwise, since
        an adapter may be loaded on only some pods and a request for it must not reach the others."""
        served = self.served
        if served is None:
            return self.endpoints
        return tuple(e for e in self.endpoints if model in served.get(e.address, ()))


@dataclass(frozen=True, slots=True)
class Route:
    """Where a client-facing model name goes: the upstream name and every endpoint serving it."""

    client_name: ModelName
    upstream_model: ModelName
    worker_sets: tuple[WorkerSetKey, ...]
    #: Ready endpoints of those worker sets, deduplicated and sorted by address.
    endpoints: tuple[Endpoint, ...]

    @property
    def is_alias(self) -> bool:
        return self.client_name != self.upstream_model


@dataclass(frozen=True, slots=True)
class NameConflict:
    """Two worker sets claim one client-facing name for different upstream models."""

    client_name: ModelName
    winner: WorkerSetKey
    winner_upstream: ModelName
    loser: WorkerSetKey
    loser_upstream: ModelName

    def message(self) -> str:
        return (
            f"model name {self.client_name!r} is claimed by {self.winner} (upstream "
            f"{self.winner_upstream!r}) and by {self.loser} (upstream {self.loser_upstream!r}); "
            f"{self.winner} is older and keeps it"
        )


@dataclass(frozen=True, slots=True)
class ObjectProblem:
    """An object the source rejected, or kept at its last valid version, and why."""

    kind: str
    namespace: str
    name: str
    message: str
    #: True when an earlier valid version of the object is still in use.
    kept_previous: bool = False


@dataclass(frozen=True, slots=True, weakref_slot=True)
class Catalog:
    """One consistent view of worker sets, endpoints and model names."""

    worker_sets: Mapping[WorkerSetKey, WorkerSet] = field(default_factory=dict)
    #: Client-facing name (upstream name or alias) -> route.
    routes: Mapping[ModelName, Route] = field(default_factory=dict)
    conflicts: tuple[NameConflict, ...] = ()
    problems: tuple[ObjectProblem, ...] = ()
    #: (endpoint, upstream model) -> the engine's context window in tokens (``max_model_len`` of
    #: ``/v1/models``; an adapter inherits its base model's). Absent = unknown: do not filter on it.
    context_windows: Mapping[tuple[EndpointAddress, ModelName], int] = field(default_factory=dict)
    #: InferenceObjective name -> the objectives of that name (one per namespace, at most).
    objectives: Mapping[str, tuple[Objective, ...]] = field(default_factory=dict)
    #: The InferencePool this serve is the endpoint picker of (``--pool-name``), whether or not
    #: the cluster has it now; None: worker sets only.
    picks_for: WorkerSetKey | None = None

    def resolve(self, client_name: str) -> Route | None:
        return self.routes.get(ModelName(client_name))

    def unavailable(self) -> str | None:
        """Why a model no route knows may still be one the pool serves (answer 503, not 404): the
        pool serve picks for is missing, has no ready endpoint, or none has said what it serves."""
        if self.picks_for is None:
            return None
        pool = self.worker_sets.get(self.picks_for)
        if pool is None:
            return f"InferencePool {self.picks_for} is not there (deleted, or not created yet)"
        if not pool.endpoints:
            return f"InferencePool {self.picks_for} has no ready endpoint"
        if not pool.served:
            return (
                f"the endpoints of InferencePool {self.picks_for} have not said which models they serve yet"
            )
        return None

    def objective(self, name: str, route: Route) -> Objective | None:
        """The objective called ``name`` whose pool is one of ``route``'s worker sets, or None."""
        for objective in self.objectives.get(name, ()):
            if objective.pool in route.worker_sets:
                return objective
        return None

    def context_window(self, address: EndpointAddress, model: ModelName) -> int | None:
        """Tokens ``address`` accepts for ``model`` (prompt + output), None if unknown."""
        return self.context_windows.get((address, model))

    def to_debug(self) -> dict[str, Any]:
        """A JSON-ready description for ``/debug/state``."""
        return {
            "workerSets": {
                key: {
                    "profile": ws.profile,
                    "kvBlockSize": ws.kv_block_size,
                    "models": [{"name": m.name, "aliases": list(m.aliases)} for m in ws.models],
                    "endpoints": [_endpoint_debug(e) for e in ws.endpoints],
                    "terminating": ws.terminating,
                    "problems": list(ws.problems),
                    "dataParallelSize": ws.data_parallel_size,
                    "engine": ws.engine_kind,
                    "modelDiscovery": _discovery_debug(ws),
                }
                for key, ws in sorted(self.worker_sets.items())
            },
            "routes": {
                name: {
                    "upstreamModel": r.upstream_model,
                    "workerSets": list(r.worker_sets),
                    "endpoints": [e.address for e in r.endpoints],
                    **_windows_debug(self, r),
                }
                for name, r in sorted(self.routes.items())
            },
            "objectives": {
                f"{o.namespace}/{o.name}": {"priority": o.priority, "pool": o.pool}
                for named in self.objectives.values()
                for o in named
            },
            "picksFor": self.picks_for,
            "conflicts": [c.message() for c in self.conflicts],
            "problems": [
                {
                    "object": f"{p.kind} {p.namespace}/{p.name}",
                    "message": p.message,
                    "keptPrevious": p.kept_previous,
                }
                for p in self.problems
            ],
        }


def _discovery_debug(ws: WorkerSet) -> dict[str, Any]:
    """Mode and interval, plus what each endpoint said it serves once discovery has answers."""
    entry: dict[str, Any] = {"mode": ws.discovery_mode}
    if ws.discovery_mode == "Endpoint":
        entry["interval"] = ws.discovery_interval
        entry["learned"] = None if ws.served is None else {a: list(n) for a, n in sorted(ws.served.items())}
    return entry


def _windows_debug(catalog: Catalog, route: Route) -> dict[str, Any]:
    """``contextWindows`` of a route's endpoints, only when some are known (Static sets have none)."""
    windows = {
        e.address: window
        for e in route.endpoints
        if (window := catalog.context_window(e.address, route.upstream_model)) is not None
    }
    return {"contextWindows": windows} if windows else {}


def _endpoint_debug(endpoint: Endpoint) -> dict[str, Any]:
    entry: dict[str, Any] = {"address": endpoint.address, "pod": endpoint.pod}
    if endpoint.kv_events_port is not None:
        entry["kvEventsPort"] = endpoint.kv_events_port
        entry["kvReplayPort"] = endpoint.kv_replay_port
    if endpoint.metrics_port is not None and endpoint.metrics_port != endpoint.port:
        entry["metricsPort"] = endpoint.metrics_port
    return entry
