"""The field checks alone: defaults for absent values, and messages test_resources does not pin."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from extproc.catalog import fields
from extproc.catalog.fields import FieldError


@pytest.mark.parametrize(
    ("check", "expected"),
    [
        (lambda: fields.mapping(None, "m"), {}),
        (lambda: fields.array(None, "a", 1), []),
        (lambda: fields.string(None, "s"), ""),
        (lambda: fields.string("", "s"), ""),
        (lambda: fields.int_or_string(None, "p"), None),
        (lambda: fields.int_or_string("http", "p", required=True), "http"),
        (lambda: fields.boolean(None, "b"), None),
        (lambda: fields.integer(5, "i", 5, 5), 5),
    ],
    ids=["mapping", "array", "string", "empty-optional-string", "port", "port-name", "boolean", "bounds"],
)
def test_absent_and_edge_values_are_accepted(check: Callable[[], Any], expected: Any) -> None:
    """Absent optional fields get an empty default; bounds are inclusive."""
    assert check() == expected


@pytest.mark.parametrize(
    ("check", "message"),
    [
        (lambda: fields.mapping([1], "spec"), "spec: must be a mapping, got [1]"),
        (lambda: fields.array((1,), "xs", 5), "xs: must be a list, got [1]"),
        (
            lambda: fields.int_or_string("", "p"),
            'p: must be a port number (1-65535) or a port name, got ""',
        ),
        (
            lambda: fields.int_or_string(1.5, "p"),
            "p: must be a port number (1-65535) or a port name, got 1.5",
        ),
        (lambda: fields.timestamp(17, "t"), "t: must be an RFC 3339 date-time, got 17"),
        (lambda: fields.match("ab", "a", "m", "an a"), 'm: must be an a (pattern a), got "ab"'),
    ],
    ids=[
        "not-mapping",
        "tuple",
        "empty-port",
        "float-port",
        "timestamp-number",
        "partial-match",
    ],
)
def test_failures_name_the_field_and_the_value(check: Callable[[], Any], message: str) -> None:
    """A failure is FieldError(path, detail), and ``str()`` is ``path: detail``."""
    with pytest.raises(FieldError) as info:
        check()
    assert str(info.value) == message
    assert f"{info.value.path}: {info.value.detail}" == message


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("x", '"x"'),
        (None, "null"),
        (False, "false"),
        ("é", '"é"'),
        ("y" * 78, '"' + "y" * 78 + '"'),
        ("y" * 79, '"' + "y" * 76 + "..."),
    ],
    ids=["string", "null", "bool", "unicode", "80-chars", "81-chars-cut"],
)
def test_values_are_shown_as_written_in_yaml(value: Any, shown: str) -> None:
    """Values appear JSON-style, unescaped, and cut to 80 characters."""
    assert fields.show(value) == shown
