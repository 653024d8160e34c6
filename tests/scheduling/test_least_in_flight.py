"""least-in-flight: fewest in-flight first, random among ties, ordered fallbacks."""

from __future__ import annotations

import random
from collections import Counter

from extproc.scheduling.least_in_flight import LeastInFlight
from extproc.scheduling.policy import RequestFacts
from tests.scheduling.candidates import candidates

FACTS = RequestFacts("m", None, None)


def test_least_loaded_first() -> None:
    """The endpoint with the fewest in-flight requests comes first, the rest in load order."""
    ranked = LeastInFlight().rank(FACTS, candidates([4, 1, 2], cached={1: 512}), random.Random(1))
    assert [c.endpoint.ip for c in ranked.candidates] == ["127.0.0.2", "127.0.0.3", "127.0.0.1"]
    assert not ranked.shed and ranked.prediction is None


def test_ties_are_broken_evenly() -> None:
    """Equal load spreads picks across all tied endpoints instead of always the first."""
    rng = random.Random(3)
    pool = candidates([0, 0, 0, 0])
    firsts = Counter(LeastInFlight().rank(FACTS, pool, rng).candidates[0].endpoint.ip for _ in range(4000))
    assert len(firsts) == 4
    assert min(firsts.values()) > 800, firsts


def test_no_candidates() -> None:
    """Nothing to rank gives an empty ranking."""
    assert LeastInFlight().rank(FACTS, [], random.Random()).candidates == []
