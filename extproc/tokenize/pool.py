"""Prompt token ids computed off the event loop, in worker threads, bounded in queue and in time.

Rendering a chat template and encoding a long prompt take milliseconds to tens of milliseconds
(a 32k-token prompt: ~100 ms); on the event loop that stalls every other decision. Here they run in
a small thread pool. Encoding releases the GIL for long texts (see
:meth:`~extproc.tokenize.tokenizer.Tokenizer.encode`), so encodes use every core; a template render
is Python and holds the GIL in the interpreter's 5 ms slices, which the loop then waits for at most.

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
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, TypeVar

#: Why a prompt was routed without its token ids.
Fallback = Literal["queue_full", "budget"]
T = TypeVar("T")


class TokenizePool:
    """Runs tokenization calls in worker threads; an awaited call returns None when it fell back."""

    def __init__(self, *, threads: int | None = None, max_pending: int = 256, budget: float = 0.25) -> None:
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        if max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, got {max_pending}")
        if not budget > 0:
            raise ValueError(f"budget must be positive, got {budget}")
        self.threads = threads or os.cpu_count() or 1
        self.max_pending = max_pending
        self.budget = budget
        #: Prompts being tokenized or waiting for a thread (including any past their budget).
        self.pending = 0
        self.completed = 0
        self.fallbacks: dict[Fallback, int] = {"queue_full": 0, "budget": 0}
        self._executor: ThreadPoolExecutor | None = None

    async def run(self, call: Callable[[], T]) -> T | None:
        """``call()`` in a worker thread; None if the queue is full or the budget runs out first.

        Exceptions from ``call`` propagate to the awaiting request (its caller decides what a bad
        prompt means).
        """
        if self.pending >= self.max_pending:
            self.fallbacks["queue_full"] += 1
            return None
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="tokenize")
        self.pending += 1
        future = asyncio.get_running_loop().run_in_executor(self._executor, call)
        future.add_done_callback(self._finished)
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.budget)
        except TimeoutError:
            self.fallbacks["budget"] += 1
            # Nobody reads it any more: an exception it may end with must not be logged as lost.
            future.add_done_callback(_consume)
            return None

    def close(self) -> None:
        """Stop the threads once they finish what they run (no new calls after this)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def _finished(self, _future: asyncio.Future[Any]) -> None:
        self.pending -= 1
        self.completed += 1


def _consume(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
