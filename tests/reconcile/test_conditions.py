"""Conditions: limits of the schema and transition times."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from extproc.reconcile.conditions import (
    MAX_CONDITIONS,
    MAX_MESSAGE,
    Condition,
    listing,
    render_conditions,
    truncate,
)

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("text", "limit", "expected"),
    [
        ("short", 10, "short"),
        ("exactly10!", 10, "exactly10!"),
        ("a" * 11, 10, "a" * 9 + "…"),
        ("ééé", 2, "é…"),
    ],
    ids=["short", "at-limit", "cut", "non-ascii"],
)
def test_truncate_counts_characters(text: str, limit: int, expected: str) -> None:
    """Cut text ends in an ellipsis and never exceeds the limit in characters."""
    assert truncate(text, limit) == expected
    assert len(truncate(text, limit)) <= limit


def test_listing_says_how_many_more() -> None:
    """Long lists show their first items and a count of the rest."""
    assert listing(["a", "b", "c"], limit=2) == "a; b; and 1 more"
    assert listing([]) == ""


def test_rendered_conditions_respect_limits() -> None:
    """Messages, and the number of conditions, stay within the schema."""
    many = [Condition(f"T{i}", "True", "Ok", "x" * (MAX_MESSAGE + 10)) for i in range(MAX_CONDITIONS + 2)]
    rendered = render_conditions(many, generation=2, previous=None, now=T0)
    assert len(rendered) == MAX_CONDITIONS
    assert all(len(c["message"]) == MAX_MESSAGE for c in rendered)


@pytest.mark.parametrize(
    "previous",
    [None, "junk", [{"type": "Ready"}], [{"type": "Ready", "status": "True", "lastTransitionTime": 5}]],
    ids=["none", "not-a-list", "no-status", "bad-time"],
)
def test_previous_conditions_of_any_shape_are_tolerated(previous: object) -> None:
    """A previous status we cannot use gives the current time, not an error."""
    rendered = render_conditions(
        [Condition("Ready", "True", "Ready", "ok")], generation=None, previous=previous, now=T0
    )
    assert rendered == [
        {
            "type": "Ready",
            "status": "True",
            "reason": "Ready",
            "message": "ok",
            "lastTransitionTime": "2026-03-01T12:00:00Z",
        }
    ]
