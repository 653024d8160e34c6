"""Field checks for plain dicts (parsed YAML or Kubernetes JSON), the way an OpenAPI schema checks.

Each check takes the raw value and its field path, and returns the value typed or raises
:class:`FieldError`. They check types as YAML, JSON and OpenAPI see them (``true`` is not an
integer, though Python's bool is an int), absence (``None``: optional fields get an empty default,
required ones fail), non-empty required strings, and the schema's limits: maxLength, maxItems,
minimum/maximum, pattern. Timestamps are normalised to RFC 3339 UTC.

Messages name the field, never the object: a failure is ``FieldError(path, detail)`` with
``path`` written as kubectl writes it (``spec.models[0].aliases[1]``) and ``detail`` saying what
the field must be and, via :func:`show`, what it got (``must be a string, got 7``). The caller
knows the object and prefixes it: :mod:`extproc.catalog.resources` turns each FieldError into
``InvalidObject`` with the message ``Kind namespace/name: path: detail``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Literal, overload

from extproc.errors import ExtprocError

#: A Kubernetes ``int-or-string`` port: a number, or the name of one of the Service's ports.
IntOrString = int | str

_SHOW_MAX = 80


class FieldError(ExtprocError):
    """One field fails its check; ``str()`` is ``path: detail``."""

    def __init__(self, path: str, detail: str) -> None:
        super().__init__(f"{path}: {detail}")
        self.path, self.detail = path, detail


def show(value: Any) -> str:
    """JSON-ish, as the user wrote it in YAML: strings quoted, booleans lower-case, cut at 80.

    Only what is shown is ever serialized: the walk stops once 80 characters are written, so a huge
    value (or one that YAML aliases make exponentially large) costs no more than a small one.
    """
    pieces: list[str] = []
    room = _SHOW_MAX + 1

    def put(text: str) -> bool:
        """Append; True once there is no room left (the caller stops walking)."""
        nonlocal room
        pieces.append(text[:room])
        room -= len(pieces[-1])
        return room <= 0

    def walk(item: Any) -> bool:
        if isinstance(item, Mapping):
            if put("{"):
                return True
            for n, (key, inner) in enumerate(item.items()):
                if (n and put(", ")) or walk(str(key)) or put(": ") or walk(inner):
                    return True
            return put("}")
        if isinstance(item, list | tuple):
            if put("["):
                return True
            for n, inner in enumerate(item):
                if (n and put(", ")) or walk(inner):
                    return True
            return put("]")
        if isinstance(item, str):
            item = item[:room]  # a long string is cut before it is escaped
        return put(json.dumps(item, default=str, ensure_ascii=False))

    walk(value)
    text = "".join(pieces)
    return text if len(text) <= _SHOW_MAX else text[: _SHOW_MAX - 3] + "..."


def mapping(value: Any, path: str, *, required: bool = False) -> Mapping[str, Any]:
    """A mapping; an absent optional one is ``{}`` so that nested ``.get`` calls need no guard."""
    if value is None and not required:
        return {}
    if value is None:
        raise FieldError(path, "required field is missing")
    if not isinstance(value, Mapping):
        raise FieldError(path, f"must be a mapping, got {show(value)}")
    return value


def array(value: Any, path: str, max_items: int) -> list[Any]:
    """A list of at most ``max_items`` (items are not checked); absent is ``[]``."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise FieldError(path, f"must be a list, got {show(value)}")
    if len(value) > max_items:
        raise FieldError(path, f"must have at most {max_items} items, got {len(value)}")
    return value


def string(value: Any, path: str, *, required: bool = False, max_len: int | None = None) -> str:
    """A string; ``required`` also means non-empty, as Kubernetes names and model names are."""
    if value is None and not required:
        return ""
    if value is None:
        raise FieldError(path, "required field is missing")
    if not isinstance(value, str):
        raise FieldError(path, f"must be a string, got {show(value)}")
    if required and not value:
        raise FieldError(path, "must not be empty")
    if max_len is not None and len(value) > max_len:
        raise FieldError(path, f"must be at most {max_len} characters, got {len(value)}")
    return value


def integer(value: Any, path: str, lo: int, hi: int) -> int:
    """A required integer in ``[lo, hi]``."""
    if value is None:
        raise FieldError(path, "required field is missing")
    # bool is an int subclass in Python but not an integer in YAML, JSON or OpenAPI.
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise FieldError(path, f"must be an integer between {lo} and {hi}, got {show(value)}")
    return value


@overload
def int_or_string(value: Any, path: str, *, required: Literal[True]) -> IntOrString: ...
@overload
def int_or_string(value: Any, path: str, *, required: bool = False) -> IntOrString | None: ...
def int_or_string(value: Any, path: str, *, required: bool = False) -> IntOrString | None:
    """A port: a number in 1-65535, or a non-empty port name; absent optional is None."""
    if value is None and not required:
        return None
    if value is None:
        raise FieldError(path, "required field is missing")
    if isinstance(value, str) and value:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise FieldError(path, f"must be a port number (1-65535) or a port name, got {show(value)}")
    return value


def boolean(value: Any, path: str) -> bool | None:
    """An optional boolean; None (absent) stays None, for Kubernetes' "unknown"."""
    if value is not None and not isinstance(value, bool):
        raise FieldError(path, f"must be true or false, got {show(value)}")
    return value


def match(value: str, pattern: str, path: str, what: str) -> None:
    """``value`` matches ``pattern`` whole; ``what`` describes it for people, the pattern follows."""
    if re.fullmatch(pattern, value) is None:
        raise FieldError(path, f"must be {what} (pattern {pattern}), got {show(value)}")


def timestamp(value: Any, path: str) -> str:
    """RFC 3339 in UTC; YAML turns unquoted timestamps into datetimes, the API sends strings.

    A datetime without a zone is taken as UTC. The result ends in ``Z``, so results compare as text.
    """
    moment = value if isinstance(value, datetime) else None
    if isinstance(value, str):
        try:
            moment = datetime.fromisoformat(value)
        except ValueError:
            moment = None
    if moment is None:
        raise FieldError(path, f"must be an RFC 3339 date-time, got {show(value)}")
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC).isoformat().replace("+00:00", "Z")
