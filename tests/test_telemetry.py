"""Log rate limiting: one line per subject and kind of problem per interval."""

from __future__ import annotations

from control.test_load import Clock

from extproc.telemetry import LogLimiter


def test_each_subject_and_kind_is_logged_once_per_interval() -> None:
    clock = Clock()
    limiter: LogLimiter[str] = LogLimiter(clock, interval=60.0)
    assert limiter.allow("10.0.0.1:8000", "timeout")
    assert not limiter.allow("10.0.0.1:8000", "timeout")
    assert limiter.allow("10.0.0.1:8000", "refused")  # another kind of problem
    assert limiter.allow("10.0.0.2:8000", "timeout")  # another subject
    clock.now += 61.0
    assert limiter.allow("10.0.0.1:8000", "timeout")


def test_a_forgotten_subject_starts_afresh_and_the_others_keep_their_history() -> None:
    clock = Clock()
    limiter: LogLimiter[str] = LogLimiter(clock)
    for subject in ("a", "b"):
        assert limiter.allow(subject, "timeout") and limiter.allow(subject, "refused")
    limiter.forget("a")
    limiter.forget("never seen")
    assert limiter.allow("a", "timeout") and limiter.allow("a", "refused")
    assert not limiter.allow("b", "timeout") and not limiter.allow("b", "refused")
