"""What Kubernetes alone says about each worker set: its parsed spec, Service and endpoints.

The same parsers and join as the router's sources (:mod:`extproc.catalog`), so the endpoint counts
in the status are the ones ``serve`` routes to, and they stay right while ``serve`` is away. Pure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from extproc.catalog.build import build_catalog
from extproc.catalog.model import NameConflict, WorkerSet
from extproc.catalog.resources import (
    EndpointSlice,
    InferenceWorkerSet,
    InvalidObject,
    Service,
    object_identity,
    parse_endpoint_slice,
    parse_service,
    parse_worker_set,
)
from extproc.types import WorkerSetKey

_T = TypeVar("_T", Service, EndpointSlice)


@dataclass(frozen=True, slots=True)
class SetFacts:
    """One InferenceWorkerSet object and what it joins with."""

    #: The object as the API server returned it (metadata, spec, the current status).
    obj: Mapping[str, Any]
    #: The validated spec; None when :attr:`invalid` says why not.
    spec: InferenceWorkerSet | None = None
    invalid: str | None = None
    #: The Service ``spec.serviceRef`` names, None if absent (or invalid).
    service: Service | None = None
    #: The set joined with its Service and EndpointSlices (ready / terminating endpoints, problems).
    joined: WorkerSet | None = None
    #: Name conflicts this set loses on its declared models.
    conflicts: tuple[NameConflict, ...] = ()


def gather_facts(
    worker_sets: Iterable[Mapping[str, Any]],
    services: Iterable[Mapping[str, Any]],
    slices: Iterable[Mapping[str, Any]],
) -> dict[str, SetFacts]:
    """``namespace/name`` -> facts, for every worker set object. Services and slices that do not
    parse are left out, as the router's source leaves them out (and the Service then reads as
    missing in ResolvedRefs)."""
    objects: dict[str, Mapping[str, Any]] = {}
    specs: list[InferenceWorkerSet] = []
    invalid: dict[str, str] = {}
    for obj in worker_sets:
        _, namespace, name = object_identity(obj)
        key = f"{namespace}/{name}"
        objects[key] = obj
        try:
            specs.append(parse_worker_set(obj))
        except InvalidObject as exc:
            invalid[key] = str(exc)
    parsed_services = _parse_all(services, parse_service)
    parsed_slices = _parse_all(slices, parse_endpoint_slice)
    catalog = build_catalog(specs, parsed_services, parsed_slices)
    by_name = {(s.namespace, s.name): s for s in parsed_services}
    lost: dict[str, list[NameConflict]] = {}
    for conflict in catalog.conflicts:
        lost.setdefault(conflict.loser, []).append(conflict)
    facts = {key: SetFacts(obj, invalid=message) for key, message in invalid.items()}
    for spec in specs:
        key = spec.key
        facts[key] = SetFacts(
            objects[key],
            spec=spec,
            service=by_name.get((spec.namespace, spec.service_name)),
            joined=catalog.worker_sets.get(WorkerSetKey(key)),
            conflicts=tuple(lost.get(key, ())),
        )
    return facts


def _parse_all(objects: Iterable[Mapping[str, Any]], parse: Callable[[Mapping[str, Any]], _T]) -> list[_T]:
    parsed: list[_T] = []
    for obj in objects:
        try:
            parsed.append(parse(obj))
        except InvalidObject:
            continue
    return parsed
