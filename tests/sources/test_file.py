"""The YAML file source: loading, and following edits the way an API server would."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import re
import weakref
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.catalog.model import Catalog, ObjectProblem
from extproc.errors import SourceError
from extproc.settings import SourceSettings
from extproc.sources.file import FileSource
from extproc.types import WorkerSetKey

FIXTURE = Path(__file__).parent.parent / "data" / "catalog.yaml"
LLAMA, QWEN = WorkerSetKey("default/llama-3-8b"), WorkerSetKey("default/qwen-2-7b")
TIMEOUT = 5.0


def fixture_docs() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(FIXTURE.read_text()) if d is not None]


def write(path: Path, docs: list[dict[str, Any]]) -> None:
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def source_for(path: Path, on_reload: Callable[[str], None] | None = None) -> FileSource:
    return FileSource(SourceSettings(kind="file", path=path, poll_interval=0.05), on_reload=on_reload)


def append(path: Path, text: str) -> None:
    path.write_text(path.read_text() + text)


@pytest.fixture
def catalog_file(tmp_path: Path) -> Path:
    path = tmp_path / "catalog.yaml"
    path.write_bytes(FIXTURE.read_bytes())
    return path


class Published:
    """Collects what ``watch`` publishes; ``next()`` waits for the next one, with a timeout."""

    def __init__(self) -> None:
        self.catalogs: list[Catalog] = []
        self._event = asyncio.Event()

    def __call__(self, catalog: Catalog) -> None:
        self.catalogs.append(catalog)
        self._event.set()

    async def next(self) -> Catalog:
        async with asyncio.timeout(TIMEOUT):
            await self._event.wait()
        self._event.clear()
        return self.catalogs[-1]


@contextlib.asynccontextmanager
async def watching(source: FileSource) -> AsyncIterator[Published]:
    published = Published()
    task = asyncio.create_task(source.watch(published))
    try:
        yield published
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def test_fixture_loads_as_documented() -> None:
    """The shared sample catalog holds the facts other tests rely on."""
    source = source_for(FIXTURE)
    catalog = source.load()
    chat = catalog.resolve("chat")
    assert chat is not None
    assert chat.upstream_model == "meta-llama/Meta-Llama-3-8B-Instruct"
    assert [e.address for e in chat.endpoints] == ["127.0.0.1:8000", "127.0.0.2:8000"]
    assert [e.pod for e in chat.endpoints] == ["llama-3-8b-0", "llama-3-8b-1"]
    qwen = catalog.worker_sets[QWEN]
    assert ([e.address for e in qwen.endpoints], qwen.terminating) == (["127.0.0.3:8000"], 1)
    assert sorted(catalog.routes) == [
        "Qwen/Qwen2-7B-Instruct",
        "chat",
        "meta-llama/Meta-Llama-3-8B-Instruct",
        "qwen",
    ]
    assert (catalog.problems, catalog.conflicts) == ((), ())
    assert all(ws.problems == () for ws in catalog.worker_sets.values())
    assert (source.reloads_ok, source.reloads_failed) == (1, 0)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, r"catalog file .*missing\.yaml: not found"),
        (
            b"apiVersion: v1\nkind: Service\nmetadata:\n  name: [unclosed\n",
            # libyaml's wording ("did not find expected") or PyYAML's ("expected ..., but got").
            r"invalid YAML at line 5, column 1: .*expected ',' or '\]'.* "
            r"\(while parsing a flow sequence at line 4\)",
        ),
        (
            b"kind: Service\n  name: x\n",
            r"invalid YAML at line 2, column 7: mapping values are not allowed (here|in this context)",
        ),
        (b"kind: \x80\n", r"invalid YAML: unacceptable character"),
        (Path("."), r"catalog file .*: cannot read: Is a directory"),
    ],
    ids=["missing", "unclosed-list", "bad-indent", "not-utf8", "directory"],
)
def test_unusable_file_fails_load_with_path_and_line(
    tmp_path: Path, content: bytes | Path | None, message: str
) -> None:
    """Startup fails with the file's path and, for YAML errors, the line to look at."""
    path = tmp_path / "missing.yaml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, Path):
        path = tmp_path
    source = source_for(path)
    with pytest.raises(SourceError, match=message):
        source.load()
    assert (source.reloads_ok, source.reloads_failed) == (0, 1)


