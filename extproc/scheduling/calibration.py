"""Profiles that calibrate themselves: each worker set's prefill rate and step cost, fitted to the
times to first token its engines report.

A profile's two speeds (prefill tokens per second, the cost of one engine step) are numbers a user
rarely knows, and a wrong one skews every prediction without a sound. The router already holds both
sides of a comparison:

* at each decision, the prediction for the pick, which
  :func:`~extproc.scheduling.predictor.predict` splits into ``work_tokens`` (prefill tokens charged:
  ``work / rate`` seconds) and ``step_s`` (the seconds that scale with the step cost: the steps, the
  rest of the step in progress, seat waits);
* at each scrape, the engine's TTFT histogram totals (``_sum``, ``_count``): their increase since the
  last scrape says how many requests got their first token and how long they took in all; and its
  inter-token latency totals, running count and prefix-cache counters.

**Matching.** Engines serve first come first served, so the ``n`` first tokens an engine reports
since the last scrape are, mostly, those of the ``n`` oldest of our picks for it not matched yet (a
FIFO per endpoint; picks older than :data:`MAX_PICK_AGE_S` are dropped, since a request aborted
before its first token never reports one). First tokens do not come back exactly in arrival order
(a short prompt can finish its prefill before a long one that came first), so matches are summed per
endpoint into groups of :data:`GROUP_REQUESTS`: within a group the order does not matter, only its
edges can pair the wrong requests. When another router also sends there, the engine reports more
first tokens than we have picks: the engine's mean stands for ours, so that only adds noise.

**The fit**, per worker set (:mod:`extproc.scheduling.fit`): each group's mean TTFT against its
mean prefill and step seconds at the configured profile gives two factors, on the prefill time per
token and on the step cost (``decode_base_ms`` and ``decode_per_seq_ms`` together; decode
interference is the latter's part), by bounded least squares on relative error.

**Inter-token latencies** tell the step cost apart where TTFTs cannot (when long prefills dominate
every TTFT): between two scrapes in which no prefill ran, the engine's inter-token latency totals give
the mean step its decoding sequences waited, which the step cost alone explains
(:meth:`Calibration._observe_steps`). Each such interval is one more group, of the step cost alone.

A profiles-file reload that changes a worker set's profile starts its fit afresh.

Everything here is pure bookkeeping on the event loop: no I/O, O(1) per decision, O(matched picks)
per scrape.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from extproc.catalog.model import Endpoint
from extproc.scheduling.engine_signals import EngineSignals
from extproc.scheduling.fit import MIN_REQUESTS, Fit
from extproc.scheduling.policy import Prediction
from extproc.scheduling.profiles import Profile
from extproc.types import EndpointAddress, WorkerSetKey

#: Matched requests summed per endpoint before they make one group: first tokens do not come back
#: exactly in arrival order (a short prompt can finish its prefill before a long one that came
#: first), so single matches pair the wrong requests; over a group only its edges can.
GROUP_REQUESTS = 8
#: Tokens decoded in clean intervals (no prefill) before their inter-token latencies make a group (of
#: the same weight as a group of first tokens).
MIN_DECODE_TOKENS = 32
#: Prefill admitted between two scrapes may run this many times its predicted compute after them.
PREFILL_MARGIN = 1.5
#: Picks not matched to a first token within this long are dropped (aborted, or not counted).
MAX_PICK_AGE_S = 120.0
#: Picks kept per endpoint waiting for their first token (the oldest go first beyond it).
MAX_PENDING_PICKS = 4096
#: An endpoint neither picked nor scraped for this long is forgotten.
IDLE_FORGET_S = 600.0


@dataclass(frozen=True, slots=True)
class _Pick:
    at: float
    #: Prefill seconds at the configured rate (``work_tokens / configured rate``).
    prefill_s: float
    #: Step seconds at the configured step cost.
    step_s: float
    #: The TTFT predicted with the profile in use then.
    predicted_s: float


@dataclass(slots=True)
class _Group:
    """Sums over matched picks not yet fed to the fit."""

    prefill_s: float = 0.0
    step_s: float = 0.0
    predicted_s: float = 0.0
    observed_s: float = 0.0
    requests: int = 0


@dataclass(frozen=True, slots=True)
class _StepTotals:
    """An engine's running totals at a scrape, for the inter-token latency groups."""

    itl_s: float
    itl_count: float
    #: Prompt tokens computed (looked up minus found in the prefix cache), None if not exposed.
    prefill_tokens: float | None
    running: int
    waiting: int
    #: ``clock()`` at the scrape.
    at: float


