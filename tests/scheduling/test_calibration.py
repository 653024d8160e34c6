"""Profile calibration: the fit recovers the engine's speeds, within bounds, from matched first tokens."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from extproc.catalog.model import Endpoint
from extproc.scheduling import calibration
from extproc.scheduling.calibration import Calibration
from extproc.scheduling.engine_signals import EngineSignals
from extproc.scheduling.fit import BOUND, MAX_MOVE, MIN_REQUESTS, Fit, scaled
from extproc.scheduling.policy import Prediction
from extproc.scheduling.profiles import Profile
from extproc.types import EndpointAddress, WorkerSetKey

CONFIGURED = Profile(prefill_tokens_per_s=16_000, decode_base_ms=6.0, decode_per_seq_ms=0.15)
A, B = EndpointAddress("10.0.0.1:8000"), EndpointAddress("10.0.0.2:8000")
SET = WorkerSetKey("ns/pool")


def endpoint(address: EndpointAddress, worker_set: WorkerSetKey = SET) -> Endpoint:
    ip, port = address.split(":")
    return Endpoint(address, ip, int(port), worker_set)


def feed(fit: Fit, u: float, k: float, groups: int, rng: random.Random, noise: float = 0.0) -> None:
    """Groups of 8 whose true TTFT is ``u`` x the configured prefill plus ``k`` x the configured steps."""
    for _ in range(groups):
        prefill, step = rng.uniform(0.01, 2.0), rng.uniform(0.005, 0.2)
        observed = (u * prefill + k * step) * (1 + rng.uniform(-noise, noise))
        fit.observe(prefill, step, observed, 8, prefill + step)


def test_the_fit_recovers_both_speeds_when_the_traffic_tells_them_apart() -> None:
    fit = Fit(CONFIGURED)
    feed(fit, 3.0, 0.5, 200, random.Random(1))
    assert fit.profile.prefill_tokens_per_s == pytest.approx(16_000 / 3, rel=0.02)
    assert fit.profile.decode_base_ms == pytest.approx(3.0, rel=0.05)
    assert fit.profile.decode_per_seq_ms == pytest.approx(0.075, rel=0.05)
    # Fields calibration does not touch are the configured ones.
    assert fit.profile.max_num_seqs == CONFIGURED.max_num_seqs


def test_noisy_observations_still_land_near_the_truth() -> None:
    fit = Fit(CONFIGURED)
    feed(fit, 0.5, 2.0, 400, random.Random(2), noise=0.3)
    assert fit.profile.prefill_tokens_per_s == pytest.approx(32_000, rel=0.1)
    assert fit.profile.decode_base_ms == pytest.approx(12.0, rel=0.2)


def test_nothing_moves_before_enough_requests_were_matched() -> None:
    fit = Fit(CONFIGURED)
    while fit.requests + 8 < MIN_REQUESTS:
        fit.observe(0.5, 0.01, 1.5, 8, 0.51)
    assert fit.profile is CONFIGURED
    fit.observe(0.5, 0.01, 1.5, 8, 0.51)
    assert fit.profile.prefill_tokens_per_s < CONFIGURED.prefill_tokens_per_s


def test_one_outlier_moves_the_profile_in_use_by_a_bounded_step() -> None:
    fit = Fit(CONFIGURED)
    feed(fit, 1.0, 1.0, 50, random.Random(3))
    before = fit.profile.prefill_tokens_per_s
    fit.observe(0.5, 0.01, 500.0, 8, 0.51)  # 1000x slower than everything before it
    assert before / fit.profile.prefill_tokens_per_s <= MAX_MOVE + 1e-9
    feed(fit, 1.0, 1.0, 50, random.Random(4))
    assert fit.profile.prefill_tokens_per_s == pytest.approx(16_000, rel=0.05)


def test_fitted_speeds_stay_within_the_bound_of_the_configured_ones() -> None:
    fit = Fit(CONFIGURED)
    feed(fit, 100.0, 100.0, 300, random.Random(5))
    assert fit.profile.prefill_tokens_per_s == pytest.approx(16_000 / BOUND)
    assert fit.profile.decode_base_ms == pytest.approx(6.0 * BOUND)


def test_a_speed_the_traffic_cannot_tell_stays_where_it_was() -> None:
    """Long prefills dominate every TTFT: the step cost is unidentifiable and the prior keeps it."""
    fit = Fit(CONFIGURED)
    rng = random.Random(6)
    for _ in range(200):
        prefill = rng.uniform(0.5, 2.0)
        fit.observe(prefill, prefill / 100, 2 * prefill + 3 * prefill / 100, 8, prefill)
    assert fit.profile.prefill_tokens_per_s == pytest.approx(8_000, rel=0.05)
    assert 0.5 < fit.step_scale < 4.0


def test_the_median_error_compares_predictions_with_observations() -> None:
    fit = Fit(CONFIGURED)
    assert fit.median_error is None
    fit.observe(0.5, 0.0, 1.0, 8, 0.5)
    fit.observe(0.5, 0.0, 1.0, 8, 0.9)
    fit.observe(0.5, 0.0, 1.0, 8, 1.2)
    assert fit.median_error == pytest.approx(0.2)


def test_scaled_slows_prefill_and_steps_by_the_factors() -> None:
    slow = scaled(CONFIGURED, 2.0, 3.0)
    assert (slow.prefill_tokens_per_s, slow.decode_base_ms, slow.decode_per_seq_ms) == pytest.approx(
        (8_000, 18.0, 0.45)
    )


# -- matching picks to the engines' first tokens -----------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def ttft(total_s: float, count: int) -> EngineSignals:
    return EngineSignals(1, 0, 0.1, None, None, ttft_seconds_sum=total_s, ttft_count=count)


def pick(cal: Calibration, address: EndpointAddress, work_tokens: float, ttft_s: float) -> None:
    cal.picked(endpoint(address), Prediction(ttft_s, int(work_tokens), 1, False, work_tokens, 0.0))


def calibrated(configured: Profile = CONFIGURED) -> tuple[Calibration, Clock, Callable[[Endpoint], Profile]]:
    """A calibration whose endpoint A has been picked once and scraped once (the baseline)."""
    clock = Clock()
    cal = Calibration(clock=clock)
    profile_of = cal.profile_of(lambda _endpoint: configured)
    profile_of(endpoint(A))
    pick(cal, A, 1_600, 0.1)
    cal.scraped(A, ttft(0.0, 0))
    return cal, clock, profile_of


def test_an_engine_twice_as_slow_as_configured_halves_the_prefill_rate_in_use() -> None:
    cal, clock, profile_of = calibrated()
    assert profile_of(endpoint(A)) is CONFIGURED
    total, count = 0.0, 0
    for _ in range(10):
        for _ in range(8):  # 8 picks of 1,600 tokens: 0.1 s predicted, 0.2 s observed
            pick(cal, A, 1600, 0.1)
        total, count = total + 8 * 0.2, count + 8
        clock.now += 1
        cal.scraped(A, ttft(total, count))
    assert profile_of(endpoint(A)).prefill_tokens_per_s == pytest.approx(8_000, rel=0.05)
    assert cal.fits[SET].requests == 80
    # Both endpoints of the set share the fit.
    assert profile_of(endpoint(B)) is profile_of(endpoint(A))


def test_first_tokens_are_matched_to_the_oldest_picks_and_summed_per_group() -> None:
    cal, _clock, _profile_of = calibrated()
    for work in (16_000, 1_600, 1_600, 1_600):
        pick(cal, A, work, work / 16_000)
    # Three first tokens: the three oldest picks; a group (8) is not full yet, so the fit waits.
    cal.scraped(A, ttft(1.0, 3))
    assert cal.fits[SET].groups == 0
    for _ in range(5):
        pick(cal, A, 1_600, 0.1)
    cal.scraped(A, ttft(1.0 + 6 * 0.1, 9))
    fit = cal.fits[SET]
    assert (fit.groups, fit.requests) == (1, 9)


def test_a_restarted_engine_drops_the_picks_it_lost() -> None:
    cal, _clock, _profile_of = calibrated()
    cal.scraped(A, ttft(50.0, 100))
    for _ in range(8):
        pick(cal, A, 1_600, 0.1)
    cal.scraped(A, ttft(0.0, 0))  # totals went backwards: a new engine process
    for _ in range(8):
        pick(cal, A, 1_600, 0.1)
    cal.scraped(A, ttft(8 * 0.1, 8))
    fit = cal.fits[SET]
    assert fit.requests == 8
    assert fit.median_error == pytest.approx(0.0)


def test_picks_never_answered_age_out_instead_of_shifting_every_later_match() -> None:
    cal, clock, _profile_of = calibrated()
    for _ in range(5):
        pick(cal, A, 160_000, 10.0)  # aborted before their first token: the engine never reports them
    clock.now += calibration.MAX_PICK_AGE_S + 1
    for _ in range(8):
        pick(cal, A, 1_600, 0.1)
    cal.scraped(A, ttft(8 * 0.1, 8))
    assert cal.fits[SET].median_error == pytest.approx(0.0)


def test_an_engine_without_a_ttft_histogram_changes_nothing() -> None:
    cal, _clock, _profile_of = calibrated()
    pick(cal, A, 1_600, 0.1)
    cal.scraped(A, EngineSignals(1, 0, 0.1, None, None))
    cal.scraped(B, ttft(1.0, 1))  # never picked
    assert cal.fits[SET].requests == 0


def test_a_changed_profile_file_starts_the_fit_afresh() -> None:
    cal, _clock, _ = calibrated()
    configured = [CONFIGURED]
    profile_of = cal.profile_of(lambda _endpoint: configured[0])
    profile_of(endpoint(A))
    cal.fits[SET].observe(0.5, 0.0, 1.0, 64, 0.5)
    assert cal.fits[SET].requests == 64
    configured[0] = Profile(prefill_tokens_per_s=4_000)
    assert profile_of(endpoint(A)) is configured[0]
    assert cal.fits[SET].requests == 0


def test_idle_endpoints_and_their_sets_are_forgotten() -> None:
    cal, clock, _ = calibrated()
    clock.now += calibration.IDLE_FORGET_S + 1
    cal.scraped(B, ttft(0.0, 0))
    assert SET not in cal.fits
    assert cal.debug_state() == {}


def test_fitted_profiles_are_named_as_their_worker_sets_name_them() -> None:
    """Sets sharing a profile name share one entry, from the set with the most matched requests."""
    busy, quiet, other = Fit(CONFIGURED), Fit(CONFIGURED), Fit(CONFIGURED)
    feed(busy, 2.0, 1.0, 40, random.Random(7))
    feed(quiet, 4.0, 1.0, 3, random.Random(8))
    names = {WorkerSetKey("a/busy"): "h100", WorkerSetKey("a/quiet"): "h100", WorkerSetKey("b/x"): "a100"}
    fits = {WorkerSetKey("a/busy"): busy, WorkerSetKey("a/quiet"): quiet, WorkerSetKey("b/x"): other}
    profiles, comments = calibration.fitted_profiles(fits, names.__getitem__)
    assert list(profiles) == ["a100", "h100"]
    assert profiles["h100"] is busy.profile
    assert "worker set a/busy: 320 requests matched" in comments["h100"]
    assert "also used by a/quiet" in comments["h100"]
    assert "too few to move the profile yet" in comments["a100"]
