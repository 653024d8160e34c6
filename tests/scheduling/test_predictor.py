"""The TTFT predictor and the predicted-ttft policy, on constructed states and against the simulator."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from extproc.catalog.model import Endpoint
from extproc.scheduling.engine_signals import EngineSignals
from extproc.scheduling.policy import Candidate, Ranking, RequestFacts
from extproc.scheduling.predictor import (
    PredictedTTFT,
    Prediction,
    effective_cached_tokens,
    predict,
)
from extproc.scheduling.profiles import DEFAULT, Profile
from extproc.sim.engine_core import EngineCore, EngineParams, SimRequest
from extproc.types import EndpointAddress, WorkerSetKey

FAST = WorkerSetKey("default/fast")
SLOW = WorkerSetKey("default/slow")


def endpoint(n: int, worker_set: WorkerSetKey = FAST) -> Endpoint:
    ip = f"10.0.0.{n}"
    return Endpoint(EndpointAddress(f"{ip}:8000"), ip, 8000, worker_set)


def signals(running: int, waiting: int = 0, engines: tuple[str, ...] = ()) -> EngineSignals:
    return EngineSignals(running, waiting, 0.1, None, None, engines=engines)


def cand(n: int, *, in_flight: int = 0, cached: int = 0, sig: EngineSignals | None = None) -> Candidate:
    return Candidate(endpoint(n), in_flight, cached, sig)


def facts(prompt: int | None) -> RequestFacts:
    return RequestFacts("m", prompt, None)


def policy(profile: Profile = DEFAULT) -> PredictedTTFT:
    return PredictedTTFT(lambda _e: profile)


def first(ranking: Ranking) -> Candidate:
    return ranking.candidates[0]


def order(ranked: Ranking | list[Candidate]) -> list[str]:
    return [c.endpoint.ip for c in (ranked.candidates if isinstance(ranked, Ranking) else ranked)]


# -- the formula on constructed states ----------------------------------------------------------------


def test_idle_pod_is_chunked_prefill_of_the_uncached_tokens() -> None:
    p = DEFAULT
    got = predict(facts(2000), cand(1, cached=0), p)
    assert got.ttft_s == pytest.approx(2000 / 16_000 + 0.006)
    assert (got.uncached_tokens, got.load, got.saturated) == (2000, 0, False)
    big = predict(facts(20_000), cand(1), p)  # three chunks of 8192: three step overheads
    assert big.ttft_s == pytest.approx(20_000 / 16_000 + 3 * 0.006)


def test_uncached_tokens_drive_ttft() -> None:
    ttfts = [predict(facts(4000), cand(1, cached=c), DEFAULT).ttft_s for c in (0, 1000, 3000, 3999, 5000)]
    assert ttfts == sorted(ttfts, reverse=True)
    assert ttfts[0] - ttfts[2] == pytest.approx(3000 / 16_000)
    # Fully cached: the engine still computes one token (and an over-reported hit is clamped).
    assert ttfts[3] == ttfts[4] == pytest.approx(1 / 16_000 + 0.006)
    assert predict(facts(4000), cand(1, cached=5000), DEFAULT).uncached_tokens == 0


def test_unknown_prompt_assumes_the_typical_prompt() -> None:
    assert predict(facts(None), cand(1), DEFAULT) == predict(facts(512), cand(1), DEFAULT)
    custom = replace(DEFAULT, typical_prompt_tokens=2048)
    assert predict(facts(None), cand(1), custom).uncached_tokens == 2048


def test_load_is_the_larger_of_our_count_and_the_scrape() -> None:
    assert predict(facts(100), cand(1, in_flight=3, sig=signals(1, 1)), DEFAULT).load == 3
    assert predict(facts(100), cand(1, in_flight=1, sig=signals(5, 2)), DEFAULT).load == 7
    # Stale signals arrive as None: our own count stands alone.
    assert predict(facts(100), cand(1, in_flight=4), DEFAULT).load == 4


def test_requests_the_scrape_has_not_seen_count_as_prefill_ahead() -> None:
    """Between scrapes our own accounting fills the gap: a burst to one pod is visible at once."""
    seen = predict(facts(1000), cand(1, in_flight=4, sig=signals(4)), DEFAULT).ttft_s
    unseen = predict(facts(1000), cand(1, in_flight=4, sig=signals(0)), DEFAULT).ttft_s
    assert unseen > seen
    assert unseen == pytest.approx(0.003 + (4 * 512 + 1000) / 16_000 + 0.006)


def test_decode_interference_grows_with_the_running_batch() -> None:
    ttfts = [
        predict(facts(1000), cand(1, in_flight=n, sig=signals(n)), DEFAULT).ttft_s for n in (0, 8, 64, 256)
    ]
    assert ttfts == sorted(ttfts)
    step = 0.006 + 0.000_15 * 64
    assert ttfts[2] == pytest.approx(step / 2 + 1000 / 16_000 + step)


def test_queue_beyond_the_batch_cap_waits_for_seats() -> None:
    p = replace(DEFAULT, max_num_seqs=8, max_num_batched_tokens=1024)
    full = predict(facts(100), cand(1, in_flight=8, sig=signals(8)), p).ttft_s
    queued = predict(facts(100), cand(1, in_flight=10, sig=signals(8, 2)), p).ttft_s
    seat = p.typical_output_tokens * p.step_s(8) / 8
    # A full batch already waits for one seat; two queued ahead need two more, and their prefills go
    # first (2 x 512 more tokens: a second chunk of the 1024-token budget, so one more step).
    expected_extra = 2 * seat + 2 * 512 / 16_000 + p.step_s(8)
    assert queued - full == pytest.approx(expected_extra)


def test_data_parallel_ranks_share_the_load() -> None:
    one = predict(facts(1000), cand(1, in_flight=300, sig=signals(256, 44)), DEFAULT)
    two = predict(facts(1000), cand(1, in_flight=300, sig=signals(256, 44, engines=("0", "1"))), DEFAULT)
    assert two.ttft_s < one.ttft_s
    assert one.load == two.load == 300


def test_effective_cached_tokens_weights_lower_tiers() -> None:
    assert effective_cached_tokens(1024, 1000, DEFAULT) == 1024 + 800
    assert effective_cached_tokens(64, 64, replace(DEFAULT, lower_tier_hit_weight=0.0)) == 64
    assert effective_cached_tokens(-1, -5, DEFAULT) == 0


# -- ranking --------------------------------------------------------------------------------------------


def test_offloaded_prefix_beats_a_cold_pod_but_not_the_same_prefix_on_gpu() -> None:
    prompt = facts(4096)
    cold = cand(1, in_flight=2)
    offloaded = replace(cand(2, in_flight=2), lower_tier_tokens=3072)
    on_gpu = cand(3, in_flight=2, cached=3072)
    ttft = {c.endpoint.address: predict(prompt, c, DEFAULT).ttft_s for c in (cold, offloaded, on_gpu)}
    assert ttft[on_gpu.endpoint.address] < ttft[offloaded.endpoint.address] < ttft[cold.endpoint.address]
    ignore_lower = replace(DEFAULT, lower_tier_hit_weight=0.0)
    assert predict(prompt, offloaded, ignore_lower).ttft_s == predict(prompt, cold, ignore_lower).ttft_s


def test_cache_hit_wins_when_loads_are_equal() -> None:
    for seed in range(20):
        for sig in (None, signals(6, 0)):
            hot = cand(2, in_flight=6, cached=1024, sig=sig)
            cold = [cand(n, in_flight=6, sig=sig) for n in (1, 3, 4)]
            ranked = policy().rank(facts(3000), [*cold, hot], random.Random(seed))
            assert first(ranked) is hot


def test_affinity_yields_when_the_holders_queue_grows() -> None:
    """Same prefix: the holder keeps it while it is the cheapest, a cold pod wins once its queue costs
    more; charging the prefill work a cold pod would spend keeps the prefix where it is for longer."""
    request = facts(7200)

    def winners(holder: Candidate, profile: Profile) -> frozenset[str]:
        """Who ranks first over several seeds (both, in the near-tie zone)."""
        return frozenset(
            first(policy(profile).rank(request, [holder, cand(2)], random.Random(seed))).endpoint.ip
            for seed in range(16)
        )

    def assert_yields(sequence: list[frozenset[str]]) -> int:
        """Holder only, then at most a few near-tie steps, then the cold pod only; returns the flip."""
        holder, cold = frozenset({"10.0.0.1"}), frozenset({"10.0.0.2"})
        assert sequence[0] == holder
        flip = sequence.index(cold)
        assert all(w == cold for w in sequence[flip:])
        assert all(w == holder for w in sequence[: flip - 3])
        return flip

    ttft_only = replace(DEFAULT, prefill_work_weight=0.0)
    # Between scrapes (our accounting only): the requests we sent it are prefill ahead (~32 ms each
    # against a cold prefill of 7200 tokens, ~450 ms).
    flips = {
        weight: assert_yields(
            [
                winners(cand(1, in_flight=n, cached=6000), replace(DEFAULT, prefill_work_weight=weight))
                for n in range(80)
            ]
        )
        for weight in (0.0, 1.0, 2.0)
    }
    assert 8 < flips[0.0] < 20
    # The cold pod's 7,200 tokens (~450 ms of its compute) against the holder's 1,200 (~75 ms): each
    # unit of weight lets the holder queue ~375 ms (~12 requests of ~32 ms) more before it loses.
    assert flips[0.0] + 8 < flips[1.0] < flips[0.0] + 16
    assert flips[1.0] + 8 < flips[2.0] < flips[1.0] + 16
    # From the scrape: a full batch is still worth it, a queue behind it soon is not.
    flip = assert_yields(
        [winners(cand(1, in_flight=256 + w, cached=6000, sig=signals(256, w)), ttft_only) for w in range(40)]
    )
    assert 1 < flip < 10
    assert flip < assert_yields(
        [winners(cand(1, in_flight=256 + w, cached=6000, sig=signals(256, w)), DEFAULT) for w in range(40)]
    )


def test_ranking_charges_the_prefill_work_a_pick_spends_but_notes_its_ttft() -> None:
    """A cold pod a little faster to the first token loses to the holder, whose pick spends less
    compute; the answer still carries the pick's predicted TTFT, and weight 0 ranks by TTFT alone."""
    request = facts(8000)
    holder = cand(1, in_flight=16, cached=7000)  # 16 x 512 tokens ahead: ~580 ms to its first token
    cold = cand(2)  # ~510 ms
    ttft_only = replace(DEFAULT, prefill_work_weight=0.0)
    assert predict(request, cold, DEFAULT).ttft_s < predict(request, holder, DEFAULT).ttft_s
    for seed in range(8):
        ranked = policy().rank(request, [cold, holder], random.Random(seed))
        assert first(ranked) is holder
        assert ranked.prediction == predict(request, holder, DEFAULT)
        assert first(policy(ttft_only).rank(request, [cold, holder], random.Random(seed))) is cold
    spent = predict(request, cold, DEFAULT)
    assert spent.cost_s == pytest.approx(
        spent.ttft_s + DEFAULT.prefill_work_weight * 8000 / DEFAULT.prefill_tokens_per_s
    )


