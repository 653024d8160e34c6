"""After a failed list or watch: relist or resume, how long to wait, and what to report."""

from __future__ import annotations

import random

import pytest

from extproc.errors import KubeApiError
from extproc.kube.resources import HTTP_ROUTES, SERVICES, WORKER_SETS, ResourceType
from extproc.kube.retry import Backoff, Step, after_failure, after_watch


def test_backoff_doubles_up_to_the_maximum() -> None:
    """Without jitter the delays are 0.5, 1, 2, 4 ... capped at 30 s; a success starts over."""
    backoff = Backoff(initial=0.5, maximum=30.0, jitter=0.0)
    assert [backoff.next() for _ in range(9)] == [0.5, 1, 2, 4, 8, 16, 30, 30, 30]
    backoff.reset()
    assert backoff.next() == 0.5


def test_backoff_jitter_stays_within_its_share() -> None:
    """Each delay is cut by at most the jitter fraction, so replicas spread without waiting longer."""
    backoff = Backoff(initial=1.0, maximum=8.0, jitter=0.5, rng=random.Random(7))
    delays = [backoff.next() for _ in range(200)]
    bases = [min(8.0, 2.0**i) for i in range(200)]
    assert all(base / 2 <= d <= base for d, base in zip(delays, bases, strict=True))
    assert len({round(d, 6) for d in delays[10:]}) > 100  # really random, not a constant


def test_backoff_survives_many_failures() -> None:
    """Days of failures do not overflow the exponent."""
    backoff = Backoff(jitter=0.0, failures=10_000)
    assert backoff.next() == 30.0


@pytest.mark.parametrize(
    ("initial", "maximum", "jitter"), [(0, 1, 0), (2, 1, 0), (1, 2, 1.0)], ids=["zero", "inverted", "jitter"]
)
def test_backoff_rejects_nonsense(initial: float, maximum: float, jitter: float) -> None:
    """A misconfigured backoff fails at construction, not later in a retry loop."""
    with pytest.raises(ValueError, match="backoff"):
        Backoff(initial=initial, maximum=maximum, jitter=jitter)


def step(
    status: int, resource: ResourceType = SERVICES, *, can_resume: bool = True, gone_before: bool = False
) -> Step:
    backoff = Backoff(initial=0.5, jitter=0.0)
    error = KubeApiError(status, f"HTTP {status}")
    return after_failure(
        error, resource, backoff, can_resume=can_resume, gone_before=gone_before, unavailable_retry=60.0
    )


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"status": 410}, Step(relist=True, delay=0.0)),
        ({"status": 410, "gone_before": True}, Step(relist=True, delay=0.5, error="HTTP 410")),
        ({"status": 0}, Step(relist=False, delay=0.5, error="HTTP 0")),
        ({"status": 0, "can_resume": False}, Step(relist=True, delay=0.5, error="HTTP 0")),
        ({"status": 500}, Step(relist=False, delay=0.5, error="HTTP 500")),
        ({"status": 403}, Step(relist=False, delay=0.5, error="HTTP 403")),
        ({"status": 404, "resource": HTTP_ROUTES}, Step(relist=True, delay=60.0, available=False)),
    ],
    ids=[
        "gone",
        "gone-twice",
        "unreachable",
        "unreachable-before-list",
        "server-error",
        "forbidden",
        "optional-absent",
    ],
)
def test_next_step(kwargs: dict[str, object], expected: Step) -> None:
    """410 relists at once; other errors back off and resume; an absent optional type is no error."""
    assert step(**kwargs) == expected  # type: ignore[arg-type]


def test_missing_crd_is_an_error_that_says_so() -> None:
    """A required resource type that is not served (CRD not installed) is an error naming the CRD."""
    result = step(404, WORKER_SETS)
    assert result.relist and result.available
    assert result.error is not None
    assert "kinference.buoyant.io/v1alpha1 inferenceworkersets: is its CRD installed?" in result.error


def test_watches_cut_early_by_a_proxy_do_not_grow_the_backoff() -> None:
    """A watch that delivered something, or stayed open a few seconds, worked: watch again at once."""
    backoff = Backoff(initial=0.5, maximum=30.0, jitter=0.0)
    for _ in range(20):  # e.g. a proxy that ends every watch after 10 s, quiet cluster
        assert after_watch(backoff, delivered=0, lasted=10.0) == 0.0
    for _ in range(20):  # cut after a second, but events (or bookmarks) came through
        assert after_watch(backoff, delivered=3, lasted=1.0) == 0.0
    assert backoff.failures == 0


def test_watches_that_end_at_once_back_off() -> None:
    """A server that ends every watch at once, with nothing, is not asked again in a tight loop."""
    backoff = Backoff(initial=0.5, maximum=30.0, jitter=0.0)
    assert [after_watch(backoff, delivered=0, lasted=0.01) for _ in range(4)] == [0.5, 1, 2, 4]
    assert after_watch(backoff, delivered=1, lasted=0.01) == 0.0
    assert after_watch(backoff, delivered=0, lasted=0.01) == 0.5
