"""Prompt token ids computed off the event loop, in worker threads or processes, bounded in queue
and in time.

Rendering a chat template and encoding a long prompt take milliseconds to tens of milliseconds
(a 32k-token prompt: ~100 ms); on the event loop that stalls every other decision. Here they run in
workers (:mod:`extproc.tokenize.workers`): threads of this process, or processes of their own.

Bounded twice, so a burst of long prompts cannot pile up work or latency:

- **queue**: at most ``max_pending`` prompts are being tokenized or waiting for a worker; one more
  is not tokenized at all;
- **budget**: a request waits at most ``budget`` seconds for its ids.

Either way the request is routed without them (approximate affinity), never fails and never waits
longer; :attr:`TokenizePool.fallbacks` counts it by reason.

**Deadlines decide what a worker takes next.** The pool hands workers prompts as they have room
(a thread one, a process two, so a conversation can keep to its process), oldest first, and only a
prompt that can still be ready within its budget (judged by the work's size and
the workers' measured speed). A prompt that cannot is answered at once, routed approximately, not
left to wait out its budget. Workers therefore spend their time on prompts whose answers someone
still waits for: under a sustained overload, with first-come-first-served, every prompt would
finish just too late. A prompt whose requester stopped waiting is *late*: it still runs when no
waiting prompt needs the worker (newest first), because tokenizing it teaches the segment tree,
and a conversation's next turn is then not cold again; but only when its opening recurs
(:mod:`extproc.tokenize.openings`): a one-off prompt would teach nothing, and the cores it took
slow every other decision. Late prompts give up their place in the queue to new ones.

The workers' speed is learned from the calls they finish. With one-off late prompts skipped, it
could go stale: learned while the cores were short, it would turn every long prompt away at once
long after the cores came free, and nothing would measure it again. So once no call has taught it
for :data:`SPEED_STALE_S`, one prompt is tried whatever the speed says (it waits at most its
budget), and what it measures replaces the stale speed. One, not every prompt until one finishes:
beside a stream of one-off long prompts on busy cores, each try is tokenizing nobody may use.
"""

from __future__ import annotations

import asyncio
import functools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from extproc.tokenize.openings import Openings
from extproc.tokenize.workers import ProcessWorkers, ThreadWorkers

#: Why a prompt was routed without its token ids.
Fallback = Literal["queue_full", "budget"]
T = TypeVar("T")
#: Weight of the newest call in the workers' speed (seconds per unit of size).
SPEED_WEIGHT = 0.2
#: Calls smaller than this teach nothing of the speed: their time is mostly fixed costs.
SPEED_MIN_SIZE = 1024
#: Seconds without a call teaching the workers' speed after which one prompt is tried to measure
#: it afresh (see the module).
SPEED_STALE_S = 1.0


