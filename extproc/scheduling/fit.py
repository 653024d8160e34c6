"""The least-squares fit behind profile calibration: two factors on a profile's speeds.

For groups of requests (mean prefill seconds ``W`` and step seconds ``Z`` at the configured profile,
observed mean ``y``, weight ``n``), ``y ≈ u x W + k x Z``: ``u`` scales the configured prefill time
per token and ``k`` the configured ``decode_base_ms`` and ``decode_per_seq_ms`` together. Least
squares on relative error (weight ``n / y²``: a 50 ms request counts as much as a 5 s one), with
exponential forgetting (a group's weight halves every :data:`HALF_LIFE` requests after it) and a
weak prior at the values in use (worth :data:`PRIOR_WEIGHT` requests that agree with them), which
keeps a parameter the traffic cannot tell apart where it is.

Bounds, so that one outlier cannot swing routing: ``u`` and ``k`` stay within :data:`BOUND` x of 1
(the configured profile); each update moves the values in use at most :data:`MAX_MOVE` x; nothing
moves before :data:`MIN_REQUESTS` requests were matched. Where the groups come from:
:mod:`extproc.scheduling.calibration`.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import replace

from extproc.scheduling.profiles import Profile

#: A group's weight halves after this many more requests were matched.
HALF_LIFE = 400.0
#: The values in use count as this many requests that agree with them.
PRIOR_WEIGHT = 1.0
#: Requests matched before the profile in use moves at all.
MIN_REQUESTS = 20
#: Fitted speeds stay within this factor of the configured ones.
BOUND = 10.0
#: One update moves a speed by at most this factor.
MAX_MOVE = 1.5
#: Prediction errors kept per worker set for the median.
ERROR_WINDOW = 256


class Fit:
    """One worker set's calibration: the normal equations of the fit and the scales in use."""

    def __init__(self, configured: Profile) -> None:
        self.configured = configured
        #: Scales in use: of the configured seconds per prefill token, and of the step cost.
        self.prefill_scale = 1.0
        self.step_scale = 1.0
        #: Requests matched so far, and groups.
        self.requests = 0
        self.groups = 0
        #: |predicted - observed| / observed per group, most recent last.
        self.errors: deque[float] = deque(maxlen=ERROR_WINDOW)
        self._profile = configured
        # Decayed sums of the weighted normal equations in (u, k).
        self._pp = self._ps = self._ss = self._py = self._sy = 0.0

    @property
    def profile(self) -> Profile:
        """The configured profile with the fitted speeds (the configured one until enough is seen)."""
        return self._profile

    @property
    def median_error(self) -> float | None:
        """Median absolute percentage error of recent predictions (0.2 = 20 %), None before any."""
        return statistics.median(self.errors) if self.errors else None

    def observe(
        self, prefill_s: float, step_s: float, observed_s: float, requests: int, predicted_s: float | None
    ) -> None:
        """One group: mean prefill and step seconds at the configured profile, the mean time the
        engine reported, its weight in requests, and what we had predicted (mean TTFT; None for a
        group of inter-token latencies, which no decision predicted)."""
        if not (observed_s > 0 and requests > 0 and math.isfinite(observed_s)):
            return
        if predicted_s is not None:
            self.errors.append(abs(predicted_s - observed_s) / observed_s)
        decay = 0.5 ** (requests / HALF_LIFE)
        w = requests / (observed_s * observed_s)
        self._pp = self._pp * decay + w * prefill_s * prefill_s
        self._ps = self._ps * decay + w * prefill_s * step_s
        self._ss = self._ss * decay + w * step_s * step_s
        self._py = self._py * decay + w * prefill_s * observed_s
        self._sy = self._sy * decay + w * step_s * observed_s
        self.requests += requests
        self.groups += 1
        if self.requests >= MIN_REQUESTS:
            u, k = self.solve()
            self.prefill_scale = _move(self.prefill_scale, u)
            self.step_scale = _move(self.step_scale, k)
            self._profile = scaled(self.configured, self.prefill_scale, self.step_scale)

    def solve(self) -> tuple[float, float]:
        """The (u, k) minimising the weighted relative error plus the prior, within the bounds."""
        # The prior adds PRIOR_WEIGHT x (((u - u0) / u0)² + ((k - k0) / k0)²) around the values in
        # use: relative, like the data's terms, so it weighs as much whatever the scales.
        u0, k0 = self.prefill_scale, self.step_scale
        a, b, c = self._pp + PRIOR_WEIGHT / u0**2, self._ps, self._ss + PRIOR_WEIGHT / k0**2
        d, e = self._py + PRIOR_WEIGHT / u0, self._sy + PRIOR_WEIGHT / k0

        def cost(u: float, k: float) -> float:
            return a * u * u + 2 * b * u * k + c * k * k - 2 * d * u - 2 * e * k

        low, high = 1 / BOUND, BOUND
        det = a * c - b * b
        options: list[tuple[float, float]] = []
        if det > 0:
            u, k = (d * c - e * b) / det, (a * e - b * d) / det
            if low <= u <= high and low <= k <= high:
                return u, k
        # Outside the box: the best point on its edges (the cost is convex).
        for k in (low, high):
            options.append((_clamp((d - b * k) / a, low, high), k))
        for u in (low, high):
            options.append((u, _clamp((e - b * u) / c, low, high)))
        return min(options, key=lambda o: cost(*o))

    def to_debug(self) -> dict[str, object]:
        error = self.median_error
        return {
            "requests": self.requests,
            "groups": self.groups,
            "prefillScale": round(self.prefill_scale, 4),
            "stepScale": round(self.step_scale, 4),
            "prefillTokensPerS": round(self._profile.prefill_tokens_per_s, 1),
            "decodeBaseMs": round(self._profile.decode_base_ms, 4),
            "decodePerSeqMs": round(self._profile.decode_per_seq_ms, 5),
            "medianAbsoluteError": None if error is None else round(error, 4),
        }


def scaled(profile: Profile, prefill_scale: float, step_scale: float) -> Profile:
    """``profile`` with prefill ``prefill_scale`` x slower and steps ``step_scale`` x costlier."""
    return replace(
        profile,
        prefill_tokens_per_s=profile.prefill_tokens_per_s / prefill_scale,
        decode_base_ms=profile.decode_base_ms * step_scale,
        decode_per_seq_ms=profile.decode_per_seq_ms * step_scale,
    )


def _clamp(value: float, low: float, high: float) -> float:
    return min(high, max(low, value))


def _move(current: float, target: float) -> float:
    return current * _clamp(target / current, 1 / MAX_MOVE, MAX_MOVE)