@dataclass(slots=True)
class _DecodeGroup:
    """Clean intervals' inter-token latencies not yet fed to the fit: their totals, and the step
    seconds the configured profile gives each interval's batch, weighted by its tokens."""

    seconds: float = 0.0
    tokens: float = 0.0
    step_s: float = 0.0


@dataclass(slots=True)
class _EndpointState:
    worker_set: WorkerSetKey
    group: _Group = field(default_factory=_Group)
    steps: _StepTotals | None = None
    decode: _DecodeGroup = field(default_factory=_DecodeGroup)
    #: ``clock()`` before which prefill admitted so far may still be running.
    prefill_until: float = 0.0
    picks: deque[_Pick] = field(default_factory=lambda: deque(maxlen=MAX_PENDING_PICKS))
    #: The TTFT histogram's (sum, count) at the last scrape; None before the first.
    totals: tuple[float, float] | None = None
    seen_at: float = 0.0


class Calibration:
    """Every worker set's :class:`Fit`, fed by picks and scrapes; wraps ``profile_of`` for the policy."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._fits: dict[WorkerSetKey, Fit] = {}
        self._endpoints: dict[EndpointAddress, _EndpointState] = {}
        self._last_sweep: float | None = None

    def profile_of(self, configured_of: Callable[[Endpoint], Profile]) -> Callable[[Endpoint], Profile]:
        """``configured_of`` with each worker set's fitted speeds applied."""

        def profile_of(endpoint: Endpoint) -> Profile:
            configured = configured_of(endpoint)
            fit = self._fits.get(endpoint.worker_set)
            if fit is None or (fit.configured is not configured and fit.configured != configured):
                fit = self._fits[endpoint.worker_set] = Fit(configured)
            return fit.profile

        return profile_of

    def picked(self, endpoint: Endpoint, prediction: Prediction) -> None:
        """The policy sent a request to ``endpoint`` with this prediction (made with the fitted profile)."""
        fit = self._fits.get(endpoint.worker_set)
        if fit is None:
            return
        now = self._clock()
        state = self._endpoints.get(endpoint.address)
        if state is None or state.worker_set != endpoint.worker_set:
            state = self._endpoints[endpoint.address] = _EndpointState(endpoint.worker_set)
        state.seen_at = now
        configured = fit.configured
        state.picks.append(
            _Pick(
                at=now,
                prefill_s=prediction.work_tokens / configured.prefill_tokens_per_s,
                step_s=prediction.step_s / fit.step_scale,
                predicted_s=prediction.ttft_s,
            )
        )

    def scraped(self, address: EndpointAddress, signals: EngineSignals) -> None:
        """An endpoint's fresh signals: match its new first tokens to our oldest picks."""
        now = self._clock()
        if self._last_sweep is None:
            self._last_sweep = now
        elif now - self._last_sweep > IDLE_FORGET_S:
            self._sweep(now)
        state = self._endpoints.get(address)
        if state is None:
            return
        state.seen_at = now
        fit = self._fits.get(state.worker_set)
        if fit is not None:
            self._observe_steps(state, fit, signals, now)
        if signals.ttft_seconds_sum is None or signals.ttft_count is None:
            return
        totals, state.totals = state.totals, (signals.ttft_seconds_sum, signals.ttft_count)
        picks = state.picks
        while picks and now - picks[0].at > MAX_PICK_AGE_S:
            picks.popleft()
        if totals is None:
            # Our picks so far may be in these totals already: matching them later would pair every
            # later first token with an older pick.
            picks.clear()
            return
        new_count = round(signals.ttft_count - totals[1])
        new_sum = signals.ttft_seconds_sum - totals[0]
        if new_count < 0 or new_sum < 0:
            picks.clear()  # the engine restarted: its totals start again, our picks there are lost
            return
        matched = min(new_count, len(picks))
        if matched == 0 or fit is None:
            return
        group = state.group
        for _ in range(matched):
            pick = picks.popleft()
            group.prefill_s += pick.prefill_s
            group.step_s += pick.step_s
            group.predicted_s += pick.predicted_s
        # The engine's mean over its new first tokens stands for our matched picks' mean.
        group.observed_s += new_sum / new_count * matched
        group.requests += matched
        if group.requests >= GROUP_REQUESTS:
            n = group.requests
            fit.observe(group.prefill_s / n, group.step_s / n, group.observed_s / n, n, group.predicted_s / n)
            state.group = _Group()

    @staticmethod
    def _observe_steps(state: _EndpointState, fit: Fit, signals: EngineSignals, now_s: float) -> None:
        """The inter-token latencies since the last scrape, as one group of the step cost alone.

        Each decoding sequence waits one step per token, so in an interval with no prefill their
        mean is ``k x step(D)`` at the configured profile, ``D`` being the sequences running (the
        gauge, averaged over the two scrapes). Prefill interleaved with the decodes would lengthen
        the steps, and the counters say too little of when it ran (vLLM counts a prompt at its first
        chunk), so an interval counts only if nothing waited at either scrape, no prompt was
        admitted in it, and the prefill admitted before it had time to finish
        (:data:`PREFILL_MARGIN` x its predicted compute) before it began. Decode-heavy traffic
        then tells the step cost apart even when long prefills hide it in every TTFT.
        """
        if signals.itl_seconds_sum is None or signals.itl_count is None:
            return
        prefill: float | None = None
        if signals.prefix_cache_queries is not None and signals.prefix_cache_hits is not None:
            prefill = signals.prefix_cache_queries - signals.prefix_cache_hits
        now = _StepTotals(
            signals.itl_seconds_sum,
            signals.itl_count,
            prefill,
            signals.running or 0,
            signals.waiting or 0,
            now_s,
        )
        before, state.steps = state.steps, now
        if before is None:
            return
        computed = 0.0
        if now.prefill_tokens is not None and before.prefill_tokens is not None:
            computed = max(0.0, now.prefill_tokens - before.prefill_tokens)
        configured = fit.configured
        clean = (
            computed == 0 and now.waiting == 0 and before.waiting == 0 and before.at >= state.prefill_until
        )
        if computed > 0:
            compute_s = fit.prefill_scale * computed / configured.prefill_tokens_per_s
            state.prefill_until = max(state.prefill_until, now_s) + PREFILL_MARGIN * compute_s
        tokens, seconds = now.itl_count - before.itl_count, now.itl_s - before.itl_s
        if not clean or tokens <= 0 or seconds <= 0:
            return  # prefill may have run, nothing decoded, or a restarted engine
        # Clean intervals add up until they hold enough tokens to mean something.
        decoding = max(1.0, (now.running + before.running) / 2)
        steps = state.decode
        steps.seconds += seconds
        steps.tokens += tokens
        steps.step_s += configured.step_s(decoding) * tokens
        if steps.tokens >= MIN_DECODE_TOKENS:
            fit.observe(0.0, steps.step_s / steps.tokens, steps.seconds / steps.tokens, GROUP_REQUESTS, None)
            state.decode = _DecodeGroup()

    def _sweep(self, now: float) -> None:
        self._last_sweep = now
        for address in [a for a, s in self._endpoints.items() if now - s.seen_at > IDLE_FORGET_S]:
            del self._endpoints[address]
        live = {s.worker_set for s in self._endpoints.values()}
        for key in [k for k in self._fits if k not in live]:
            del self._fits[key]

    @property
    def fits(self) -> Mapping[WorkerSetKey, Fit]:
        return self._fits

    def debug_state(self) -> dict[str, object]:
        return {str(key): fit.to_debug() for key, fit in sorted(self._fits.items())}


