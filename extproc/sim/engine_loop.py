"""The asyncio shell around :class:`~extproc.sim.engine_core.EngineCore`: model time on a wall clock.

One background task steps the core while it has work. Model time advances by each step's duration;
the wall clock follows at ``time_scale`` wall seconds per model second (0.01 = 100x faster than a GPU).

* Deadline-based pacing: the next deadline is the previous one plus ``duration * time_scale``, so
  sleep overshoot does not accumulate. Steps whose deadline is less than ~1 ms ahead are not slept
  for (tiny scaled steps are grouped instead of burning CPU on sub-millisecond sleeps); when the loop
  falls more than ``max_lag_s`` behind, it drops the debt and model time jumps to the wall clock.
  :attr:`EngineLoop.lag_dropped_s` adds up the wall seconds so dropped: a benchmark whose engines
  dropped any measured a slower engine than the one modelled (the machine could not keep up).
* Outputs are delivered to per-request streams at the step's deadline, when a real engine would have
  produced them. A consumer that cancels or leaves aborts its request, which frees its blocks.
* ``publish(events, wall_ts)`` is called once per step that produced KV events.
* Idle costs nothing: the task waits on an :class:`asyncio.Event` set by :meth:`EngineLoop.submit`.
  An *idle step* (nothing runs, a CPU->GPU load is in flight) waits for its end or for an arrival,
  whichever comes first, so a request arriving meanwhile is scheduled when it arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Literal, TypeVar

from extproc.sim.engine_core import EngineCore, RequestOutput, SimRequest, StepResult
from extproc.sim.kv_events import KVEvent

logger = logging.getLogger(__name__)

#: Deadlines closer than this (wall seconds) are not slept for: the steps are grouped instead.
MIN_SLEEP_S = 0.001

Finish = Literal["completed", "aborted"]
_T = TypeVar("_T")


class RequestHandle:
    """One submitted request: an async iterator of output chunks, then its finish information.

    Each chunk is a :class:`RequestOutput` merging every step delivered since the consumer last read
    (like vLLM's output collector), so a slow consumer never falls behind by more than one wake-up;
    ``ttft``/``queue_time`` ride on the chunk holding the first token, ``finished`` on the last. Leaving early
    must go through :meth:`cancel` or ``async with handle:``; a consumer task cancelled while waiting
    cancels the request by itself.
    """

    __slots__ = (
        "_first_pending",
        "_last",
        "_loop",
        "_pending",
        "_ready",
        "finish",
        "num_cached_tokens",
        "queue_time",
        "request_id",
        "ttft",
    )

    def __init__(self, loop: EngineLoop, request_id: str) -> None:
        self._loop = loop
        self._pending: list[int] = []
        self._first_pending = False
        self._last: RequestOutput | None = None
        self._ready = asyncio.Event()
        self.request_id = request_id
        #: Prompt tokens served from the prefix cache, known from the first chunk on.
        self.num_cached_tokens: int | None = None
        #: Model seconds, known from the first chunk on.
        self.ttft: float | None = None
        self.queue_time: float | None = None
        #: None while running; "completed" once every token was produced, "aborted" otherwise.
        self.finish: Finish | None = None

    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> RequestOutput:
        while not self._pending:
            if self.finish is not None:
                raise StopAsyncIteration
            self._ready.clear()
            try:
                await self._ready.wait()
            except asyncio.CancelledError:
                self.cancel()
                raise
        tokens, self._pending = self._pending, []
        first, self._first_pending = self._first_pending, False
        last = self._last
        return RequestOutput(
            self.request_id,
            tokens,
            last is not None,
            self.num_cached_tokens or 0,
            self.ttft if first else None,
            self.queue_time if first else None,
            None if last is None else last.e2e,
            None if last is None else last.finish_reason,
        )

    def cancel(self) -> None:
        """Abort the request (client gone); harmless once it has finished."""
        if self.finish is None:
            self._loop._abort(self.request_id)

    async def __aenter__(self) -> RequestHandle:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.cancel()

    def _deliver(self, out: RequestOutput) -> None:
        if out.ttft is not None:
            self.ttft, self.queue_time = out.ttft, out.queue_time
            self._first_pending = True
        self.num_cached_tokens = out.num_cached_tokens
        self._pending.extend(out.new_token_ids)
        if out.finished:
            self.finish = "completed"
            self._last = out
        self._ready.set()

    def _end(self, finish: Finish) -> None:
        if self.finish is None:
            self.finish = finish
        self._ready.set()


class EngineLoop:
    """Runs an :class:`EngineCore` in the background, paced against the wall clock."""

    def __init__(
        self,
        core: EngineCore,
        *,
        time_scale: float,
        publish: Callable[[list[KVEvent], float], object] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        on_step: Callable[[StepResult], object] | None = None,
        on_output: Callable[[RequestOutput], object] | None = None,
        max_lag_s: float = 0.1,
    ) -> None:
        if not time_scale > 0:
            raise ValueError(f"time_scale must be > 0 wall seconds per model second, got {time_scale!r}")
        self.core = core
        self.time_scale = time_scale
        self._publish = publish
        self._clock = clock
        self._wall_clock = wall_clock
        self._sleep = sleep
        self._on_step = on_step
        self._on_output = on_output
        self._max_lag = max_lag_s
        self._origin = clock()
        #: Wall (clock) time at which the step in progress ends; None while idle.
        self._deadline: float | None = None
        self._handles: dict[str, RequestHandle] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        #: Wall seconds the loop fell behind its model and gave up catching up on (see module doc).
        self.lag_dropped_s = 0.0

    def model_time(self) -> float:
        """Model seconds now; while busy, never past the end of the step in progress.

        The cap keeps arrivals no later than the next step's start when the loop runs behind the
        clock, so TTFT and queue time stay positive and consistent with the step timeline.
        """
        wall = self._clock()
        if self._deadline is not None:
            wall = min(wall, self._deadline)
        return (wall - self._origin) / self.time_scale

    async def start(self) -> None:
        """Start the background task in the running event loop."""
        if self._task is None and not self._closed:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine-loop")

    async def close(self) -> None:
        """Stop stepping, abort every request in flight and end all their streams."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._abort_all()

    def submit(self, req: SimRequest) -> RequestHandle:
        """Queue a request arriving now (its ``arrival_time`` is set here); raises ValueError if invalid."""
        if self._closed:
            raise RuntimeError("the engine loop is closed")
        req.arrival_time = self.model_time()
        self.core.add_request(req)
        handle = RequestHandle(self, req.request_id)
        self._handles[req.request_id] = handle
        self._wake.set()
        return handle

    def _abort(self, request_id: str) -> None:
        self.core.abort(request_id)
        handle = self._handles.pop(request_id, None)
        if handle is not None:
            handle._end("aborted")

    def _abort_all(self) -> None:
        for request_id in list(self._handles):
            self._abort(request_id)

    async def _run(self) -> None:
        try:
            await self._step_forever()
        except Exception:
            logger.exception("simulated engine loop failed; aborting every request")
            self._closed = True
            self._abort_all()

    async def _step_forever(self) -> None:
        core, scale = self.core, self.time_scale
        while True:
            if not core.has_work:
                self._deadline = None
                self._wake.clear()
                await self._wake.wait()
                continue
            if self._deadline is None:
                self._deadline = self._clock()
            result = core.step((self._deadline - self._origin) / scale)
            self._deadline += result.duration * scale
            if result.idle:
                self._deliver(result)
                await self._idle_until(self._deadline)
                continue
            await self._wait_until(self._deadline)
            self._deliver(result)

    async def _idle_until(self, deadline: float) -> None:
        """Wait for ``deadline`` or a submit; the next step starts then (model time = wall time)."""
        self._wake.clear()
        delay = deadline - self._clock()
        if delay >= MIN_SLEEP_S:
            sleeper = asyncio.ensure_future(self._sleep(delay))
            waker = asyncio.ensure_future(self._wake.wait())
            try:
                await asyncio.wait((sleeper, waker), return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (sleeper, waker):
                    task.cancel()
                await asyncio.gather(sleeper, waker, return_exceptions=True)
            self._deadline = min(self._clock(), deadline)
        else:
            await self._wait_until(deadline)

    async def _wait_until(self, deadline: float) -> None:
        delay = deadline - self._clock()
        if delay >= MIN_SLEEP_S:
            await self._sleep(delay)
            return
        if delay < -self._max_lag:
            # Too slow to keep up: forget the debt rather than race to catch up forever.
            self.lag_dropped_s += -delay
            self._deadline = self._clock()
        await asyncio.sleep(0)  # let submitters and consumers run between grouped steps

    def _deliver(self, result: StepResult) -> None:
        handles = self._handles
        for out in result.outputs:
            handle = handles.get(out.request_id)
            if handle is None:
                continue  # aborted while the step ran
            handle._deliver(out)
            if out.finished:
                del handles[out.request_id]
            if self._on_output is not None:
                self._hook(self._on_output, out)
        if result.events and self._publish is not None:
            try:
                self._publish(result.events, self._wall_clock())
            except Exception:
                logger.exception("publishing KV events failed; the batch is lost")
        if self._on_step is not None:
            self._hook(self._on_step, result)

    @staticmethod
    def _hook(hook: Callable[[_T], object], value: _T) -> None:
        """Observers (metrics) must not be able to stop the engine."""
        try:
            hook(value)
        except Exception:
            logger.exception("a simulated engine observer failed")