def test_saturated_endpoints_rank_last_and_all_saturated_sheds() -> None:
    p = replace(DEFAULT, max_num_seqs=8, max_num_batched_tokens=1024, queue_limit=2)
    hot = cand(1, in_flight=10, cached=3000, sig=signals(8, 2))  # queue at its limit: saturated
    busy = cand(2, in_flight=9, sig=signals(8, 1))
    prediction = predict(facts(3100), hot, p)
    assert prediction.saturated
    assert not predict(facts(3100), busy, p).saturated
    ordered = policy(p).ordered(facts(3100), [hot, busy], random.Random(0))
    assert [c.endpoint.ip for _, c in ordered] == ["10.0.0.2", "10.0.0.1"]
    assert [x.saturated for x, _ in ordered] == [False, True]
    ranking = policy(p).rank(facts(3100), [hot, busy], random.Random(0))
    assert order(ranking) == ["10.0.0.2", "10.0.0.1"]
    assert not ranking.shed
    both = [hot, cand(2, in_flight=11, sig=signals(8, 3))]
    assert all(x.saturated for x, _ in policy(p).ordered(facts(3100), both, random.Random(0)))
    ranking = policy(p).rank(facts(3100), both, random.Random(0))
    assert ranking.shed
    assert len(ranking.candidates) == 2  # still ranked, for a caller that does not shed


