"""Decoding what the API server sends: list pages, watch lines, ERROR events, oversized lines."""

from __future__ import annotations

import json
from typing import Any

import pytest

from extproc.errors import KubeApiError
from extproc.kube.resources import SERVICES, WORKER_SETS
from extproc.kube.wire import LineSplitter, Oversized, decode_event, decode_page, is_gone


def line(kind: str, obj: Any) -> bytes:
    return json.dumps({"type": kind, "object": obj}).encode()


def service(name: str = "llama", version: str = "7", **metadata: Any) -> dict[str, Any]:
    return {
        "kind": "Service",
        "apiVersion": "v1",
        "metadata": {"name": name, "namespace": "ml", "resourceVersion": version, **metadata},
        "spec": {"ports": [{"name": "http", "port": 80}]},
    }


# -- line splitting --------------------------------------------------------------------------------


def test_lines_split_across_chunks() -> None:
    """An event cut anywhere by the transport comes out whole, in order; blank lines are skipped."""
    splitter = LineSplitter(max_line=100)
    out: list[bytes | Oversized] = []
    for chunk in (b'{"a"', b":1}\n\n", b'{"b":2}\n{"c"', b":3}\n"):
        out.extend(splitter.feed(chunk))
    assert out == [b'{"a":1}', b'{"b":2}', b'{"c":3}']


def test_oversized_line_is_skipped_whole_and_reported_once() -> None:
    """A line over the cap is dropped up to its newline, reported with its size; the next line is fine."""
    splitter = LineSplitter(max_line=10)
    out: list[bytes | Oversized] = []
    for chunk in (b"0123456", b"789abcdef", b"ghij\nok\n"):
        out.extend(splitter.feed(chunk))
    assert out == [Oversized(20), b"ok"]


def test_line_of_exactly_the_cap_passes() -> None:
    """The cap is inclusive."""
    assert list(LineSplitter(max_line=4).feed(b"abcd\n")) == [b"abcd"]


def test_splitter_memory_stays_bounded() -> None:
    """However long a line without a newline grows, at most the cap is buffered."""
    splitter = LineSplitter(max_line=1024)
    for _ in range(1000):
        assert list(splitter.feed(b"x" * 4096)) == []
    assert len(splitter._buffer) <= 1024
    assert list(splitter.feed(b"\n")) == [Oversized(4096 * 1000)]


# -- watch events ----------------------------------------------------------------------------------


def test_change_event() -> None:
    """A MODIFIED event carries the object exactly as sent, and its resourceVersion."""
    event = decode_event(line("MODIFIED", service()), SERVICES)
    assert (event.type, event.object, event.resource_version) == ("MODIFIED", service(), "7")


def test_managed_fields_are_dropped_as_kubectl_does() -> None:
    """Server-side-apply bookkeeping is not kept (kubectl get -o json hides it too)."""
    sent = service(managedFields=[{"manager": "kubectl", "fieldsV1": {"f:spec": {}}}])
    assert decode_event(line("ADDED", sent), SERVICES).object == service()


def test_bookmark_needs_only_a_resource_version() -> None:
    """Bookmarks carry an almost empty object."""
    obj = {"kind": "InferenceWorkerSet", "apiVersion": "kinference.buoyant.io/v1alpha1"}
    event = decode_event(line("BOOKMARK", {**obj, "metadata": {"resourceVersion": "99"}}), WORKER_SETS)
    assert (event.type, event.resource_version) == ("BOOKMARK", "99")


@pytest.mark.parametrize(
    ("status", "gone"),
    [
        (
            {
                "kind": "Status",
                "code": 410,
                "reason": "Expired",
                "message": "too old resource version: 5 (90)",
            },
            True,
        ),
        ({"kind": "Status", "code": 500, "message": "etcd is sad"}, False),
        ({"kind": "Status"}, False),
    ],
    ids=["expired", "internal", "no-code"],
)
def test_error_event_ends_the_watch(status: dict[str, Any], gone: bool) -> None:
    """An ERROR event becomes an error with the status inside it; only 410 means "list again"."""
    with pytest.raises(KubeApiError) as caught:
        decode_event(line("ERROR", status), SERVICES)
    assert is_gone(caught.value) is gone
    assert caught.value.status == status.get("code", 0)


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"[1, 2]",
        line("EXPLODED", service()),
        line("ADDED", "a string"),
        line("ADDED", {"kind": "Service"}),
        line("ADDED", {"metadata": {"name": "x"}}),
        line("ADDED", {"metadata": {"resourceVersion": "3"}}),
    ],
    ids=[
        "not-json",
        "not-object",
        "unknown-type",
        "object-not-mapping",
        "no-metadata",
        "no-version",
        "no-name",
    ],
)
def test_malformed_events_are_errors(raw: bytes) -> None:
    """Anything that could not be applied safely ends the watch (it resumes from the last good event)."""
    with pytest.raises(KubeApiError, match="malformed"):
        decode_event(raw, SERVICES)


# -- list pages ------------------------------------------------------------------------------------


def test_list_items_get_kind_and_api_version() -> None:
    """List items come without kind and apiVersion; they are filled in, first, as kubectl shows them."""
    item = service()
    del item["kind"], item["apiVersion"]
    body = json.dumps(
        {"kind": "ServiceList", "metadata": {"resourceVersion": "12", "continue": "abc"}, "items": [item]}
    )
    page = decode_page(body.encode(), SERVICES)
    assert page.items == [service()]
    assert list(page.items[0])[:2] == ["apiVersion", "kind"]
    assert (page.resource_version, page.continue_token) == ("12", "abc")


def test_empty_last_page() -> None:
    """An empty collection (items null, as Go encodes it) is an empty last page."""
    page = decode_page(b'{"kind":"ServiceList","metadata":{"resourceVersion":"3"},"items":null}', SERVICES)
    assert (page.items, page.resource_version, page.continue_token) == ([], "3", "")


@pytest.mark.parametrize(
    "body",
    [
        b"{}",
        b'{"metadata":{},"items":[]}',
        b'{"metadata":{"resourceVersion":"1"},"items":[1]}',
        b'{"metadata":{"resourceVersion":"1"},"items":{}}',
    ],
    ids=["nothing", "no-version", "item-not-object", "items-not-list"],
)
def test_malformed_pages_are_errors(body: bytes) -> None:
    """A list that cannot be trusted whole is not used at all."""
    with pytest.raises(KubeApiError, match="malformed"):
        decode_page(body, SERVICES)
