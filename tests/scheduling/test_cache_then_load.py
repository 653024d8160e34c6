"""cache-then-load: most cached prompt tokens first, then least load, random ties."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from extproc.scheduling.cache_then_load import CacheThenLoad
from extproc.scheduling.policy import RequestFacts
from tests.scheduling.candidates import candidates

FACTS = RequestFacts("m", 100, None)


@pytest.mark.parametrize(
    ("cached", "load", "expected"),
    [
        ({2: 64}, [0, 9, 1, 2], [2, 1, 3, 4]),
        ({1: 16, 2: 64, 3: 32}, [0, 9, 5, 0], [2, 3, 1, 4]),
        ({1: 32, 2: 32}, [3, 1, 0, 2], [2, 1, 3, 4]),
        ({1: 0, 2: 0}, [3, 1, 2, 4], [2, 3, 1, 4]),
        ({}, [3, 1, 2, 4], [2, 3, 1, 4]),
        ({3: 16, 4: 48}, [1, 0, 0, 7], [4, 3, 2, 1]),
    ],
    ids=[
        "cached-beats-load",
        "by-cached-tokens",
        "equal-cached-least-loaded",
        "all-zero-is-by-load",
        "empty-is-by-load",
        "absent-counts-as-zero",
    ],
)
def test_most_cached_tokens_first_then_least_load(
    cached: dict[int, int], load: list[int], expected: list[int]
) -> None:
    """Endpoints holding more of the prompt come first; load orders equal holders; absent holds 0."""
    ranked = CacheThenLoad().rank(FACTS, candidates(load, cached), random.Random(1)).candidates
    assert [int(c.endpoint.ip.rsplit(".", 1)[1]) for c in ranked] == expected


def test_cached_ties_are_broken_at_random() -> None:
    """Equal cached tokens and equal load: every tied endpoint is picked first sometimes, others never."""
    pool = candidates([0, 0, 0, 0], cached={1: 32, 3: 32, 4: 16})
    rng = random.Random(9)
    firsts: Counter[str] = Counter()
    for _ in range(2000):
        ranked = CacheThenLoad().rank(FACTS, pool, rng).candidates
        firsts[ranked[0].endpoint.ip] += 1
        assert {ranked[0].endpoint.ip, ranked[1].endpoint.ip} == {"127.0.0.1", "127.0.0.3"}
        assert ranked[2].endpoint.ip == "127.0.0.4"
    assert set(firsts) == {"127.0.0.1", "127.0.0.3"}
    assert min(firsts.values()) > 800, firsts