def test_ranking_has_no_side_effects_and_notes_the_picks_prediction() -> None:
    """rank() is pure: the same inputs and seed give the same ranking and prediction, every time."""
    p = replace(DEFAULT, max_num_seqs=8, max_num_batched_tokens=1024, queue_limit=2)
    chosen = policy(p)
    pool = [cand(1, in_flight=10, cached=3000, sig=signals(8, 2)), cand(2, in_flight=9, sig=signals(8, 1))]
    rankings = [chosen.rank(facts(3100), pool, random.Random(0)) for _ in range(3)]
    assert all(r == rankings[0] for r in rankings)
    assert rankings[0].prediction == predict(facts(3100), pool[1], p)


def test_without_a_queue_limit_nothing_is_saturated() -> None:
    deep = cand(1, in_flight=5000, sig=signals(256, 4744))
    assert not predict(facts(100), deep, DEFAULT).saturated
    assert not policy().rank(facts(100), [deep], random.Random(0)).shed
    assert not policy().rank(facts(100), [], random.Random(0)).shed


def test_queue_limit_zero_saturates_at_the_batch_cap() -> None:
    p = replace(DEFAULT, max_num_seqs=4, max_num_batched_tokens=64, queue_limit=0)
    assert not predict(facts(10), cand(1, in_flight=3), p).saturated
    assert predict(facts(10), cand(1, in_flight=4), p).saturated


