"""Which endpoints of a large pool a decision scores: prefix holders, least loaded, random."""

from __future__ import annotations

import random

from extproc.catalog.model import Catalog
from extproc.scheduling.candidates import choose
from extproc.scheduling.pool import build_pool
from extproc.settings import CandidateSettings
from tests.scheduling.candidates import endpoints

EPS = endpoints(40)
POOL = build_pool(Catalog(), EPS)


def addresses(n: int) -> list[str]:
    return [e.address for e in EPS[:n]]


def test_the_longest_holders_the_least_loaded_and_random_ones_are_chosen_once_each() -> None:
    limits = CandidateSettings(prefix_holders=2, least_loaded=3, random=2)
    cached = {EPS[0].address: 64, EPS[1].address: 32, EPS[2].address: 16}
    least = [EPS[1].address, EPS[5].address, EPS[6].address]
    chosen = [e.address for e in choose(POOL, cached, least, limits, random.Random(1))]
    assert chosen[:4] == [EPS[0].address, EPS[1].address, EPS[5].address, EPS[6].address]
    assert EPS[2].address not in chosen[:4]
    assert len(chosen) == len(set(chosen)) <= 6


def test_holders_tied_at_the_cut_take_turns() -> None:
    """A prefix every endpoint holds equally (a system prompt) must not make the same few the
    scored holders of every request: the tied are drawn at random, the longer holder always kept."""
    limits = CandidateSettings(prefix_holders=3, least_loaded=1, random=0)
    cached = dict.fromkeys(addresses(30), 16) | {EPS[35].address: 48}
    rng = random.Random(2)
    seen: set[str] = set()
    for _ in range(50):
        chosen = [e.address for e in choose(POOL, cached, [], limits, rng)]
        assert chosen[0] == EPS[35].address and len(chosen) == 3
        seen.update(chosen[1:])
    assert len(seen) > 20
