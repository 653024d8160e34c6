"""The catalog from a multi-document YAML file, reloaded when it changes.

The file holds what ``kubectl get -o yaml`` would show: InferenceWorkerSets, Services and
EndpointSlices (``kind: List`` documents too). Reloads behave like an API server facing the same
edits, so that what works from a file works on a cluster: a bad edit to one object is refused and
its last valid version stays in use; a file that cannot be read or parsed at all changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from extproc.catalog.model import Catalog
from extproc.catalog.resources import is_catalog_object, iter_objects
from extproc.errors import ConfigError, SourceError
from extproc.files import FileRead, FileStamp, FileTooLarge, read_stamped
from extproc.settings import SourceSettings
from extproc.sources.objects import Compiled, Known, ObjectKey, ProblemLog, compile_objects
from extproc.sources.yaml_load import load_documents

logger = logging.getLogger(__name__)

#: What one counted reload did; ``on_reload`` receives it (for metrics).
ReloadOutcome = Literal["ok", "failed", "unchanged"]


@dataclass(frozen=True, slots=True)
class _Failed:
    message: str
    #: Set when the content was read but rejected, so the same bytes are not parsed again.
    read: FileRead | None = None


@dataclass(frozen=True, slots=True)
class _Settling:
    """Bytes written moments ago: maybe a write still in progress, looked at again next poll."""

    read: FileRead


_Outcome = FileRead | _Failed | _Settling | tuple[FileRead, Compiled] | None


def compile_documents(data: bytes, previous: Mapping[ObjectKey, Known], *, path: Path) -> Compiled:
    """Parse the file's bytes and build a catalog; SourceError if the file as a whole is unusable.

    Unusable: broken YAML, an alias bomb, or no object this router reads at all (an empty file,
    plain text, an unrelated mapping: almost always a mistake that would empty the routing table).
    ``previous`` holds the objects of the last good load: an object that turned invalid keeps
    that version, as the API server would have refused the edit.
    """
    where = f"catalog file {path}"
    documents = [d for d in load_documents(data, where=where) if d is not None]
    objects = [obj for document in documents for obj in iter_objects(document)]
    if not any(is_catalog_object(obj) for obj in objects):
        found = f"{len(objects)} object(s), none of them an" if objects else "nothing: no"
        raise SourceError(f"{where} holds {found} InferenceWorkerSet, Service or EndpointSlice")
    compiled = compile_objects(objects, previous)
    objects.clear()
    _release(documents)
    return compiled


def _release(documents: list[Any]) -> None:
    """Free parsed documents one at a time, so the thread can yield the GIL between them.

    Dropping the whole list at once frees millions of objects in one uninterruptible call:
    ~60 ms during which the event loop cannot run, for a catalog of 18,000 worker sets.
    """
    while documents:
        documents.pop()


def _release_objects(retired: list[dict[ObjectKey, Known]]) -> None:
    """Free replaced objects a few at a time in a worker thread (see ``_release``)."""
    while retired:
        objects = retired.pop()
        while objects:
            objects.popitem()


#: A generation-2 threshold no parse reaches: full collections wait until the parse is over.
_NO_FULL_COLLECTION = 1 << 30


@contextlib.contextmanager
def _collection_paused() -> Iterator[None]:
    """No full collection of cyclic garbage while a catalog is parsed in its worker thread.

    Parsing a large file allocates millions of objects, and each full collection that triggers
    walks all of them while holding the GIL: the event loop (every decision) waited up to ~400 ms
    for one (docs/investigations/catalog_stall.md). Young collections go on meanwhile: each walks only
    what was allocated since the one before (thousands of objects, well under a millisecond), so
    requests' garbage is still collected, and the parse's objects reach the oldest generation a few
    at a time instead of all at once when it ends.

    A process that keeps its heap frozen (serve: :func:`extproc.serve.memory.freeze_startup_heap`)
    gets the new catalog frozen too, so that full collections never walk it. After a parse that
    succeeded, only the young generations are collected first: a successful parse leaves no cyclic
    garbage (measured: none among 288k new objects for 18,000 worker sets), and a full collection
    would walk the whole new catalog while holding the GIL, ~90 ms that every decision waits for.
    What is frozen besides the catalog: what requests in flight hold at that instant, and cyclic
    garbage of theirs that reached the oldest generation during the parse (it outlived two young
    collections), once per reload. A parse that failed gets a full collection: its partial
    objects and the exception's frames may hold cycles, and there is no large catalog to walk.
    """
    thresholds = gc.get_threshold()
    gc.set_threshold(thresholds[0], thresholds[1], _NO_FULL_COLLECTION)
    succeeded = False
    try:
        yield
        succeeded = True
    finally:
        gc.set_threshold(*thresholds)
        if gc.get_freeze_count():
            gc.collect(1 if succeeded else 2)
            gc.freeze()


def _read(path: Path, max_bytes: int) -> FileRead:
    """Read the file and stamp it from the same open file, so stamp and bytes belong together.

    A file over ``max_bytes`` is refused before it is read (``--max-catalog-bytes``): parsing is
    bounded in time and memory whatever lands in the file.
    """
    try:
        return read_stamped(path, limit=max_bytes)
    except OSError as exc:
        raise SourceError(_describe(path, exc)) from exc
    except FileTooLarge as exc:
        raise SourceError(f"catalog file {path}: {exc} (--max-catalog-bytes)") from None


def _describe(path: Path, exc: OSError) -> str:
    if isinstance(exc, FileNotFoundError):
        return f"catalog file {path}: not found"
    return f"catalog file {path}: cannot read: {exc.strerror or exc}"


class FileSource:
    """Loads the catalog file once (``load``) and then follows its changes (``watch``).

    ``reloads_ok`` counts catalogs built; ``reloads_failed`` counts failures, each distinct error
    once while it persists (a file that stays missing is one failure, not one per poll).
    ``on_reload``, if given, is called with each counted outcome, so metrics need no polling.
    """

    def __init__(
        self, settings: SourceSettings, *, on_reload: Callable[[ReloadOutcome], None] | None = None
    ) -> None:
        if settings.path is None:
            raise ConfigError("the file source needs a path")
        self.path: Path = settings.path
        self.poll_interval = settings.poll_interval
        self.max_bytes = settings.max_bytes
        self._on_reload = on_reload
        self.reloads_ok = 0
        self.reloads_failed = 0
        #: Changed stamps whose bytes were those of the current catalog (touch, identical rewrite).
        self.reloads_unchanged = 0
        #: The error that currently keeps the file from loading, or None.
        self.last_error: str | None = None
        self._stamp: FileStamp | None = None  # of the last bytes read
        self._trusted = False  # False while that read was racy: compare bytes again next poll
        self._applied: bytes | None = None  # digest of the content behind the current catalog
        #: Digest of the last content that failed to parse, and why: not parsed again each poll.
        self._rejected: tuple[bytes, str] | None = None
        self._valid: dict[ObjectKey, Known] = {}
        #: Digest of fresh content seen once; used if the next poll finds the same (see ``_check``).
        self._settling: bytes | None = None
        #: Replaced ``_valid`` dicts, freed off the event loop by ``watch``.
        self._retired: list[dict[ObjectKey, Known]] = []
        self._problems = ProblemLog(logger, f"path={self.path}")

    def load(self) -> Catalog:
        """Read and build now; raises SourceError (with the path) if the file cannot be used."""
        try:
            read = _read(self.path, self.max_bytes)
            compiled = compile_documents(read.data, self._valid, path=self.path)
        except SourceError as exc:
            self._fail(_Failed(str(exc)))
            raise
        return self._apply(read, compiled)

    def poll(self, *, settle: bool = False) -> Catalog | None:
        """One check, synchronously: the new catalog if the file changed and loads, else None.

        ``settle``: as :meth:`watch` does, use content modified moments ago only once a second
        poll finds the same bytes (see ``_check``).
        """
        catalog = self._commit(self._check(settle=settle))
        self._retired.clear()
        return catalog

    async def watch(self, publish: Callable[[Catalog], None]) -> None:
        """Poll every ``poll_interval`` seconds and publish each new catalog; runs until cancelled."""
        while True:
            # stat and read may block on slow file systems: keep them off the event loop.
            outcome = await asyncio.to_thread(self._check, settle=True)
            catalog = self._commit(outcome)
            if catalog is not None:
                publish(catalog)
            if self._retired:
                retired, self._retired = self._retired, []
                await asyncio.to_thread(_release_objects, retired)
            await asyncio.sleep(self.poll_interval)

    def debug_state(self) -> dict[str, Any]:
        """For ``/debug/state``: which file, and what keeps it from loading if anything does."""
        return {"kind": "file", "path": str(self.path), "lastError": self.last_error}

    def _check(self, *, settle: bool = False) -> _Outcome:
        """Look at the file; reads state but never changes it, so it can run in a worker thread.

        With ``settle``, content modified moments ago (within the file system's clock tick) is
        only used once the next poll finds the same bytes: a file read while it is being written
        (not renamed into place) is cut short, and a cut that still parses would drop the objects
        after it. Waiting one poll interval costs an edit that much delay, no more.
        """
        try:
            stamp = FileStamp.at(self.path)
            if stamp == self._stamp and self._trusted:
                return None
            read = _read(self.path, self.max_bytes)
        except OSError as exc:
            return _Failed(_describe(self.path, exc))
        except SourceError as exc:
            return _Failed(str(exc))
        if read.digest == self._applied:
            return read
        if self._rejected is not None and read.digest == self._rejected[0]:
            return _Failed(self._rejected[1], read)
        if settle and read.racy and read.digest != self._settling:
            return _Settling(read)
        try:
            with _collection_paused():
                return read, compile_documents(read.data, self._valid, path=self.path)
        except SourceError as exc:
            return _Failed(str(exc), read)
        except Exception as exc:
            # A validation gap is a bug, but it must not stop the server: keep the current catalog.
            logger.exception("catalog build failed (bug) path=%s", self.path)
            return _Failed(f"catalog file {self.path}: internal error while loading: {exc!r}", read)

    def _commit(self, outcome: _Outcome) -> Catalog | None:
        """Apply what ``_check`` found; returns the catalog to publish, if any."""
        if isinstance(outcome, FileRead):  # same bytes as the current catalog: nothing to publish
            touched = outcome.stamp != self._stamp  # not just a racy file hashed again
            self._remember(outcome)
            self._recover()
            if touched:
                self.reloads_unchanged += 1
                self._notify("unchanged")
        elif isinstance(outcome, _Failed):
            self._fail(outcome)
        elif isinstance(outcome, _Settling):
            self._settling = outcome.read.digest  # the stamp is not remembered: read again next poll
        elif outcome is not None:
            return self._apply(*outcome)
        return None

    def _apply(self, read: FileRead, compiled: Compiled) -> Catalog:
        self._remember(read)
        self._applied, self._rejected = read.digest, None
        self._retired.append(self._valid)
        self._valid = compiled.valid
        self.reloads_ok += 1
        self._recover()
        self._report(compiled.catalog)
        self._notify("ok")
        return compiled.catalog

    def _fail(self, failed: _Failed) -> None:
        """Keep the current catalog; remember rejected bytes so they are not parsed every poll."""
        self._remember(failed.read)
        if failed.read is not None:
            self._rejected = (failed.read.digest, failed.message)
        new = failed.message != self.last_error
        self.last_error = failed.message
        if new:
            self.reloads_failed += 1
            if self._applied is None:
                logger.warning("catalog load failed, no catalog yet: error=%r", failed.message)
            else:
                logger.warning(
                    "catalog reload failed, keeping the previous catalog: error=%r", failed.message
                )
            self._notify("failed")

    def _remember(self, read: FileRead | None) -> None:
        self._stamp = read.stamp if read else None
        self._trusted = read is not None and not read.racy

    def _notify(self, outcome: ReloadOutcome) -> None:
        if self._on_reload is not None:
            self._on_reload(outcome)

    def _recover(self) -> None:
        if self.last_error is not None:
            logger.info("catalog file readable again path=%s previous_error=%r", self.path, self.last_error)
            self.last_error = None

    def _report(self, catalog: Catalog) -> None:
        count = self._problems.report(catalog)
        logger.info(
            "catalog loaded path=%s worker_sets=%d routes=%d conflicts=%d problems=%d",
            self.path,
            len(catalog.worker_sets),
            len(catalog.routes),
            len(catalog.conflicts),
            count,
        )
