"""Status conditions as Kubernetes shows them, and the schema's limits on what we write.

A condition's ``lastTransitionTime`` is when its ``status`` last changed, not when it was last
computed: :func:`render_conditions` carries the previous time over whenever the status is the same,
so that recomputing an unchanged world gives a byte-identical status (and therefore no write).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

#: ``status.conditions[]`` limits of the schema (inferenceworkerset.schema.json).
MAX_CONDITIONS = 8
MAX_TYPE = 316
MAX_REASON = 1024
MAX_MESSAGE = 32768
#: Messages that list things (problems, routes) stop well before the schema limit: a status is
#: read by people, and etcd stores it once per set.
MAX_LISTED = 10

ConditionStatus = Literal["True", "False", "Unknown"]

_ELLIPSIS = "…"


def truncate(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters (code points, as the API server counts them)."""
    if len(text) <= limit:
        return text
    return text[: max(limit - len(_ELLIPSIS), 0)] + _ELLIPSIS


def listing(items: Sequence[str], *, limit: int = MAX_LISTED, separator: str = "; ") -> str:
    """The first ``limit`` items joined, and how many more there are."""
    shown = separator.join(items[:limit])
    if len(items) > limit:
        shown += f"{separator}and {len(items) - limit} more"
    return shown


def format_time(moment: datetime) -> str:
    """RFC 3339 in UTC, whole seconds (``metav1.Time``)."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True, slots=True)
class Condition:
    """One condition as computed, before its ``lastTransitionTime`` is decided."""

    type: str
    status: ConditionStatus
    #: CamelCase, machine-readable.
    reason: str
    message: str


def render_conditions(
    conditions: Iterable[Condition],
    *,
    generation: int | None,
    previous: Any,
    now: datetime,
) -> list[dict[str, Any]]:
    """The ``status.conditions`` list: limits applied, transition times carried over from
    ``previous`` (the old ``status.conditions``, any shape) where a condition kept its status."""
    before = _by_type(previous)
    rendered: list[dict[str, Any]] = []
    for condition in list(conditions)[:MAX_CONDITIONS]:
        old = before.get(condition.type)
        stamp = format_time(now)
        if old is not None and old.get("status") == condition.status:
            kept = old.get("lastTransitionTime")
            if isinstance(kept, str) and kept:
                stamp = kept
        entry: dict[str, Any] = {
            "type": truncate(condition.type, MAX_TYPE),
            "status": condition.status,
            "reason": truncate(condition.reason, MAX_REASON),
            "message": truncate(condition.message, MAX_MESSAGE),
            "lastTransitionTime": stamp,
        }
        if generation is not None and generation >= 0:
            entry["observedGeneration"] = generation
        rendered.append(entry)
    return rendered


def _by_type(previous: Any) -> Mapping[str, Mapping[str, Any]]:
    if not isinstance(previous, list):
        return {}
    return {c["type"]: c for c in previous if isinstance(c, Mapping) and isinstance(c.get("type"), str)}
