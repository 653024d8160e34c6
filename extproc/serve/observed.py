"""What ``serve`` knows about each worker set, compact and stable, for the reconciler sidecar.

``/debug/state`` is for people and changes shape as the router grows; the reconciler reads only
the ``workerSetStatus`` section built here. It names each set by ``namespace/name`` and says what
the router does with it right now: the models it routes (after model discovery), how many ready
endpoints serve each and their context windows, how many endpoints' KV-event streams are connected
(and how many publish blocks ``kvBlockSize`` does not divide), and the problems the catalog found.
Pure: the caller passes the current catalog, the KV subscribers' stats and the index's block-size
verdicts, so equal inputs give an equal (JSON-ready) answer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from extproc.catalog.model import Catalog, WorkerSet
from extproc.kvindex.events import Source
from extproc.types import WorkerSetKey

#: The ``kind`` of rejected objects that concern a worker set.
_WORKER_SET_KIND = "InferenceWorkerSet"


class Subscription(Protocol):
    """What is read of a KV-event subscriber's stats."""

    @property
    def connected(self) -> bool: ...


def observe_worker_sets(
    catalog: Catalog,
    subscriptions: Mapping[Source, Subscription],
    *,
    profile_known: Callable[[str], bool] = lambda _name: True,
    block_size_mismatch: Callable[[Source], tuple[int, int] | None] = lambda _source: None,
    engine_problems: Mapping[WorkerSetKey, Sequence[str]] | None = None,
) -> dict[str, Any]:
    """``namespace/name`` -> the router's view of that set (see the module docstring).

    Sets that the source rejected without a previous version to keep appear too, with
    ``routed: false`` and the rejection under ``rejected``. A set naming a profile that
    ``profile_known`` denies still routes (with the default profile) and says so in ``problems``,
    as do ``engine_problems`` (endpoints whose metrics contradict the set's declared engine).
    """
    rejected: dict[str, list[str]] = {}
    for problem in catalog.problems:
        if problem.kind == _WORKER_SET_KIND:
            rejected.setdefault(f"{problem.namespace}/{problem.name}", []).append(problem.message)
    lost: dict[str, list[str]] = {}
    for conflict in catalog.conflicts:
        lost.setdefault(conflict.loser, []).append(conflict.message())
    observed: dict[str, Any] = {}
    for key in sorted(set(catalog.worker_sets) | set(rejected)):
        ws = catalog.worker_sets.get(WorkerSetKey(key))
        entry: dict[str, Any] = {"routed": False}
        if ws is not None:
            entry = _observe(catalog, ws, subscriptions, profile_known(ws.profile), block_size_mismatch)
            entry["problems"].extend((engine_problems or {}).get(ws.key, ()))
        entry["conflicts"] = lost.get(key, [])
        entry["rejected"] = rejected.get(key, [])
        observed[key] = entry
    return observed


def _observe(
    catalog: Catalog,
    ws: WorkerSet,
    subscriptions: Mapping[Source, Subscription],
    profile_known: bool,
    block_size_mismatch: Callable[[Source], tuple[int, int] | None],
) -> dict[str, Any]:
    models = []
    for model in ws.models:
        serving = ws.endpoints_serving(model.name)
        entry: dict[str, Any] = {
            "upstreamName": model.name,
            "aliases": list(model.aliases),
            "readyEndpoints": len(serving),
        }
        windows = [
            window for e in serving if (window := catalog.context_window(e.address, model.name)) is not None
        ]
        if windows:
            entry["contextWindow"] = {"min": min(windows), "max": max(windows)}
        models.append(entry)
    publishing = [e for e in ws.endpoints if e.kv_events_port is not None]
    # An endpoint counts once every data-parallel rank's stream is connected: a rank whose events
    # are missing leaves part of the pod's cache invisible to routing.
    subscribed = sum(
        all(
            (sub := subscriptions.get(Source(e.address, rank))) is not None and sub.connected
            for rank in range(ws.data_parallel_size)
        )
        for e in publishing
    )
    kv: dict[str, Any] = {"configured": bool(publishing), "subscribedEndpoints": subscribed}
    # Engines whose blocks kvBlockSize does not divide: their events are skipped, so their caches
    # are invisible to routing (SGLang's default page size is 1, vLLM's block 16).
    engine_sizes = []
    for e in publishing:
        verdicts = [
            v for rank in range(ws.data_parallel_size) if (v := block_size_mismatch(Source(e.address, rank)))
        ]
        if verdicts:
            engine_sizes.append(min(engine for _declared, engine in verdicts))
    if engine_sizes:
        kv["blockSizeMismatch"] = {"endpoints": len(engine_sizes), "engineBlockSize": min(engine_sizes)}
    return {
        "routed": True,
        "endpoints": {"ready": len(ws.endpoints), "terminating": ws.terminating},
        "models": models,
        # "configured": some ready endpoint has a KV-event port (the spec alone says whether the set
        # asks for events; this says whether the router has anywhere to subscribe).
        "kvEvents": kv,
        "discovery": {
            "mode": ws.discovery_mode,
            # Static sets need no answer: their models are the spec's.
            "answered": ws.discovery_mode == "Static" or ws.served is not None,
        },
        "profile": {"name": ws.profile, "known": profile_known},
        "problems": list(ws.problems) + ([] if profile_known else [_unknown_profile(ws.profile)]),
    }


def _unknown_profile(name: str) -> str:
    return f'profile "{name}" is not defined in --profiles; TTFT predictions use the built-in "default"'
