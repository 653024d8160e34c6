"""Prompt token ids computed off the event loop, in worker threads or processes, bounded in queue
and in time.

Rendering a chat template and encoding a long prompt take milliseconds to tens of milliseconds
(a 32k-token prompt: ~100 ms); on the event loop that stalls every other decision. Here they run in
workers (:mod:`extproc.tokenize.workers`): threads of this process, or processes of their own.

Bounded twice, so a burst of long prompts cannot pile up work or latency:

- **queue**: at most ``max_pending`` prompts are being tokenized or waiting for a thread; one more
  is not tokenized at all;
- **budget**: a request waits at most ``budget`` seconds for its ids.

Either way the request is routed without them (approximate affinity), never fails and never waits
longer; :attr:`TokenizePool.fallbacks` counts it by reason. A prompt past its budget still finishes
in its thread (a thread cannot be stopped) and holds its place in the queue until then.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from extproc.tokenize.workers import ProcessWorkers, ThreadWorkers

#: Why a prompt was routed without its token ids.
Fallback = Literal["queue_full", "budget"]
T = TypeVar("T")


class TokenizePool:
    """Runs tokenization calls in workers; an awaited call returns None when it fell back.

    ``workers`` defaults to ``threads`` threads (None: one per core).
    """

    def __init__(
        self,
        *,
        threads: int | None = None,
        max_pending: int = 256,
        budget: float = 0.25,
        workers: ThreadWorkers | ProcessWorkers | None = None,
    ) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, got {max_pending}")
        if not budget > 0:
            raise ValueError(f"budget must be positive, got {budget}")
        self.workers = workers if workers is not None else ThreadWorkers(threads)
        self.max_pending = max_pending
        self.budget = budget
        #: Prompts being tokenized or waiting for a thread (including any past their budget).
        self.pending = 0
        self.completed = 0
        self.fallbacks: dict[Fallback, int] = {"queue_full": 0, "budget": 0}

    @property
    def in_processes(self) -> bool:
        """True when calls run in other processes (they must then be picklable)."""
        return self.workers.in_processes

    async def run(self, call: Callable[[], T], affinity: bytes = b"") -> T | None:
        """``call()`` in a worker; None if the queue is full or the budget runs out first.

        Exceptions from ``call`` propagate to the awaiting request (its caller decides what a bad
        prompt means). ``affinity``: calls alike in it go to the same process, when in processes.
        """
        if self.pending >= self.max_pending:
            self.fallbacks["queue_full"] += 1
            return None
        future = asyncio.wrap_future(self.workers.submit(call, affinity))
        self.pending += 1
        future.add_done_callback(self._finished)
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.budget)
        except TimeoutError:
            self.fallbacks["budget"] += 1
            # Nobody reads it any more: an exception it may end with must not be logged as lost.
            future.add_done_callback(_consume)
            return None

    def close(self) -> None:
        """Stop the workers once they finish what they run (no new calls after this)."""
        self.workers.close()

    def _finished(self, _future: asyncio.Future[Any]) -> None:
        self.pending -= 1
        self.completed += 1


def _consume(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
