"""The scheduler with a prefix matcher, through request control: cached prompt tokens decide, load
breaks ties, decisions learn."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from control.test_load import lease

from extproc.control.load import LoadView
from extproc.control.requests import RequestControl
from extproc.errors import ModelNotFound, NoReadyEndpoint
from extproc.openai import InferenceRequest, read_request
from extproc.scheduling.cache_then_load import CacheThenLoad
from extproc.scheduling.hooks import remember_affinity
from extproc.scheduling.prefix import NO_MATCH
from extproc.scheduling.scheduler import Decision, Scheduler
from extproc.settings import CandidateSettings
from extproc.types import EndpointAddress
from scheduling.test_prefix import (
    BIG,
    CHAT,
    COMPLETIONS,
    KV1,
    KV2,
    LLAMA,
    PLAIN,
    PROMPT_IDS,
    PROMPTS,
    Q1,
    Q2,
    QWEN,
    Router,
    engine_tokens,
)


def req(model: str, path: str, payload: dict[str, Any]) -> InferenceRequest:
    """The typed request for ``payload`` sent to ``path`` for ``model``."""
    return read_request(path, {"model": model, **payload})


class Deciding:
    """Request control's decision path (resolve once, decide, learn), without keeping the lease."""

    def __init__(self, control: RequestControl) -> None:
        self._control = control

    def schedule(self, request: InferenceRequest | None, subset: frozenset[str] | None = None) -> Decision:
        routed = self._control.route(request, subset)
        assert not isinstance(routed, Coroutine), "no tokenizing pool here: decided at once"
        self._control.release(routed.lease)
        return routed.decision


def make_scheduler(
    router: Router | None,
    load: LoadView,
    *,
    seed: int = 1,
    max_fallbacks: int = 3,
    candidates: CandidateSettings | None = None,
    reachable: Callable[[EndpointAddress], bool] | None = None,
) -> Deciding:
    catalog = (router or Router()).catalog
    scheduler = Scheduler(
        load,
        CacheThenLoad(),
        max_fallbacks=max_fallbacks,
        rng=random.Random(seed),
        prefix=None if router is None else router.matcher,
        hooks=() if router is None else (remember_affinity(router.matcher),),
        candidates=candidates,
        reachable=reachable,
    )
    return Deciding(RequestControl(catalog=lambda: catalog, scheduler=scheduler, load=load))


def busy(load: LoadView, **counts: int) -> None:
    """Add ``counts[name]`` leases on the endpoint of that name (KV1, KV2, ...)."""
    named = {"KV1": KV1, "KV2": KV2, "BIG": BIG, "PLAIN": PLAIN, "Q1": Q1, "Q2": Q2}
    for name, count in counts.items():
        for _ in range(count):
            load.add(lease(named[name]))


@pytest.mark.parametrize(("path", "payload"), PROMPTS, ids=PROMPT_IDS)
def test_precise_holder_wins_over_less_loaded_pods(path: str, payload: dict[str, Any]) -> None:
    """The pod holding the most of the prompt goes first even when busier; fallbacks follow the same order."""
    router, inflight = Router(), LoadView()
    tokens = engine_tokens(path, payload)
    router.feed(KV2, tokens, 6)
    router.feed(BIG, tokens, 2, engine_block=32)
    busy(inflight, KV2=5, BIG=1, KV1=2)
    decision = make_scheduler(router, inflight).schedule(req(LLAMA, path, payload))
    assert [e.address for e in decision.endpoints] == [KV2, BIG, PLAIN, KV1]
    assert decision.prefix.mode == "precise"
    assert decision.prefix.cached_tokens[KV2] == 6 * 16
    assert decision.prefix.prompt_tokens == len(tokens)


def test_precise_decision_records_nothing() -> None:
    """When every candidate publishes KV events, the engines' events are the only memory."""
    router, inflight = Router(), LoadView()
    path, payload = PROMPTS[0]
    decision = make_scheduler(router, inflight).schedule(req(LLAMA, path, payload), frozenset({KV1, KV2}))
    assert decision.prefix.mode == "precise" and decision.prefix.approx_keys == []
    assert len(router.matcher.approx) == 0


@pytest.mark.parametrize(
    ("path", "first", "second"),
    [
        (COMPLETIONS, {"prompt": "p" * 300 + "one"}, {"prompt": "p" * 300 + "two"}),
        (
            CHAT,
            {"messages": [{"role": "system", "content": "s" * 300}, {"role": "user", "content": "A?"}]},
            {"messages": [{"role": "system", "content": "s" * 300}, {"role": "user", "content": "B?"}]},
        ),
    ],
    ids=PROMPT_IDS,
)
def test_approximate_decisions_are_recorded_and_followed(
    path: str, first: dict[str, Any], second: dict[str, Any]
) -> None:
    """Without a tokenizer, a request sharing an earlier prefix follows it to its pod, even when busier."""
    router, inflight = Router(), LoadView()
    scheduler = make_scheduler(router, inflight)
    one = scheduler.schedule(req(QWEN, path, first))
    assert one.prefix.mode == "approximate" and one.prefix.cached_tokens == {}
    assert len(router.matcher.approx) == len(one.prefix.approx_keys) > 0
    went = one.endpoints[0].address
    inflight.add(lease(went))
    two = scheduler.schedule(req(QWEN, path, second))
    assert two.endpoints[0].address == went
    assert two.prefix.mode == "approximate" and two.prefix.cached_tokens[went] > 0


