"""The object cache: how lists and watch events change what a reflector knows."""

from __future__ import annotations

from typing import Any

from extproc.kube.cache import ObjectCache
from extproc.kube.wire import ChangeType, WatchEvent


def obj(name: str, version: str, namespace: str = "ns", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "resourceVersion": version},
        "spec": spec,
    }


def event(kind: ChangeType, o: dict[str, Any]) -> WatchEvent:
    return WatchEvent(kind, o)


def test_list_replaces_everything_at_once() -> None:
    """A relist drops objects deleted while nobody watched and keeps the list's resourceVersion."""
    cache = ObjectCache()
    assert cache.replace([obj("a", "1"), obj("b", "2")], "2") is True
    assert cache.replace([obj("b", "2"), obj("c", "5")], "7") is True
    assert sorted(cache.objects) == [("ns", "b"), ("ns", "c")]
    assert cache.resource_version == "7"


def test_identical_list_is_no_change() -> None:
    """Listing the same objects again changes nothing a reader would see."""
    cache = ObjectCache()
    cache.replace([obj("a", "1")], "3")
    assert cache.replace([obj("a", "1")], "9") is False
    assert cache.resource_version == "9"


def test_events_add_modify_delete() -> None:
    """ADDED and MODIFIED put the object, DELETED removes it; each moves the resourceVersion."""
    cache = ObjectCache()
    cache.replace([], "1")
    assert cache.apply(event("ADDED", obj("a", "2", port=80))) is True
    assert cache.apply(event("MODIFIED", obj("a", "3", port=81))) is True
    assert cache.objects[("ns", "a")]["spec"] == {"port": 81}
    assert cache.apply(event("DELETED", obj("a", "4"))) is True
    assert cache.objects == {}
    assert cache.resource_version == "4"


def test_same_name_in_two_namespaces_are_two_objects() -> None:
    """Objects are keyed by namespace and name."""
    cache = ObjectCache()
    cache.apply(event("ADDED", obj("a", "2", namespace="x")))
    cache.apply(event("ADDED", obj("a", "3", namespace="y")))
    assert sorted(cache.objects) == [("x", "a"), ("y", "a")]


def test_bookmark_moves_only_the_resource_version() -> None:
    """A bookmark says "you are current up to here" and changes no object."""
    cache = ObjectCache()
    cache.replace([obj("a", "1")], "1")
    bookmark = {"kind": "Service", "apiVersion": "v1", "metadata": {"resourceVersion": "42"}}
    assert cache.apply(event("BOOKMARK", bookmark)) is False
    assert cache.resource_version == "42"
    assert list(cache.objects) == [("ns", "a")]


def test_deleting_an_unknown_object_is_no_change() -> None:
    """A DELETED for something never seen (deleted before our list) changes nothing."""
    cache = ObjectCache()
    cache.replace([], "1")
    assert cache.apply(event("DELETED", obj("ghost", "5"))) is False
    assert cache.resource_version == "5"


def test_repeated_identical_object_is_no_change() -> None:
    """An event carrying exactly what is known already (same resourceVersion) changes nothing."""
    cache = ObjectCache()
    cache.apply(event("ADDED", obj("a", "2")))
    assert cache.apply(event("MODIFIED", obj("a", "2"))) is False


def test_clear_forgets_everything() -> None:
    """A resource type that went away leaves nothing behind, and nothing to resume from."""
    cache = ObjectCache()
    cache.replace([obj("a", "1")], "1")
    assert cache.clear() is True
    assert (cache.objects, cache.resource_version) == ({}, "")
    assert cache.clear() is False