def test_ties_are_random_but_reproducible_with_a_seed() -> None:
    pods = [cand(n, in_flight=2) for n in range(1, 6)]
    runs = [order(policy().rank(facts(1000), pods, random.Random(seed))) for seed in range(30)]
    again = [order(policy().rank(facts(1000), pods, random.Random(seed))) for seed in range(30)]
    assert runs == again
    assert len({r[0] for r in runs}) == 5


def test_near_ties_within_tolerance_shuffle_clear_winners_do_not() -> None:
    # 16 cached tokens save 1 ms of prefill on a ~70 ms prediction: a tie.
    near = [cand(1, cached=0), cand(2, cached=16)]
    firsts = {first(policy().rank(facts(1000), near, random.Random(s))).endpoint.ip for s in range(30)}
    assert firsts == {"10.0.0.1", "10.0.0.2"}
    # 512 cached tokens save 32 ms: always first.
    clear = [cand(1, cached=0), cand(2, cached=512)]
    firsts = {first(policy().rank(facts(1000), clear, random.Random(s))).endpoint.ip for s in range(30)}
    assert firsts == {"10.0.0.2"}


def test_each_endpoint_uses_its_worker_sets_profile() -> None:
    slow = replace(DEFAULT, prefill_tokens_per_s=4000.0)
    profiles = {FAST: DEFAULT, SLOW: slow}
    chosen = PredictedTTFT(lambda e: profiles[e.worker_set])
    fast_pod = Candidate(endpoint(1, FAST), 3, 0)
    slow_pod = Candidate(endpoint(2, SLOW), 0, 0)
    ordered = chosen.ordered(facts(4000), [slow_pod, fast_pod], random.Random(0))
    assert ordered[0][1] is fast_pod
    assert ordered[1][0] == predict(facts(4000), slow_pod, slow)
    ranking = chosen.rank(facts(4000), [slow_pod, fast_pod], random.Random(0))
    assert first(ranking) is fast_pod
    best = ordered[0][0]
    assert ranking.prediction == best
    assert chosen.name == "predicted-ttft"


# -- against the simulator ------------------------------------------------------------------------------


def profile_of(params: EngineParams) -> Profile:
    return Profile(
        prefill_tokens_per_s=params.prefill_tokens_per_s,
        decode_base_ms=params.decode_base_s * 1000,
        decode_per_seq_ms=params.decode_per_seq_s * 1000,
        max_num_seqs=params.max_num_seqs,
        max_num_batched_tokens=params.max_num_batched_tokens,
    )


_ids = iter(range(10**9))


def sim_request(rid: str, prompt: int, output: int, arrival: float = 0.0) -> SimRequest:
    base = next(_ids) * 100_000  # distinct tokens: no accidental prefix hits
    return SimRequest(rid, list(range(base, base + prompt)), [1] * output, arrival_time=arrival)


