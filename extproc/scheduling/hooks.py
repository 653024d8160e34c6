"""Decision hooks: what a pick teaches, recorded once the scheduler has decided.

Policies are pure functions of their inputs; learning from their picks happens here, in hooks the
scheduler calls with each :class:`~extproc.scheduling.scheduler.Decision` it returns (never with a
shed request, which is sent nowhere).
"""

from __future__ import annotations

from extproc.scheduling.calibration import Calibration
from extproc.scheduling.prefix import PrefixMatcher
from extproc.scheduling.scheduler import Decision, DecisionHook


def remember_affinity(matcher: PrefixMatcher) -> DecisionHook:
    """Approximate prefix affinity: the prompt's chunks are now at the pick (precise mode learns
    from the engines' own events instead)."""

    def hook(decision: Decision) -> None:
        matcher.record(decision.prefix, decision.pick.address)

    return hook


def calibrate(calibration: Calibration) -> DecisionHook:
    """Calibration matches each pick's prediction to the TTFT its engine later reports."""

    def hook(decision: Decision) -> None:
        if decision.prediction is not None:
            calibration.picked(decision.pick, decision.prediction)

    return hook