def test_bad_objects_are_reported_and_the_rest_loads(tmp_path: Path) -> None:
    """Unknown kinds and invalid objects are skipped with a problem each; valid objects still route."""
    docs = fixture_docs()
    bad_set = {**find(docs, "InferenceWorkerSet", "qwen-2-7b"), "metadata": {"name": "broken"}}
    bad_set["spec"] = {**bad_set["spec"], "kvBlockSize": "big"}
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg", "namespace": "ops"}}
    path = tmp_path / "catalog.yaml"
    write(path, [config_map, *docs, bad_set])
    catalog = source_for(path).load()
    assert sorted(catalog.worker_sets) == [LLAMA, QWEN]
    assert catalog.problems[0] == ObjectProblem(
        "ConfigMap",
        "ops",
        "cfg",
        'apiVersion "v1" kind "ConfigMap" is not one of InferenceWorkerSet (kinference.buoyant.io/v1alpha1), '
        "Service (v1), EndpointSlice (discovery.k8s.io/v1), InferenceObjective (llm-d.ai/v1alpha2), "
        "InferenceObjective (inference.networking.x-k8s.io/v1alpha2); skipped",
    )
    assert catalog.problems[1] == ObjectProblem(
        "InferenceWorkerSet",
        "default",
        "broken",
        'spec.kvBlockSize: must be an integer between 1 and 4096, got "big"',
        kept_previous=False,
    )


def test_empty_documents_and_duplicates(tmp_path: Path) -> None:
    """Empty documents are ignored; an object defined twice uses its last definition and says so."""
    docs = fixture_docs()
    later = find(docs, "InferenceWorkerSet", "qwen-2-7b")
    later = {**later, "spec": {**later["spec"], "kvBlockSize": 32}}
    path = tmp_path / "catalog.yaml"
    path.write_text("---\n---\n" + yaml.safe_dump_all([*docs, later]) + "---\n")
    catalog = source_for(path).load()
    assert catalog.worker_sets[QWEN].kv_block_size == 32
    assert catalog.problems == (
        ObjectProblem(
            "InferenceWorkerSet",
            "default",
            "qwen-2-7b",
            "defined more than once in the file; the last definition is used",
        ),
    )


def test_identical_rewrite_publishes_nothing(catalog_file: Path) -> None:
    """Touching the file or saving it unchanged does not rebuild or republish the catalog."""
    source = source_for(catalog_file)
    source.load()
    catalog_file.write_bytes(catalog_file.read_bytes())
    later = catalog_file.stat().st_mtime_ns + 1_000_000_000  # a coarse clock may not have ticked yet
    os.utime(catalog_file, ns=(later, later))
    assert [source.poll(), source.poll()] == [None, None]
    assert (source.reloads_ok, source.reloads_unchanged) == (1, 1)


