"""The routing table: immutable snapshots that the request path reads without locks.

A source (file or Kubernetes) builds a new :class:`Catalog` whenever its objects change and
publishes it whole; readers keep whatever snapshot they started with, so a reload never tears a
decision in half.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from extproc.types import EndpointAddress, ModelName, WorkerSetKey


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


@dataclass(frozen=True, slots=True)
class Catalog:
    """One consistent view of worker sets, endpoints and model names."""

    worker_sets: Mapping[WorkerSetKey, WorkerSet] = field(default_factory=dict)
    #: Client-facing name (upstream name or alias) -> route.
    routes: Mapping[ModelName, Route] = field(default_factory=dict)
    conflicts: tuple[NameConflict, ...] = ()
    problems: tuple[ObjectProblem, ...] = ()

    def resolve(self, client_name: str) -> Route | None:
        return self.routes.get(ModelName(client_name))

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
                }
                for key, ws in sorted(self.worker_sets.items())
            },
            "routes": {
                name: {
                    "upstreamModel": r.upstream_model,
                    "workerSets": list(r.worker_sets),
                    "endpoints": [e.address for e in r.endpoints],
                }
                for name, r in sorted(self.routes.items())
            },
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


def _endpoint_debug(endpoint: Endpoint) -> dict[str, Any]:
    entry: dict[str, Any] = {"address": endpoint.address, "pod": endpoint.pod}
    if endpoint.kv_events_port is not None:
        entry["kvEventsPort"] = endpoint.kv_events_port
        entry["kvReplayPort"] = endpoint.kv_replay_port
    if endpoint.metrics_port is not None and endpoint.metrics_port != endpoint.port:
        entry["metricsPort"] = endpoint.metrics_port
    return entry