@dataclass(eq=False, slots=True)
class _Job(Generic[T]):
    call: Callable[[], T]
    affinity: bytes
    #: The work's size (characters to tokenize); 0: unknown, always worth starting.
    size: int
    #: Loop time by which the answer is useful.
    deadline: float
    #: What the requester awaits; done before the job starts: nobody waits any more (late).
    answer: asyncio.Future[T | None]
    #: Worth running late: its opening recurs (or is unknown).
    learns: bool = True
    #: Tried to measure a stale speed: it fits whatever the speed says.
    probe: bool = False


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
        self.completed = 0
        self.fallbacks: dict[Fallback, int] = {"queue_full": 0, "budget": 0}
        #: Late prompts dropped unrun to make room (they would only have taught the segment tree).
        self.dropped = 0
        #: Late prompts not run: their opening did not recur, so they would have taught nothing.
        self.skipped = 0
        self.openings = Openings()
        self._waiting: deque[_Job[Any]] = deque()
        self._late: deque[_Job[Any]] = deque()
        self._running = 0
        #: Seconds and sizes of recent calls, each weighted down by SPEED_WEIGHT per newer call.
        self._seconds = 0.0
        self._sizes = 0.0
        #: Loop time the speed was last learned, and a prompt last tried to measure it.
        self._learned_at = float("-inf")
        self._probed_at = float("-inf")

    @property
    def in_processes(self) -> bool:
        """True when calls run in other processes (they must then be picklable)."""
        return self.workers.in_processes

    @property
    def pending(self) -> int:
        """Prompts being tokenized or waiting for a worker (late ones included)."""
        return self._running + len(self._waiting) + len(self._late)

    async def run(
        self, call: Callable[[], T], affinity: bytes = b"", size: int = 0, opening: bytes = b""
    ) -> T | None:
        """``call()`` in a worker; None if the queue is full or it cannot be ready within the budget.

        Exceptions from ``call`` propagate to the awaiting request (its caller decides what a bad
        prompt means). ``affinity``: calls alike in it go to the same process, when in processes.
        ``size``: how much work the call is (characters), to judge whether it can still be ready.
        ``opening``: the request's body, whose opening decides whether the call runs late (empty:
        unknown, it does).
        """
        if self.pending >= self.max_pending:
            if not self._late:
                self.fallbacks["queue_full"] += 1
                return None
            self._late.popleft()
            self.dropped += 1
        loop = asyncio.get_running_loop()
        now = loop.time()
        learns = not opening or self.openings.recurs(opening)
        job = _Job(call, affinity, size, now + self.budget, loop.create_future(), learns)
        if not self._fits(job, now):  # not even a free worker could make it: late at once
            job.answer.set_result(None)
            self._make_late(job)
            self._dispatch()
            self.fallbacks["budget"] += 1
            return None
        self._waiting.append(job)
        self._dispatch()
        try:
            answer = await asyncio.wait_for(job.answer, self.budget)
        except TimeoutError:
            answer = None
            if job in self._waiting:  # not started: late, so a new prompt may take its place
                self._waiting.remove(job)
                self._make_late(job)
        if answer is None:
            self.fallbacks["budget"] += 1
        return answer

    def close(self) -> None:
        """Stop the workers once they finish what they run (no new calls after this)."""
        for job in (*self._waiting, *self._late):
            if not job.answer.done():
                job.answer.set_result(None)
        self._waiting.clear()
        self._late.clear()
        self.workers.close()

    def _dispatch(self) -> None:
        """Hand workers the next prompts, while they have room."""
        now = asyncio.get_running_loop().time()
        while self._running < self.workers.capacity:
            job = self._next(now)
            if job is None:
                return
            self._start(job)

    def _next(self, now: float) -> _Job[Any] | None:
        """The oldest waiting prompt that can be ready in time; else the newest late one."""
        while self._waiting:
            job = self._waiting.popleft()
            if job.answer.done():  # its requester gave up waiting
                self._make_late(job)
            elif self._fits(job, now):
                return job
            else:  # cannot be ready in time: its requester goes on now, not at the deadline
                job.answer.set_result(None)
                self._make_late(job)
        return self._late.pop() if self._late else None

    def _make_late(self, job: _Job[Any]) -> None:
        """Keep ``job`` to run late if it teaches something."""
        if job.learns:
            self._late.append(job)
        else:
            self.skipped += 1

    def _fits(self, job: _Job[Any], now: float) -> bool:
        """True unless the workers' speed says ``job`` cannot be ready by its deadline (an unknown
        speed or size: it can; a stale speed: one prompt can, to measure it)."""
        if job.probe:
            return True
        if now - max(self._learned_at, self._probed_at) > SPEED_STALE_S:
            job.probe = True
            self._probed_at = now
            return True
        return not self._sizes or now + job.size * self._seconds / self._sizes <= job.deadline

    def _start(self, job: _Job[Any]) -> None:
        self._running += 1
        try:
            submitted = self.workers.submit(job.call, job.affinity)
        except BaseException:
            self._running -= 1
            raise
        asyncio.wrap_future(submitted).add_done_callback(functools.partial(self._finished, job))

    def _finished(self, job: _Job[Any], future: asyncio.Future[tuple[float, Any]]) -> None:
        self._running -= 1
        self.completed += 1
        if future.cancelled():  # the workers were closed: routed without the ids
            if not job.answer.done():
                job.answer.set_result(None)
        elif (error := future.exception()) is not None:
            if not job.answer.done():
                job.answer.set_exception(error)
        else:
            seconds, result = future.result()
            self._learn(job.size, seconds, asyncio.get_running_loop().time())
            if not job.answer.done():
                job.answer.set_result(result)
        self._dispatch()

    def _learn(self, size: int, seconds: float, now: float) -> None:
        # A ratio of sums, not a mean of ratios: a small call slowed by a pause weighs little.
        if size >= SPEED_MIN_SIZE:
            if now - self._learned_at > SPEED_STALE_S:  # a new measure replaces a stale speed
                self._seconds = self._sizes = 0.0
            self._learned_at = now
            self._seconds = self._seconds * (1 - SPEED_WEIGHT) + seconds
            self._sizes = self._sizes * (1 - SPEED_WEIGHT) + size
