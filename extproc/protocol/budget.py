"""A process-wide cap on request-body bytes held while streams wait for their last chunk.

Each stream's body is capped by ``--max-body-bytes``; this caps their sum, so memory stays
bounded however many clients upload at once. Past the cap, new bytes are refused and the request
is shed with 429 (retry later) instead of the process growing until it is killed.
"""

from __future__ import annotations


class BodyBudget:
    """Bytes currently buffered across all streams, against a limit."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, size: int) -> bool:
        """Reserve ``size`` bytes; False (and nothing reserved) when that would pass the limit."""
        if self.held + size > self.limit:
            return False
        self.held += size
        return True

    def give(self, size: int) -> None:
        self.held -= size