def run_until_first_token(core: EngineCore, rid: str, now: float) -> tuple[float, float]:
    """Step from ``now`` until ``rid`` has its first token: (its ttft, the model time reached)."""
    for _ in range(10_000):
        result = core.step(now)
        now += result.duration
        for out in result.outputs:
            if out.request_id == rid and out.ttft is not None:
                return out.ttft, now
    raise AssertionError("no first token")


def test_the_default_profile_is_the_simulators_engine() -> None:
    assert profile_of(EngineParams()) == DEFAULT


@pytest.mark.parametrize(
    ("budget", "prompt"), [(8192, 100), (8192, 2000), (8192, 8000), (1024, 5000), (512, 3000)]
)
def test_idle_prediction_matches_the_simulator(budget: int, prompt: int) -> None:
    params = EngineParams(max_num_batched_tokens=budget)
    core = EngineCore(params)
    core.add_request(sim_request("a", prompt, 2))
    ttft, _ = run_until_first_token(core, "a", 0.0)
    predicted = predict(facts(prompt), cand(1), profile_of(params)).ttft_s
    assert predicted == pytest.approx(ttft, rel=0.03)


@pytest.mark.parametrize(
    ("budget", "running", "prompt"), [(8192, 16, 2000), (8192, 128, 4000), (1024, 64, 3000)]
)
def test_prediction_with_running_decodes_matches_the_simulator(
    budget: int, running: int, prompt: int
) -> None:
    params = EngineParams(max_num_batched_tokens=budget)
    core = EngineCore(params)
    for i in range(running):
        core.add_request(sim_request(f"d{i}", 32, 500))
    now, last = 0.0, 0.0
    while core.num_waiting or core.generation_tokens < running:  # every decode has its first token
        result = core.step(now)
        now, last = now + result.duration, result.duration
    result = core.step(now)  # one pure decode step; the new request arrives halfway through it
    assert result.num_decode_seqs == running
    now, last = now + result.duration, result.duration
    core.add_request(sim_request("new", prompt, 2, arrival=now - last / 2))
    ttft, _ = run_until_first_token(core, "new", now)
    state = cand(1, in_flight=running, sig=signals(running))
    predicted = predict(facts(prompt), state, profile_of(params)).ttft_s
    assert predicted == pytest.approx(ttft, rel=0.03)


def test_prediction_counts_a_block_aligned_cache_hit_like_the_simulator() -> None:
    params = EngineParams()
    core = EngineCore(params)
    shared = sim_request("warm", 3000, 1)
    core.add_request(shared)
    now = run_until_first_token(core, "warm", 0.0)[1]
    core.step(now)  # let it finish and free (its blocks stay cached)
    hit = SimRequest(
        "hit",
        [*list(shared.prompt_token_ids[:2048]), *range(900_000_000, 900_001_000)],
        [1, 1],
        arrival_time=now,
    )
    core.add_request(hit)
    ttft, _ = run_until_first_token(core, "hit", now)
    predicted = predict(facts(3048), cand(1, cached=2048), profile_of(params))
    assert predicted.uncached_tokens == 1000
    assert predicted.ttft_s == pytest.approx(ttft, rel=0.03)


def test_prediction_type_is_plain_data() -> None:
    assert Prediction(0.1, 10, 1, False) == Prediction(0.1, 10, 1, False)


def test_our_pending_prefills_are_charged_exactly_without_signals() -> None:
    """With no scrape, requests we routed still prefilling cost their real tokens; decoding ones do not."""
    prefilling = replace(cand(1, in_flight=3), pending_prefill_tokens=30_000, pending_prefills=3)
    decoding = replace(cand(2, in_flight=3), pending_prefill_tokens=0, pending_prefills=0)
    request = facts(2_000)
    slow = predict(request, prefilling, DEFAULT)
    fast = predict(request, decoding, DEFAULT)
    assert fast.ttft_s < slow.ttft_s
    # The 30k tokens ahead take ~30000 / 16000 s of prefill on their own.
    assert slow.ttft_s - fast.ttft_s > 1.5
    ranked = policy().rank(request, [prefilling, decoding], random.Random(0))
    assert order(ranked) == [decoding.endpoint.ip, prefilling.endpoint.ip]
