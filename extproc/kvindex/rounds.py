"""Large settling rounds of the prefix index in a worker thread, and what arrives meanwhile.

A round grows with the blocks held (about a second near a fleet's default memory budget; see
:mod:`extproc.kvindex.index`). Run inline it would hold the event loop, and every request with it.
Here it runs in one worker thread: numpy's copies, sorts and searches release the GIL, and the loop
gets the GIL back every few milliseconds anyway. While it runs the index is frozen for the loop:
lookups read it as it was, and what the KV-event subscribers deliver waits here, in order (payloads
as they came, a few bytes a token). When the round ends, the backlog is worked off a few
milliseconds per loop turn, so catching up is no stall either; what arrives meanwhile queues behind.

Memory stays bounded: past ``max_waiting_bytes`` of backlog the loop waits for the round and works
the whole backlog off at once, as when rounds ran inline. Without a running loop (a script, a
bench) rounds run inline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from extproc.kvindex.index import PrefixIndex

log = logging.getLogger(__name__)

#: Backlog bytes (payloads waiting for a round) before the loop waits for the round instead.
MAX_WAITING_BYTES = 64 * 1024 * 1024
#: Loop time the backlog may take per turn once a round is over.
DRAIN_SLICE_S = 0.002


class OffLoopRounds:
    """Starts the index's due rounds in a thread; holds and later replays what comes meanwhile."""

    def __init__(
        self,
        index: PrefixIndex,
        *,
        max_waiting_bytes: int = MAX_WAITING_BYTES,
        drain_slice_s: float = DRAIN_SLICE_S,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._index = index
        self._max_waiting = max_waiting_bytes
        self._slice = drain_slice_s
        self._clock = clock
        self._settler: ThreadPoolExecutor | None = None
        self._round: Future[float] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        #: What arrived during a round or its backlog, to be handled in order: (handle, bytes).
        self._waiting: deque[tuple[Callable[[], None], int]] = deque()
        self._waiting_bytes = 0
        self._draining = False
        self._closed = False
        #: Rounds run in the thread, and rounds the loop waited for (backlog over its bound).
        self.in_thread = 0
        self.waited = 0

    @property
    def busy(self) -> bool:
        """A round runs, or its backlog is being worked off: what arrives must :meth:`hold`."""
        return self._round is not None or bool(self._waiting)

    def hold(self, handle: Callable[[], None], size: int) -> None:
        """Handle this later, after everything held before it (``size``: its bytes, for the bound)."""
        self._waiting.append((handle, size))
        self._waiting_bytes += size
        if self._waiting_bytes > self._max_waiting:
            self.waited += 1
            if self._round is not None:
                future = self._round
                future.result()  # the loop waits, as for a round run inline
                self._over(future, drain=False)
            self._drain(until=None)

    def maybe_start(self) -> None:
        """Start a round if the index has one due (call after each write)."""
        if not self._index.round_due() or self._closed:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop to keep free: the round right here
            self._index.begin_round()
            self._index.run_round()
            self._index.end_round()
            return
        if self._settler is None:
            self._settler = ThreadPoolExecutor(1, thread_name_prefix="kv-settle")
        self._loop = loop
        self._index.begin_round()
        self._round = future = self._settler.submit(self._index.run_round)
        asyncio.wrap_future(future, loop=loop).add_done_callback(lambda _done: self._over(future))

    def close(self) -> None:
        """Stop (a round running finishes on its own; the process is ending)."""
        self._closed = True
        if self._settler is not None:
            self._settler.shutdown(wait=False)

    def _over(self, future: Future[float], *, drain: bool = True) -> None:
        """The round's thread is done (on the loop, or in :meth:`hold` having waited for it)."""
        if self._round is not future or self._closed:
            return  # already ended by a wait, or shutting down
        self._round = None
        self.in_thread += 1
        try:
            future.result()
        except Exception:
            log.exception("kv index settling round failed")
        self._index.end_round()  # the source changes made meanwhile, before the backlog
        if drain:
            self._drain(until=self._clock() + self._slice)

    def _drain(self, *, until: float | None) -> None:
        """Work the backlog off until ``until`` (None: all of it), or until a handle starts a round."""
        while self._waiting and self._round is None and (until is None or self._clock() < until):
            handle, size = self._waiting.popleft()
            self._waiting_bytes -= size
            handle()
        if self._waiting and self._round is None and not self._draining and self._loop is not None:
            self._draining = True
            self._loop.call_soon(self._next_slice)

    def _next_slice(self) -> None:
        self._draining = False
        if not self._closed:
            self._drain(until=self._clock() + self._slice)
