"""Fold what endpoints said they serve (``GET /v1/models``) into a declared :class:`Catalog`.

``modelDiscovery.mode: Endpoint`` makes a worker set's models whatever its endpoints list, so a
LoRA adapter loaded on two of three pods routes to those two only, and a renamed model needs no
edit of the InferenceWorkerSet. :func:`apply_discovery` is pure: the poller
(:mod:`extproc.engines.discovery`) owns the I/O, and a source's catalog plus the poller's latest
answers always give the same routing table, whichever changed last.

The types of an answer live here rather than next to the poller so that the catalog package does
not depend on the engines package.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from extproc.catalog.build import AWAITING_DISCOVERY, build_routes
from extproc.catalog.model import Catalog, ServedModel, WorkerSet
from extproc.types import EndpointAddress, ModelName, WorkerSetKey


@dataclass(frozen=True, slots=True)
class DiscoveredModel:
    """One card of ``/v1/models``: a name clients may send to that endpoint."""

    name: ModelName
    #: The base model of a LoRA adapter; None for a base model (or any served name of it).
    parent: ModelName | None = None
    #: The context window in tokens; vLLM gives it for base models and null for adapters.
    max_model_len: int | None = None
    #: What the name was loaded from (model path or id, adapter path); informational.
    root: str | None = None


@dataclass(frozen=True, slots=True)
class EndpointModels:
    """One endpoint's answer: the models it serves, in the order it listed them, without duplicates."""

    models: tuple[DiscoveredModel, ...] = ()
    #: Cards that were malformed, repeated or over the limit, and were left out.
    skipped: int = 0

    def names(self) -> tuple[ModelName, ...]:
        return tuple(m.name for m in self.models)

    def context_windows(self) -> dict[ModelName, int]:
        """Name -> window. An adapter has its parent's; failing that the engine's one window, if its
        base models agree (vLLM has one ``max_model_len`` per engine); else it is left unknown."""
        bases = {m.name: m.max_model_len for m in self.models if m.max_model_len is not None}
        distinct = set(bases.values())
        shared = next(iter(distinct)) if len(distinct) == 1 else None
        windows: dict[ModelName, int] = {}
        for model in self.models:
            window = model.max_model_len
            if window is None and model.parent is not None:
                window = bases.get(model.parent)
            if window is None:
                window = shared
            if window is not None:
                windows[model.name] = window
        return windows


def apply_discovery(catalog: Catalog, learned: Mapping[EndpointAddress, EndpointModels]) -> Catalog:
    """``catalog`` (as a source built it) with Endpoint-mode sets serving what their endpoints listed.

    - An Endpoint-mode set with at least one answered endpoint serves the union of the names its
      endpoints listed (base models and adapters), each with the aliases of the ``spec.models``
      entry of the same name; an endpoint routes a name only if it listed it, and endpoints that
      have not answered yet route nothing (what they serve is unknown).
    - An Endpoint-mode set none of whose endpoints has answered keeps ``spec.models`` on all its
      endpoints (or serves nothing, with its existing problem): a router that starts, or whose
      polls fail, keeps routing what the user declared.
    - Static sets are unchanged. Routes are rebuilt by the rules of :func:`build_catalog` (the
      oldest set keeps a contested name, the others become conflicts).

    ``catalog`` must be the declared one, not an earlier result: ``spec.models`` is read from it.
    """
    if not any(ws.discovery_mode == "Endpoint" for ws in catalog.worker_sets.values()):
        return catalog
    sets: dict[WorkerSetKey, WorkerSet] = {}
    windows: dict[tuple[EndpointAddress, ModelName], int] = dict(catalog.context_windows)
    for key, ws in catalog.worker_sets.items():
        answered = {e.address: learned[e.address] for e in ws.endpoints if e.address in learned}
        if ws.discovery_mode != "Endpoint" or not answered:
            sets[key] = ws
            continue
        sets[key] = _discovered_set(ws, answered)
        for address, models in answered.items():
            for name, window in models.context_windows().items():
                windows.setdefault((address, name), window)
    routes, conflicts = build_routes(sets.values())
    return replace(catalog, worker_sets=sets, routes=routes, conflicts=conflicts, context_windows=windows)


def _discovered_set(ws: WorkerSet, answered: Mapping[EndpointAddress, EndpointModels]) -> WorkerSet:
    """The set with ``models`` and ``served`` from its answered endpoints, and problems to match."""
    served = {address: tuple(sorted(models.names())) for address, models in sorted(answered.items())}
    taken = {name for listed in served.values() for name in listed}
    names = sorted(taken)
    declared = {m.name: m.aliases for m in ws.models}
    problems = [p for p in ws.problems if p != AWAITING_DISCOVERY]
    models: list[ServedModel] = []
    for name in names:
        aliases: list[ModelName] = []
        for alias in declared.get(name, ()):
            if alias in taken:
                # A name an engine serves means that model; an alias must not take it over.
                problems.append(
                    f"alias {alias!r} of model {name!r} is itself a model the endpoints serve; "
                    "the alias is ignored"
                )
            else:
                aliases.append(alias)
        models.append(ServedModel(name, tuple(aliases)))
    missing = [m.name for m in ws.models if m.name not in taken]
    if missing:
        shown = ", ".join(repr(n) for n in missing)
        problems.append(
            f"spec.models lists {shown} but no endpoint that answered serves it; its aliases route nowhere"
        )
    if not names:
        problems.append("the endpoints answered but list no models at /v1/models; the set serves nothing")
    return replace(ws, models=tuple(models), served=served, problems=tuple(problems))
