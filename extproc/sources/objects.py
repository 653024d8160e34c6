"""Raw objects -> a validated :class:`Catalog`: the one step every source shares.

A source hands over plain dicts as ``kubectl get -o json`` (or ``-o yaml``) shows them, from a
file or from the API server. Each is parsed with :mod:`extproc.catalog.resources` and the valid
ones are joined by :func:`extproc.catalog.build.build_catalog`; an object that cannot be used
becomes an :class:`ObjectProblem` instead, and if an earlier version of it was valid, that version
stays in use, as the API server would have refused the edit. A caller that builds again and
again (the kube source) passes the last build's ``parsed`` back, so only objects whose
resourceVersion moved are parsed again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from extproc.catalog.build import build_catalog
from extproc.catalog.model import Catalog, ObjectProblem
from extproc.catalog.pools import POOL_API, InferencePool, Pod, join_pool, parse_pod, parse_pool
from extproc.catalog.resources import (
    LEGACY_OBJECTIVE_API,
    EndpointSlice,
    InferenceObjective,
    InferenceWorkerSet,
    InvalidObject,
    Resource,
    Service,
    UnsupportedKind,
    object_identity,
    parse_object,
)
from extproc.types import WorkerSetKey

#: (kind, namespace, name): what stays the same object across edits.
ObjectKey = tuple[str, str, str]
#: (kind, namespace, name, resourceVersion): one version of one object.
VersionKey = tuple[str, str, str, str]
#: An object a catalog is built from: a resource, or an InferencePool or a Pod (``--pool-name``).
Known = Resource | InferencePool | Pod
#: What parsing one version gave: the object, or why it cannot be used.
Parsed = Known | UnsupportedKind | InvalidObject
_POOL_PARSERS: dict[tuple[str, str], Callable[[Mapping[str, Any]], Known]] = {
    (POOL_API, "InferencePool"): parse_pool,
    ("v1", "Pod"): parse_pod,
}


@dataclass(frozen=True, slots=True)
class Compiled:
    """A built catalog and the valid objects it came from (the next build's fallbacks)."""

    catalog: Catalog
    valid: dict[ObjectKey, Known]
    #: Parse results of the objects that carry a resourceVersion, for the next build.
    parsed: dict[VersionKey, Parsed] = field(default_factory=dict)


def compile_objects(
    objects: Iterable[Any],
    previous: Mapping[ObjectKey, Known],
    parsed: Mapping[VersionKey, Parsed] | None = None,
    *,
    picks_for: WorkerSetKey | None = None,
) -> Compiled:
    """Parse every object and build the catalog; never raises for a bad object.

    ``previous`` holds the valid objects of the last build: an object that turned invalid keeps
    that version. An object given twice (possible in a file only) is used in its last version.
    ``parsed`` (the last build's) spares parsing objects whose resourceVersion did not move.
    InferencePools are joined with the Pods given (``picks_for``: the pool ``--pool-name`` names).
    """
    valid: dict[ObjectKey, Known] = {}
    problems: list[ObjectProblem] = []
    seen: dict[VersionKey, Parsed] = {}
    for obj in objects:
        _admit(obj, previous, valid, problems, parsed or {}, seen)
    resources = list(valid.values())
    pods = [r for r in resources if isinstance(r, Pod)]
    catalog = build_catalog(
        [r for r in resources if isinstance(r, InferenceWorkerSet)],
        [r for r in resources if isinstance(r, Service)],
        [r for r in resources if isinstance(r, EndpointSlice)],
        problems,
        [r for r in resources if isinstance(r, InferenceObjective)],
        [join_pool(r, pods) for r in resources if isinstance(r, InferencePool)],
        picks_for,
    )
    return Compiled(catalog, valid, seen)


def _admit(
    obj: Any,
    previous: Mapping[ObjectKey, Known],
    valid: dict[ObjectKey, Known],
    problems: list[ObjectProblem],
    parsed: Mapping[VersionKey, Parsed],
    seen: dict[VersionKey, Parsed],
) -> None:
    """Add one object to ``valid``, or record why not (and what stays in use instead)."""
    key = _object_key(obj)
    version = _version_key(obj, key)
    outcome = parsed.get(version) if version is not None else None
    if outcome is None:
        outcome = _parse(obj)
    if version is not None:
        seen[version] = outcome
    if isinstance(outcome, UnsupportedKind):
        problems.append(ObjectProblem(*key, outcome.detail))
        return
    if isinstance(outcome, InvalidObject):
        message = f"{outcome.field_path}: {outcome.detail}" if outcome.field_path else outcome.detail
        kept = valid.get(key, previous.get(key))
        if kept is not None:
            valid[key] = kept
            message += "; the previous valid version stays in use"
        problems.append(ObjectProblem(*key, message, kept_previous=kept is not None))
        return
    if key in valid:
        problems.append(
            ObjectProblem(*key, "defined more than once in the file; the last definition is used")
        )
    valid[key] = outcome


def _object_key(obj: Any) -> ObjectKey:
    """What stays the same object: a legacy InferenceObjective is not the llm-d.ai one of its name
    (both may exist; the build prefers the latter), so its kind is named with its group."""
    if not isinstance(obj, Mapping):
        return ("(no kind)", "default", "(no name)")
    kind, namespace, name = object_identity(obj)
    if obj.get("apiVersion") == LEGACY_OBJECTIVE_API:
        kind = f"{kind}.{LEGACY_OBJECTIVE_API.split('/')[0]}"
    return kind, namespace, name


def _parse(obj: Any) -> Parsed:
    try:
        parser = (
            _POOL_PARSERS.get((str(obj.get("apiVersion")), str(obj.get("kind"))))
            if isinstance(obj, Mapping)
            else None
        )
        if parser is not None:
            return parser(obj)
        return parse_object(obj)
    except InvalidObject as exc:
        return exc.with_traceback(None)  # kept between builds: do not keep the frames too


def _version_key(obj: Any, key: ObjectKey) -> VersionKey | None:
    """None for objects without a resourceVersion (a file's): those are always parsed."""
    meta = obj.get("metadata") if isinstance(obj, Mapping) else None
    version = meta.get("resourceVersion") if isinstance(meta, Mapping) else None
    return (*key, version) if isinstance(version, str) and version else None


class ProblemLog:
    """Logs each problem of a catalog once, when it appears, rather than on every rebuild."""

    def __init__(self, logger: logging.Logger, origin: str) -> None:
        self._logger = logger
        self._origin = origin  # e.g. "path=/etc/catalog.yaml", first in each line
        self._reported: frozenset[str] = frozenset()

    def report(self, catalog: Catalog) -> int:
        """Log the problems not logged before; returns how many problems the catalog has."""
        messages = [f"{p.kind} {p.namespace}/{p.name}: {p.message}" for p in catalog.problems]
        messages += [c.message() for c in catalog.conflicts]
        messages += [
            f"InferenceWorkerSet {k}: {m}" for k, ws in catalog.worker_sets.items() for m in ws.problems
        ]
        for message in messages:
            if message not in self._reported:
                self._logger.warning("catalog problem %s problem=%r", self._origin, message)
        self._reported = frozenset(messages)
        return len(messages)
