"""What one list + watch knows: objects by (namespace, name) and where to resume (pure).

Transitions are those of a Kubernetes informer's store: a list replaces everything at once (so
objects deleted while nobody watched disappear), ADDED/MODIFIED put, DELETED removes, and every
event, BOOKMARKs included, moves the resourceVersion that the next watch resumes from.
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
        changed = objects != self.objects
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
        if self.objects.get(key) == event.object:
            return False
        self.objects[key] = event.object
        return True

    def clear(self) -> bool:
        """Forget everything (the resource type went away); True if anything was known."""
        return self.replace((), "")
