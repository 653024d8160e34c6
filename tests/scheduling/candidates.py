"""Endpoints and candidates for the pure policy and filter tests."""

from __future__ import annotations

from extproc.catalog.model import Endpoint
from extproc.scheduling.policy import Candidate
from extproc.types import EndpointAddress, WorkerSetKey


def endpoints(n: int) -> list[Endpoint]:
    """``127.0.0.1:8000`` ... ``127.0.0.n:8000`` in one worker set."""
    return [
        Endpoint(EndpointAddress(f"127.0.0.{i}:8000"), f"127.0.0.{i}", 8000, WorkerSetKey("ns/ws"))
        for i in range(1, n + 1)
    ]


def candidates(load: list[int], cached: dict[int, int] | None = None) -> list[Candidate]:
    """One candidate per load entry (1-based ``cached`` keys: endpoint number -> cached tokens)."""
    held = cached or {}
    return [
        Candidate(e, n, held.get(i, 0))
        for i, (e, n) in enumerate(zip(endpoints(len(load)), load, strict=True), 1)
    ]
