"""What one list + watch knows: objects by (namespace, name) and where to resume (pure).

Transitions are those of a Kubernetes informer's store: a list replaces everything at once (so
objects deleted while nobody watched disappear), ADDED/MODIFIED put, DELETED removes, and every
event, BOOKMARKs included, moves the resourceVersion that the next watch resumes from. Whether an
object changed is decided by its ``metadata.resourceVersion``, which the API server moves on every
write, rather than by comparing whole objects.
"""

from __future__ import annotations

from collections.abc import Iterable

from extproc.kube.wire import RawObject, WatchEvent, object_key

#: (namespace, name); namespace is "" for cluster-scoped objects.
ObjectKey = tuple[str, str]


class ObjectCache:
    """Objects as the API server last showed them, and the resourceVersion they are current at."""

    def __init__(self) -> None:
        self.objects: dict[ObjectKey, RawObject] = {}
        #: "" until the first list: there is nothing to resume from.
        self.resource_version = ""

    def replace(self, items: Iterable[RawObject], resource_version: str) -> bool:
        """Swap in a complete list; True if the objects differ from before."""
        objects = {object_key(obj): obj for obj in items}
        changed = objects.keys() != self.objects.keys() or any(
            _version(obj) != _version(self.objects[key]) for key, obj in objects.items()
        )
        self.objects = objects  # one assignment: no reader ever sees half of the old and the new list
        self.resource_version = resource_version
        return changed

    def apply(self, event: WatchEvent) -> bool:
        """Apply one watch event; True if the objects changed."""
        self.resource_version = event.resource_version
        if event.type == "BOOKMARK":
            return False
        key = object_key(event.object)
        if event.type == "DELETED":
            return self.objects.pop(key, None) is not None
        known = self.objects.get(key)
        if known is not None and _version(known) == _version(event.object):
            return False
        self.objects[key] = event.object
        return True

    def clear(self) -> bool:
        """Forget everything (the resource type went away); True if anything was known."""
        return self.replace((), "")


def _version(obj: RawObject) -> str:
    # wire.py guarantees every object a resourceVersion.
    return str(obj["metadata"]["resourceVersion"])
