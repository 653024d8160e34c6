"""The headers a request carries in and out: what is believed from a client, and what is set."""

from __future__ import annotations

import pytest

from extproc.control.flow import DEFAULT_FAIRNESS_ID, MAX_FAIRNESS_ID, RequestClass
from extproc.protocol.headers import prefill_hint, request_class


def test_a_request_naming_neither_objective_nor_fairness_has_no_class() -> None:
    assert request_class({"x-other": "1"}) is None


def test_the_llm_d_names_win_over_the_older_gateway_names() -> None:
    headers = {
        "x-gateway-inference-objective": "old",
        "x-llm-d-inference-objective": "new",
        "x-gateway-inference-fairness-id": "tenant-old",
        "x-llm-d-inference-fairness-id": "tenant-new",
    }
    assert request_class(headers) == RequestClass(objective="new", fairness_id="tenant-new")


def test_an_objective_alone_is_fair_to_the_shared_default() -> None:
    klass = request_class({"x-gateway-inference-objective": "batch"})
    assert klass == RequestClass(objective="batch", fairness_id=DEFAULT_FAIRNESS_ID)


def test_a_fairness_id_is_clipped_so_a_client_cannot_grow_the_queues_keys() -> None:
    klass = request_class({"x-llm-d-inference-fairness-id": "t" * (MAX_FAIRNESS_ID * 4)})
    assert klass is not None
    assert klass.objective is None
    assert klass.fairness_id == "t" * MAX_FAIRNESS_ID


def test_empty_headers_count_as_absent() -> None:
    assert request_class({"x-llm-d-inference-objective": "", "x-gateway-inference-objective": "b"}) == (
        RequestClass(objective="b", fairness_id=DEFAULT_FAIRNESS_ID)
    )


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("800,0.0500", (800, 0.05)),
        ("", (0, 0.0)),
        ("x,y", (0, 0.0)),
        ("-5,-1", (0, 0.0)),
        ("3,1e9", (3, 3600.0)),
    ],
    ids=["ours", "absent", "garbage", "negative", "huge"],
)
def test_prefill_hints_are_bounded(value: str, expected: tuple[int, float]) -> None:
    """Only sane numbers are believed: never negative, never beyond an hour."""
    assert prefill_hint(value) == expected