def fitted_profiles(
    fits: Mapping[WorkerSetKey, Fit], profile_name: Callable[[WorkerSetKey], str]
) -> tuple[dict[str, Profile], dict[str, str]]:
    """The fitted profiles by the name their worker sets use, and a comment on each (what it was
    fitted from), for :func:`~extproc.scheduling.profiles.render_profiles`.

    Worker sets sharing a profile name share one entry: the set with the most matched requests
    gives it; the others are named in its comment.
    """
    by_name: dict[str, list[tuple[WorkerSetKey, Fit]]] = {}
    for key, fit in sorted(fits.items()):
        by_name.setdefault(profile_name(key), []).append((key, fit))
    profiles: dict[str, Profile] = {}
    comments: dict[str, str] = {}
    for name, sets in sorted(by_name.items()):
        key, fit = max(sets, key=lambda s: s[1].requests)
        error = fit.median_error
        lines = [
            f"fitted on worker set {key}: {fit.requests} requests matched, median TTFT prediction error "
            + ("n/a" if error is None else f"{error:.0%}")
            + (" (too few to move the profile yet)" if fit.requests < MIN_REQUESTS else "")
        ]
        others = [str(k) for k, _ in sets if k != key]
        if others:
            lines.append(f"also used by {', '.join(others)} (their fits differ; see /debug/state)")
        profiles[name] = fit.profile
        comments[name] = "\n".join(lines)
    return profiles, comments
