"""The step both sources share: raw objects -> a catalog, with problems instead of exceptions."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.catalog.resources import iter_objects
from extproc.sources.objects import ProblemLog, compile_objects
from extproc.types import WorkerSetKey

FIXTURE = Path(__file__).parent.parent / "data" / "catalog.yaml"
LLAMA = WorkerSetKey("default/llama-3-8b")


def fixture_objects() -> list[dict[str, Any]]:
    return [o for d in yaml.safe_load_all(FIXTURE.read_text()) if d is not None for o in iter_objects(d)]


def with_block_size(objects: list[dict[str, Any]], name: str, value: Any) -> list[dict[str, Any]]:
    edited = []
    for obj in objects:
        if obj["kind"] == "InferenceWorkerSet" and obj["metadata"]["name"] == name:
            obj = {**obj, "spec": {**obj["spec"], "kvBlockSize": value}}
        edited.append(obj)
    return edited


def test_order_does_not_matter() -> None:
    """The API server lists in its own order; the catalog is the same whatever it is."""
    objects = fixture_objects()
    shuffled = objects[:]
    random.Random(3).shuffle(shuffled)
    assert compile_objects(shuffled, {}).catalog == compile_objects(objects, {}).catalog


def test_invalid_object_keeps_its_last_valid_version() -> None:
    """An edit the router cannot use (but the schema let through) leaves the previous version routing."""
    first = compile_objects(fixture_objects(), {})
    second = compile_objects(with_block_size(fixture_objects(), "llama-3-8b", "big"), first.valid)
    assert second.catalog.worker_sets[LLAMA] == first.catalog.worker_sets[LLAMA]
    [problem] = second.catalog.problems
    assert problem.kept_previous and problem.name == "llama-3-8b"
    assert problem.message.endswith("; the previous valid version stays in use")


def test_never_valid_object_is_left_out() -> None:
    """Without an earlier valid version, an unusable object is only a problem."""
    compiled = compile_objects(with_block_size(fixture_objects(), "llama-3-8b", 0), {})
    assert LLAMA not in compiled.catalog.worker_sets
    assert [p.kept_previous for p in compiled.catalog.problems] == [False]


def test_non_mapping_is_a_problem_not_a_crash() -> None:
    """Garbage among the objects is reported and skipped."""
    compiled = compile_objects([*fixture_objects(), "garbage"], {})
    assert compiled.catalog.problems[0].kind == "(no kind)"
    assert LLAMA in compiled.catalog.worker_sets


def test_problems_are_logged_once_while_they_last(caplog: pytest.LogCaptureFixture) -> None:
    """A problem is logged when it appears, not on every rebuild; a new one is logged again."""
    problems = ProblemLog(logging.getLogger("test.problems"), "source=test")
    bad = compile_objects(with_block_size(fixture_objects(), "qwen-2-7b", 0), {}).catalog
    with caplog.at_level(logging.WARNING, logger="test.problems"):
        assert problems.report(bad) == 1
        assert problems.report(bad) == 1
        assert problems.report(compile_objects(fixture_objects(), {}).catalog) == 0
        assert problems.report(bad) == 1
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all(line.startswith("catalog problem source=test") for line in lines)


def with_versions(objects: list[dict[str, Any]], version: str) -> list[dict[str, Any]]:
    return [{**o, "metadata": {**o["metadata"], "resourceVersion": version}} for o in objects]


def test_unchanged_versions_are_not_parsed_again() -> None:
    """The kube source rebuilds often: an object whose resourceVersion did not move keeps its parse."""
    first = compile_objects(with_versions(fixture_objects(), "1"), {})
    assert len(first.parsed) == len(fixture_objects())
    # Same resourceVersion, different content: only a reused parse explains the old block size.
    same_version = with_versions(with_block_size(fixture_objects(), "llama-3-8b", 32), "1")
    reused = compile_objects(same_version, first.valid, first.parsed)
    assert reused.catalog == first.catalog
    moved = with_versions(with_block_size(fixture_objects(), "llama-3-8b", "big"), "2")
    second = compile_objects(moved, first.valid, reused.parsed)
    assert second.catalog.worker_sets[LLAMA] == first.catalog.worker_sets[LLAMA]
    [problem] = second.catalog.problems
    assert problem.kept_previous
    assert compile_objects(moved, second.valid, second.parsed).catalog == second.catalog
