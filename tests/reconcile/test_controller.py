"""The reconciler's pure decisions (the running loop is tested against a real API server in tests/kube)."""

from __future__ import annotations

from extproc.reconcile.controller import NoOpWrite, write_is_futile

SENT = {"state": "Ready", "models": [{"upstreamName": "m", "extra": 1}]}
KEPT = {"state": "Ready", "models": [{"upstreamName": "m"}]}  # the schema pruned "extra"


def test_a_write_the_server_reduced_is_not_repeated() -> None:
    """Same computed status, same stored one: writing again would change nothing."""
    assert write_is_futile(NoOpWrite(SENT, KEPT), KEPT, dict(SENT))


def test_a_change_on_either_side_writes_again() -> None:
    """A new computed status, or a stored one changed by someone else, is written."""
    noop = NoOpWrite(SENT, KEPT)
    assert not write_is_futile(noop, KEPT, {**SENT, "state": "Degraded"})
    assert not write_is_futile(noop, {**KEPT, "state": "NotReady"}, SENT)
    assert not write_is_futile(None, KEPT, SENT)