def test_without_prefix_scorer_or_prompt_the_least_loaded_wins() -> None:
    """No scorer, or no body: load alone decides and the decision carries no match."""
    router, inflight = Router(), LoadView()
    path, payload = PROMPTS[0]
    router.feed(KV2, engine_tokens(path, payload), 6)
    busy(inflight, KV2=1, KV1=1, BIG=1)
    decision = make_scheduler(None, inflight).schedule(req(LLAMA, path, payload))
    assert decision.endpoints[0].address == PLAIN
    assert decision.prefix is NO_MATCH
    bodiless = make_scheduler(router, inflight).schedule(None)
    assert bodiless.route is None and bodiless.prefix is NO_MATCH
    assert router.matcher.counters.lookups == {"precise": 0, "approximate": 0, "none": 0}


def test_requests_without_a_prompt_are_scheduled_by_load_and_not_recorded() -> None:
    """An embeddings request is matched in mode none: least loaded wins, nothing is learned."""
    router, inflight = Router(), LoadView()
    busy(inflight, Q1=2)
    decision = make_scheduler(router, inflight).schedule(req(QWEN, "/v1/embeddings", {"input": "x" * 500}))
    assert decision.endpoints[0].address == Q2
    assert decision.prefix.mode == "none"
    assert len(router.matcher.approx) == 0


def test_subset_is_applied_before_scoring() -> None:
    """A holder outside the gateway's subset hint is neither scored nor picked."""
    router, inflight = Router(), LoadView()
    path, payload = PROMPTS[0]
    router.feed(KV2, engine_tokens(path, payload), 6)
    decision = make_scheduler(router, inflight).schedule(
        req(LLAMA, path, payload), frozenset({KV1, "10.0.3.1"})
    )
    assert {e.address for e in decision.endpoints} == {KV1, BIG}
    assert KV2 not in decision.prefix.cached_tokens  # the holder outside the subset was not matched


def test_equal_cache_ties_are_spread() -> None:
    """Two pods holding the same prefix with equal load share the requests."""
    router, inflight = Router(), LoadView()
    path, payload = PROMPTS[1]
    tokens = engine_tokens(path, payload)
    router.feed(KV1, tokens, 4)
    router.feed(KV2, tokens, 4)
    scheduler = make_scheduler(router, inflight, seed=5)
    picks = Counter(scheduler.schedule(req(LLAMA, path, payload)).endpoints[0].address for _ in range(400))
    assert set(picks) == {KV1, KV2}
    assert min(picks.values()) > 120, picks


@pytest.mark.parametrize(
    ("model", "subset", "error"),
    [("nope", None, ModelNotFound), (LLAMA, frozenset({"10.9.9.9"}), NoReadyEndpoint)],
    ids=["unknown-model", "subset-excludes-all"],
)
def test_errors_come_before_any_lookup(
    model: str, subset: frozenset[str] | None, error: type[Exception]
) -> None:
    """Unknown models and empty subsets fail without a prefix lookup."""
    router = Router()
    with pytest.raises(error):
        make_scheduler(router, LoadView()).schedule(req(model, *PROMPTS[0]), subset)
    assert router.matcher.counters.lookups == {"precise": 0, "approximate": 0, "none": 0}


#: A bounded candidate set smaller than the LLAMA pool's four endpoints: one prefix holder, one
#: least-loaded endpoint, nothing at random.
TWO = CandidateSettings(prefix_holders=1, least_loaded=1, random=0)


def test_a_large_pool_scores_the_best_prefix_holder_and_the_least_loaded_only() -> None:
    """Past the candidate limits, the decision scores the top prefix holder and the least-loaded
    endpoint, nothing else: the holder wins as when every endpoint is scored, and the fallbacks come
    from the scored set."""
    router, load = Router(), LoadView()
    path, payload = PROMPTS[0]
    router.feed(KV2, engine_tokens(path, payload), 6)
    busy(load, KV2=3, KV1=2, BIG=2)
    bounded = make_scheduler(router, load, candidates=TWO).schedule(req(LLAMA, path, payload))
    everyone = make_scheduler(router, load).schedule(req(LLAMA, path, payload))
    assert bounded.pick.address == everyone.pick.address == KV2
    assert [e.address for e in bounded.endpoints] == [KV2, PLAIN]
    assert len(everyone.endpoints) == 4


def test_a_large_pool_with_no_prefix_holder_goes_to_the_least_loaded() -> None:
    """With nothing cached anywhere, the least-loaded endpoint is scored and picked."""
    router, load = Router(), LoadView()
    busy(load, KV1=2, KV2=1, PLAIN=3)
    path, payload = PROMPTS[0]
    decision = make_scheduler(router, load, candidates=TWO).schedule(req(LLAMA, path, payload))
    assert decision.pick.address == BIG


def test_a_large_pool_whose_chosen_endpoints_are_all_down_looks_at_the_rest() -> None:
    """When the endpoints chosen for scoring are all gone, the rest of the pool is scored before
    a request is sent to a dead engine."""
    router, load = Router(), LoadView()
    path, payload = PROMPTS[0]
    router.feed(KV2, engine_tokens(path, payload), 6)
    up = {PLAIN}
    deciding = make_scheduler(router, load, candidates=TWO, reachable=lambda a: a in up)
    assert deciding.schedule(req(LLAMA, path, payload)).pick.address == PLAIN


def test_a_large_pool_spreads_equal_requests_over_every_endpoint() -> None:
    """Requests held open on a pool larger than the candidate set reach every endpoint: none
    starves behind the ones scored first."""
    router, load = Router(), LoadView()
    deciding = make_scheduler(router, load, candidates=TWO)
    picks: Counter[str] = Counter()
    for _ in range(8):
        decision = deciding.schedule(req(LLAMA, COMPLETIONS, {"prompt": "Hi"}))
        load.add(lease(decision.pick.address))  # held open
        picks[decision.pick.address] += 1
    assert set(picks) == {e.address for e in router.route(LLAMA).endpoints}
    assert max(picks.values()) == 2
