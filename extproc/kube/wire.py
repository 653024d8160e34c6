"""Bytes from the API server -> list pages and watch events (pure; no sockets, no asyncio).

A watch answer is a stream of JSON documents, one per line (``{"type": ..., "object": ...}``);
a list answer is one JSON document with ``items`` and ``metadata.resourceVersion`` /
``metadata.continue``. Both are checked here just enough that what leaves this module is safe to
apply: every object is a mapping with a name and a resourceVersion. An ``ERROR`` event ends the
watch as a :class:`~extproc.errors.KubeApiError` carrying the status code inside it (410 = the
resourceVersion is too old: list again).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from extproc.errors import KubeApiError
from extproc.kube.resources import ResourceType

#: Raw JSON object as the API server shows it (``kubectl get -o json``).
RawObject = dict[str, Any]
ChangeType = Literal["ADDED", "MODIFIED", "DELETED", "BOOKMARK"]
_CHANGE_TYPES: frozenset[str] = frozenset(("ADDED", "MODIFIED", "DELETED", "BOOKMARK"))


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change, or a BOOKMARK (only ``object.metadata.resourceVersion`` is meaningful there)."""

    type: ChangeType
    object: RawObject

    @property
    def resource_version(self) -> str:
        return str(self.object["metadata"]["resourceVersion"])


@dataclass(frozen=True, slots=True)
class ListPage:
    """One page of a paginated list; ``continue_token`` is "" on the last page."""

    items: list[RawObject]
    resource_version: str
    continue_token: str


@dataclass(frozen=True, slots=True)
class Oversized:
    """A watch line longer than the cap: dropped whole, so the stream stays in step."""

    size: int


class LineSplitter:
    """Cuts a byte stream into lines, holding at most ``max_line`` bytes of an unfinished line.

    A line over the cap is not buffered further: its bytes are skipped up to the next newline and
    reported once as :class:`Oversized`, so memory stays bounded whatever the server sends.
    """

    def __init__(self, max_line: int) -> None:
        if max_line < 1:
            raise ValueError(f"max_line must be at least 1, got {max_line}")
        self.max_line = max_line
        self._buffer = bytearray()
        self._skipped = 0  # > 0 while inside an oversized line: bytes dropped so far

    def feed(self, chunk: bytes) -> Iterator[bytes | Oversized]:
        """Complete lines in ``chunk`` (blank lines skipped), in order."""
        start = 0
        while start < len(chunk):
            end = chunk.find(b"\n", start)
            piece = chunk[start:] if end < 0 else chunk[start:end]
            start = len(chunk) if end < 0 else end + 1
            if self._skipped:
                self._skipped += len(piece)
            elif len(self._buffer) + len(piece) > self.max_line:
                self._skipped = len(self._buffer) + len(piece)
                self._buffer.clear()
            else:
                self._buffer += piece
            if end < 0:
                continue
            if self._skipped:
                yield Oversized(self._skipped)
                self._skipped = 0
            elif self._buffer.strip():
                yield bytes(self._buffer)
            self._buffer.clear()


def decode_event(line: bytes, resource_type: ResourceType) -> WatchEvent:
    """One watch line -> a WatchEvent; raises KubeApiError for ERROR events and malformed lines.

    Objects get ``apiVersion`` and ``kind`` if the server left them out.
    """
    document = json_object(line, "watch event")
    kind = document.get("type")
    obj = document.get("object")
    if kind == "ERROR":
        raise status_error(obj, "watch")
    if kind not in _CHANGE_TYPES or not isinstance(obj, dict):
        raise KubeApiError(0, f"malformed watch event: type {kind!r}, object {type(obj).__name__}")
    _check_object(obj, resource_type, "watch event", bookmark=kind == "BOOKMARK")
    event_type: ChangeType = kind  # checked against _CHANGE_TYPES above
    return WatchEvent(event_type, complete(obj, resource_type))


def decode_page(body: bytes, resource_type: ResourceType) -> ListPage:
    """A list answer -> its items (completed with kind and apiVersion) and where to go on."""
    document = json_object(body, "list")
    metadata = document.get("metadata")
    items = document.get("items")
    if not isinstance(metadata, dict) or not isinstance(items, list | None):
        raise KubeApiError(0, f"malformed {resource_type.kind} list: no metadata or items")
    version = metadata.get("resourceVersion")
    if not isinstance(version, str) or not version:
        raise KubeApiError(0, f"malformed {resource_type.kind} list: no metadata.resourceVersion")
    completed = []
    for item in items or ():
        if not isinstance(item, dict):
            raise KubeApiError(0, f"malformed {resource_type.kind} list: an item is not an object")
        _check_object(item, resource_type, "list item")
        completed.append(complete(item, resource_type))
    token = metadata.get("continue")
    return ListPage(completed, version, token if isinstance(token, str) else "")


def complete(obj: RawObject, resource_type: ResourceType) -> RawObject:
    """The object as ``kubectl get -o json`` prints it.

    ``apiVersion`` and ``kind`` are filled in (list items come without), first as kubectl puts
    them, and ``metadata.managedFields`` is dropped as kubectl does by default: it is bookkeeping
    of server-side apply, often larger than the rest of the object, and nothing here reads it.
    """
    metadata = obj["metadata"]
    if "managedFields" in metadata:
        obj["metadata"] = {k: v for k, v in metadata.items() if k != "managedFields"}
    if obj.get("apiVersion") and obj.get("kind"):
        return obj
    return {"apiVersion": resource_type.api_version, "kind": resource_type.kind, **obj}


def object_key(obj: Mapping[str, Any]) -> tuple[str, str]:
    """(namespace, name) of an object that passed :func:`decode_event` or :func:`decode_page`."""
    metadata = obj["metadata"]
    return str(metadata.get("namespace") or ""), str(metadata["name"])


def status_error(obj: Any, what: str) -> KubeApiError:
    """A ``Status`` object (an ERROR event's) as the error it reports."""
    status = obj if isinstance(obj, dict) else {}
    code = status.get("code")
    message = status.get("message") or status.get("reason") or "no message"
    code = code if isinstance(code, int) else 0
    return KubeApiError(code, f"{what}: HTTP {code}: {message}")


def is_gone(error: KubeApiError) -> bool:
    """410 Gone / Expired: the resourceVersion left the server's history; only a new list helps."""
    return error.status == 410


def json_object(data: bytes, what: str) -> dict[str, Any]:
    """Decode a JSON object; anything else is a KubeApiError (status 0) saying what was malformed."""
    try:
        document = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise KubeApiError(0, f"malformed {what}: not JSON: {exc}") from None
    if not isinstance(document, dict):
        raise KubeApiError(0, f"malformed {what}: expected a JSON object, got {type(document).__name__}")
    return document


def _check_object(obj: RawObject, resource_type: ResourceType, what: str, *, bookmark: bool = False) -> None:
    metadata = obj.get("metadata")
    if not isinstance(metadata, dict):
        raise KubeApiError(0, f"malformed {what} of {resource_type.kind}: no metadata")
    version = metadata.get("resourceVersion")
    if not isinstance(version, str) or not version:
        raise KubeApiError(0, f"malformed {what} of {resource_type.kind}: no metadata.resourceVersion")
    if not bookmark and not (isinstance(metadata.get("name"), str) and metadata["name"]):
        raise KubeApiError(0, f"malformed {what} of {resource_type.kind}: no metadata.name")