def test_same_size_edit_within_one_clock_tick_is_seen(catalog_file: Path) -> None:
    """An edit that keeps size, inode and (coarse) mtime is still noticed: recent files are re-hashed."""
    source = source_for(catalog_file)
    source.load()
    before = catalog_file.stat()
    catalog_file.write_text(catalog_file.read_text().replace("kvBlockSize: 16", "kvBlockSize: 32", 1))
    os.utime(catalog_file, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert catalog_file.stat().st_size == before.st_size
    catalog = source.poll()
    assert catalog is not None
    assert catalog.worker_sets[LLAMA].kv_block_size == 32


def test_missing_file_is_logged_once_and_recovers(
    catalog_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A file gone for a while (editor rename, config-map swap) keeps the catalog and logs one warning."""
    source = source_for(catalog_file)
    source.load()
    content = catalog_file.read_bytes()
    catalog_file.unlink()
    with caplog.at_level(logging.WARNING, logger="extproc.sources.file"):
        assert [source.poll() for _ in range(3)] == [None, None, None]
    assert source.last_error is not None
    assert source.last_error.endswith("catalog.yaml: not found")
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert (source.reloads_failed, len(warnings)) == (1, 1)
    catalog_file.write_bytes(content)
    assert source.poll() is None  # same content as the current catalog: nothing to publish
    assert source.last_error is None


def test_repeated_broken_content_counts_once_per_error(catalog_file: Path) -> None:
    """Each distinct error is counted (and reported to on_reload) once however many polls see it."""
    outcomes: list[str] = []
    source = source_for(catalog_file, on_reload=outcomes.append)
    source.load()
    catalog_file.write_text("a: [\n")
    assert [source.poll(), source.poll()] == [None, None]
    catalog_file.write_text("a: 1\n b: 2\n")
    assert [source.poll(), source.poll()] == [None, None]
    assert (source.reloads_ok, source.reloads_failed) == (1, 2)
    assert outcomes == ["ok", "failed", "failed"]


async def test_watch_without_load_publishes_the_first_catalog(catalog_file: Path) -> None:
    """Watching alone is enough: the first poll publishes the file's catalog."""
    async with watching(source_for(catalog_file)) as published:
        catalog = await published.next()
    assert sorted(catalog.worker_sets) == [LLAMA, QWEN]


async def test_watch_picks_up_an_edit(catalog_file: Path) -> None:
    """Scaling a set in the file (a new pod in its slice) reaches the routes without a restart."""
    source = source_for(catalog_file)
    source.load()
    docs = fixture_docs()
    items = next(d for d in docs if d["kind"] == "List")["items"]
    qwen_slice = next(i for i in items if i["metadata"]["name"] == "qwen-2-7b-m4d9s")
    qwen_slice["endpoints"].append({"addresses": ["127.0.0.5"], "conditions": {"ready": True}})
    async with watching(source) as published:
        write(catalog_file, docs)
        catalog = await published.next()
    assert [e.address for e in catalog.worker_sets[QWEN].endpoints] == [
        "127.0.0.3:8000",
        "127.0.0.5:8000",
    ]
    assert source.reloads_ok == 2


def test_a_file_caught_mid_write_is_not_applied(catalog_file: Path) -> None:
    """A write in progress (cut after the first documents: still valid YAML) is seen, but only
    content found the same on two polls is used, so the objects after the cut are never dropped."""
    source = source_for(catalog_file)
    source.load()
    docs = fixture_docs()
    find(docs, "Service", "qwen-2-7b")["metadata"]["labels"] = {"edit": "1"}
    full = yaml.safe_dump_all(docs, sort_keys=False)
    cut = full[: full.index("\n---", len(full) // 3)] + "\n"  # whole documents only: it parses
    catalog_file.write_text(cut)
    assert source.poll(settle=True) is None  # first sight of fresh content
    catalog_file.write_text(full)  # the writer finishes
    assert source.poll(settle=True) is None  # other bytes: first sight again
    catalog = source.poll(settle=True)
    assert catalog is not None and sorted(catalog.worker_sets) == [LLAMA, QWEN]
    assert source.reloads_ok == 2 and source.reloads_failed == 0


def test_fresh_content_that_stays_is_applied_on_the_next_poll(catalog_file: Path) -> None:
    source = source_for(catalog_file)
    source.load()
    docs = [
        d for d in fixture_docs() if d["kind"] != "InferenceWorkerSet" or d["metadata"]["name"] != "qwen-2-7b"
    ]
    write(catalog_file, docs)
    assert source.poll(settle=True) is None
    catalog = source.poll(settle=True)
    assert catalog is not None and sorted(catalog.worker_sets) == [LLAMA]


async def test_reloads_leave_garbage_collection_working(catalog_file: Path) -> None:
    """Collection is paused while a file parses; afterwards cycles are collected again."""
    assert gc.isenabled()
    source = source_for(catalog_file)
    source.load()
    docs = fixture_docs()
    # Garbage from before the reloads: a freeze left in place would keep it forever.
    probe = weakref.ref(_Cyclic())
    async with watching(source) as published:
        for edit in range(3):
            find(docs, "Service", "qwen-2-7b")["metadata"]["labels"] = {"edit": str(edit)}
            write(catalog_file, docs)
            await published.next()
    assert gc.isenabled()
    gc.collect()
    assert probe() is None


def test_a_reload_in_a_process_that_keeps_its_heap_frozen_freezes_the_new_catalog(
    catalog_file: Path,
) -> None:
    """serve freezes its startup heap; a reload must not thaw it (the next full collection would
    walk it all), and it collects the garbage made before freezing what it added."""
    source = source_for(catalog_file)
    first = source.load()
    thresholds = gc.get_threshold()
    gc.collect()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        probe = weakref.ref(_Cyclic())
        docs = fixture_docs()
        find(docs, "Service", "qwen-2-7b")["metadata"]["labels"] = {"edit": "1"}
        write(catalog_file, docs)
        catalog = source.poll()
        assert catalog is not None and sorted(catalog.worker_sets) == [LLAMA, QWEN]
        assert catalog.worker_sets[QWEN] is not first.worker_sets[QWEN]  # built by this reload
        assert probe() is None  # collected, not frozen
        assert gc.get_freeze_count() > frozen
        young = {id(o) for o in gc.get_objects()}
        assert id(catalog.worker_sets[QWEN]) not in young  # frozen with the rest
        assert gc.get_threshold() == thresholds
    finally:
        gc.unfreeze()


class _Cyclic:
    """Garbage only the cycle collector can free."""

    def __init__(self) -> None:
        self.me = self


async def test_invalid_edit_keeps_the_previous_version(catalog_file: Path) -> None:
    """A bad edit to one set is refused like the API server would: its last valid version keeps routing."""
    source = source_for(catalog_file)
    source.load()
    docs = fixture_docs()
    find(docs, "InferenceWorkerSet", "llama-3-8b")["spec"]["kvBlockSize"] = "big"
    find(docs, "InferenceWorkerSet", "qwen-2-7b")["spec"]["kvBlockSize"] = 32
    async with watching(source) as published:
        write(catalog_file, docs)
        catalog = await published.next()
    assert catalog.worker_sets[LLAMA].kv_block_size == 16
    assert catalog.worker_sets[QWEN].kv_block_size == 32
    assert catalog.resolve("chat") is not None
    assert catalog.problems == (
        ObjectProblem(
            "InferenceWorkerSet",
            "default",
            "llama-3-8b",
            'spec.kvBlockSize: must be an integer between 1 and 4096, got "big"; '
            "the previous valid version stays in use",
            kept_previous=True,
        ),
    )


async def test_broken_yaml_keeps_the_previous_catalog(catalog_file: Path) -> None:
    """A half-saved file changes nothing; the next good save is picked up."""
    failed = asyncio.Event()
    source = source_for(catalog_file, on_reload=lambda outcome: failed.set() if outcome == "failed" else None)
    source.load()
    docs = fixture_docs()
    async with watching(source) as published:
        append(catalog_file, "\n---\nkind: [\n")
        async with asyncio.timeout(TIMEOUT):
            await failed.wait()
        assert published.catalogs == []
        assert source.last_error is not None
        assert "invalid YAML at line" in source.last_error
        find(docs, "InferenceWorkerSet", "qwen-2-7b")["spec"]["kvBlockSize"] = 64
        write(catalog_file, docs)
        catalog = await published.next()
    assert catalog.worker_sets[QWEN].kv_block_size == 64
    assert source.last_error is None
    assert (source.reloads_ok, source.reloads_failed) == (2, 1)


async def test_deleted_object_disappears(catalog_file: Path) -> None:
    """Removing a set from the file removes its routes; nothing lingers from the old version."""
    source = source_for(catalog_file)
    source.load()
    docs = [d for d in fixture_docs() if d.get("metadata", {}).get("name") != "qwen-2-7b"]
    async with watching(source) as published:
        write(catalog_file, docs)
        catalog = await published.next()
    assert sorted(catalog.worker_sets) == [LLAMA]
    assert catalog.resolve("qwen") is None
    assert catalog.resolve("chat") is not None


async def test_atomic_rename_is_picked_up(catalog_file: Path) -> None:
    """Editors and config-map updates replace the file by rename; the new content is loaded."""
    source = source_for(catalog_file)
    source.load()
    docs = fixture_docs()
    find(docs, "InferenceWorkerSet", "llama-3-8b")["spec"]["models"][0]["aliases"] = ["chat", "assistant"]
    async with watching(source) as published:
        temp = catalog_file.with_name(".catalog.yaml.tmp")
        write(temp, docs)
        os.replace(temp, catalog_file)
        catalog = await published.next()
    route = catalog.resolve("assistant")
    assert route is not None
    assert route.upstream_model == "meta-llama/Meta-Llama-3-8B-Instruct"


def test_unexpected_build_error_keeps_the_catalog(
    catalog_file: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Even a bug met while building a reloaded file leaves the server routing on the old catalog."""
    source = source_for(catalog_file)
    source.load()

    def broken_build(*_: object) -> Catalog:
        raise RuntimeError("bug")

    monkeypatch.setattr("extproc.sources.objects.build_catalog", broken_build)
    append(catalog_file, "\n# edited\n")
    with caplog.at_level(logging.ERROR, logger="extproc.sources.file"):
        assert source.poll() is None
    assert source.last_error is not None
    assert source.last_error.endswith("internal error while loading: RuntimeError('bug')")
    assert "catalog build failed (bug)" in caplog.text


#: A "billion laughs": nine aliases per level, nine levels: ~387 million strings once expanded.
ALIAS_BOMB = b"""a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
"""

UNUSABLE = [
    (b"", "holds nothing: no InferenceWorkerSet, Service or EndpointSlice"),
    (b"---\n---\n", "holds nothing: no InferenceWorkerSet"),
    (b"hello, this is not a catalog\n", "holds 1 object\\(s\\), none of them an InferenceWorkerSet"),
    (b"foo: 1\nbar: [2, 3]\n", "holds 1 object\\(s\\), none of them"),
    (b"apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n", "none of them an InferenceWorkerSet"),
    (ALIAS_BOMB, "document 1: its YAML aliases expand to more than 5,000,000 nodes"),
    (b"a: &a [1, *a]\n", "document 1: a YAML alias refers to a node containing it"),
]
UNUSABLE_IDS = [
    "empty",
    "only-separators",
    "plain-text",
    "unrelated-mapping",
    "other-kind",
    "alias-bomb",
    "cycle",
]


@pytest.mark.parametrize(("content", "message"), UNUSABLE, ids=UNUSABLE_IDS)
def test_files_without_a_catalog_are_refused_at_start(tmp_path: Path, content: bytes, message: str) -> None:
    """Startup refuses a file that would route nothing, naming what it found; aliases cannot explode."""
    path = tmp_path / "catalog.yaml"
    path.write_bytes(content)
    with pytest.raises(SourceError, match=message):
        source_for(path).load()


@pytest.mark.parametrize(("content", "message"), UNUSABLE, ids=UNUSABLE_IDS)
def test_files_without_a_catalog_never_replace_a_good_one(
    catalog_file: Path, content: bytes, message: str
) -> None:
    """An edit that empties or garbles the file keeps routing on the last good catalog, with the reason."""
    source = source_for(catalog_file)
    before = source.load()
    catalog_file.write_bytes(content)
    os.utime(catalog_file, ns=(0, 0))  # a different stamp whatever the clock's resolution
    assert source.poll() is None
    assert source.last_error is not None and re.search(message, source.last_error)
    write(catalog_file, fixture_docs())
    assert source.poll() == before


def test_a_file_over_the_size_limit_is_refused_unread(tmp_path: Path) -> None:
    """--max-catalog-bytes bounds what is read and parsed; the message names the flag."""
    path = tmp_path / "catalog.yaml"
    path.write_bytes(FIXTURE.read_bytes())
    size = path.stat().st_size
    small = FileSource(SourceSettings(kind="file", path=path, max_bytes=size - 1))
    with pytest.raises(
        SourceError, match=f"{size:,} bytes, over the {size - 1:,}-byte limit \\(--max-catalog-bytes\\)"
    ):
        small.load()
    assert FileSource(SourceSettings(kind="file", path=path, max_bytes=size)).load().worker_sets


def test_the_first_failed_load_does_not_claim_a_previous_catalog(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With nothing loaded yet, the log says so instead of "keeping the previous catalog"."""
    path = tmp_path / "catalog.yaml"
    path.write_bytes(b"")
    with pytest.raises(SourceError):
        source_for(path).load()
    assert "no catalog yet" in caplog.text and "keeping the previous" not in caplog.text
