"""Where a :class:`~extproc.tokenize.pool.TokenizePool` runs its calls: threads, or processes.

**Threads** (:class:`ThreadWorkers`) share this process's tokenizers and prompt-piece caches. An
encode releases the GIL, so encodes use every core; a chat template render is Python, and holds the
GIL that the event loop needs for up to the interpreter's switch interval at a time. The threads,
and the tokenizer library's own pool, run behind the event loop (:func:`lower_priority`): when the
cores are short, long prompts wait (and past their budget are routed approximately) rather than
every other decision.

**Processes** (:class:`ProcessWorkers`) each load their own copy of the tokenizers once, at start,
and are handed the raw request body: the JSON parse, the template render and the encode all run
outside this process, so none of it holds the event loop's GIL, and renders use more than one
core. They run idle-class too (:func:`lower_priority`, their whole process). The price: each
process's memory (the tokenizers, its own prompt-piece cache), ~1 s to start,
and a pickled body and ids per call. A conversation sticks to one process (chosen by the start of
its body, unless that one is busier than another by two calls), so its next turn finds its pieces
cached there.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import threading
import time
from array import array
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import tokenizers

from extproc.errors import BadRequest
from extproc.openai import parse_request
from extproc.settings import TokenizerSpec
from extproc.tokenize.registry import TokenizerRegistry
from extproc.tokenize.segments import CacheStats

T = TypeVar("T")
log = logging.getLogger(__name__)
#: Bytes from the start of a body that choose its process: a conversation's first message.
AFFINITY_BYTES = 1024
#: A conversation leaves its process for another only when that one is busier by this many calls.
AFFINITY_SLACK = 2
#: How much nicer than the event loop tokenizing threads run where they cannot be made idle-class
#: (Linux: each thread has its own nice value). At 10 the scheduler gives the loop ~10 times their
#: share of a contended core.
THREAD_NICE = 10


class ThreadWorkers:
    """Calls run in a thread pool of this process (created on first use)."""

    in_processes = False

    def __init__(self, threads: int | None = None) -> None:
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        self.count = threads or os.cpu_count() or 1
        #: Calls worth handing over at once: one per thread (a queued call would wait blind).
        self.capacity = self.count
        self._executor: ThreadPoolExecutor | None = None

    #: Threads never die on their own (the counterpart of :attr:`ProcessWorkers.lost`).
    lost = 0

    def start(self) -> None:
        """Make the tokenizer library's thread pool now, from a worker thread, so its threads
        inherit the workers' priority (it is made by whichever thread first encodes a batch)."""
        self._pool().submit(start_library_pool)

    def cache_totals(self, model: str) -> tuple[CacheStats, int] | None:
        """None: threads use this process's own caches, reported with its tokenizers."""
        return None

    def submit(self, call: Callable[[], T], affinity: bytes = b"") -> Future[tuple[float, T]]:
        """``call()`` in a thread; the future holds how long it ran there, and its result."""
        return self._pool().submit(timed, call)

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                self.count, thread_name_prefix="tokenize", initializer=lower_priority, initargs=(THREAD_NICE,)
            )
        return self._executor

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


@dataclass(frozen=True, slots=True)
class WorkerSetup:
    """What a worker process loads at start (picklable): the same tokenizers serve loaded."""

    specs: tuple[TokenizerSpec, ...]
    hf_cache: Path | None = None
    segment_cache_bytes: int = 0


@dataclass(frozen=True, slots=True)
class BodyIds:
    """A worker's answer: the prompt's ids (``array('I')`` bytes), or why there are none."""

    model: str
    ids: bytes | None
    #: ``(is_bad_request, message)`` when the body could not be tokenized.
    error: tuple[bool, str] | None = None
    #: The worker's prompt-piece cache for this model, after this call (None: no cache).
    cache: CacheStats | None = None
    cache_bytes: int = 0
    #: What the call's ``then`` made of the ids (block keys per block size, as bytes).
    keys: dict[int, bytes] = field(default_factory=dict)


class WorkerFailed(Exception):
    """A worker process could not tokenize a body, not for the client's fault: what it raised."""


class ProcessWorkers:
    """``count`` worker processes, one executor each, chosen per call by affinity and load."""

    in_processes = True

    def __init__(self, count: int, setup: WorkerSetup) -> None:
        if count < 1:
            raise ValueError(f"count must be at least 1, got {count}")
        self.count = count
        # Room for a conversation to stay on its process while the other is busy too.
        self.capacity = count * AFFINITY_SLACK
        self._setup = setup
        # spawn, not fork: this process runs gRPC and asyncio threads that a fork would copy mid-state.
        self._context = multiprocessing.get_context("spawn")
        self._executors: list[ProcessPoolExecutor | None] = [None] * count
        #: Calls submitted and not finished, per worker (finished in the executors' own threads).
        self._busy = [0] * count
        self._lock = threading.Lock()
        #: Each worker's latest prompt-piece cache figures, per model (see :meth:`cache_totals`).
        self.cache: list[dict[str, tuple[CacheStats, int]]] = [{} for _ in range(count)]
        #: Cache counts of worker processes that died, so the totals never go back.
        self._retired: dict[str, CacheStats] = {}
        #: Calls lost because a worker process died (it is replaced on the next call).
        self.lost = 0

    def start(self) -> None:
        """Start every process now (each loads the tokenizers), not on the first long prompt."""
        for worker in range(self.count):
            self._executor(worker).submit(_ready)

    def submit(self, call: Callable[[], T], affinity: bytes = b"") -> Future[tuple[float, T]]:
        """``call()`` in a process (picklable); the future holds how long it ran there, and its
        result."""
        with self._lock:
            worker = self._choose(affinity)
            self._busy[worker] += 1
        try:
            executor = self._executor(worker)
            try:
                future = executor.submit(timed, call)
            except BrokenProcessPool:  # its process died while idle: replace it, nothing was lost
                self._retire(worker, executor)
                executor = self._executor(worker)
                future = executor.submit(timed, call)
        except BaseException:
            with self._lock:
                self._busy[worker] -= 1
            raise
        future.add_done_callback(lambda f: self._done(worker, executor, f))
        return future

    def pids(self) -> list[int]:
        """The worker processes alive now."""
        return [
            pid
            for executor in self._executors
            if executor is not None
            # The executor keeps no public list of its processes.
            for pid, process in getattr(executor, "_processes", {}).items()
            if process.is_alive()
        ]

    def close(self) -> None:
        for executor in self._executors:
            if executor is not None:
                executor.shutdown(wait=False, cancel_futures=True)
        self._executors = [None] * self.count

    def cache_totals(self, model: str) -> tuple[CacheStats, int] | None:
        """The prompt-piece cache figures of ``model`` over the workers, past ones' counts included
        (None: none reported yet)."""
        reported = [per_model[model] for per_model in self.cache if model in per_model]
        retired = self._retired.get(model)
        if not reported and retired is None:
            return None
        total = CacheStats()
        for stats, _ in reported:
            total.add(stats)
        if retired is not None:
            total.add(retired)
        return total, sum(held for _, held in reported)

    def _choose(self, affinity: bytes) -> int:
        preferred = hash(affinity[:AFFINITY_BYTES]) % self.count
        least = min(range(self.count), key=self._busy.__getitem__)
        return least if self._busy[preferred] - self._busy[least] >= AFFINITY_SLACK else preferred

    def _executor(self, worker: int) -> ProcessPoolExecutor:
        executor = self._executors[worker]
        if executor is None:
            executor = ProcessPoolExecutor(
                1, mp_context=self._context, initializer=_load, initargs=(self._setup,)
            )
            self._executors[worker] = executor
        return executor

    def _retire(self, worker: int, executor: ProcessPoolExecutor) -> None:
        """``executor``'s process died: the next call to ``worker`` starts a new one. (A broken
        executor has already failed its calls and cleaned up after itself.)"""
        with self._lock:
            if self._executors[worker] is not executor:
                return  # already replaced
            self._executors[worker] = None
            for model, (stats, _) in self.cache[worker].items():
                self._retired.setdefault(model, CacheStats()).add(stats)
            self.cache[worker] = {}

    def _done(self, worker: int, executor: ProcessPoolExecutor, future: Future[Any]) -> None:
        with self._lock:  # in the executor's management thread
            self._busy[worker] -= 1
        if future.cancelled():
            return
        error = future.exception()
        if error is not None:
            if isinstance(error, BrokenProcessPool):
                self.lost += 1
                self._retire(worker, executor)
            return
        _, result = future.result()
        if isinstance(result, BodyIds) and result.cache is not None and self._executors[worker] is executor:
            self.cache[worker][result.model] = (result.cache, result.cache_bytes)


# -- in the worker ----------------------------------------------------------------------------


def timed(call: Callable[[], T]) -> tuple[float, T]:
    """``call()`` and how long it ran (seconds), measured where it ran."""
    started = time.perf_counter()
    result = call()
    return time.perf_counter() - started, result


_registry: TokenizerRegistry | None = None


def _load(setup: WorkerSetup) -> None:
    global _registry
    # Behind serve's event loop, as the worker threads are; the tokenizer library's pool, made in
    # this thread on the first batch, inherits it.
    lower_priority(THREAD_NICE)
    _registry = TokenizerRegistry.load(
        setup.specs, hf_cache=setup.hf_cache, segment_cache_bytes=setup.segment_cache_bytes
    )


def _ready() -> bool:
    return _registry is not None


def body_ids(
    model: str, path: str, body: bytes, then: Callable[[Sequence[int]], dict[int, bytes]] | None = None
) -> BodyIds:
    """In a worker: the ids of the prompt in ``body`` (a request to ``path``) for ``model``, and
    ``then(ids)`` (the block keys, computed where the ids are)."""
    entry = None if _registry is None else _registry.get(model)
    if entry is None:
        return BodyIds(model, None, (False, f"no tokenizer for model {model!r} in this worker"))
    try:
        prompt = parse_request(body, path=path).read_prompt()
        ids = None if prompt is None else entry.prompt_ids(prompt)
        keys = then(ids) if then is not None and ids is not None else {}
    except BadRequest as exc:
        return BodyIds(model, None, (True, exc.message))
    except Exception as exc:  # a bug, reported to the parent, which logs it (rate-limited)
        return BodyIds(model, None, (False, f"{type(exc).__name__}: {exc}"[:500]))
    cache = entry.tokenizer.segment_cache
    return BodyIds(
        model,
        None if ids is None else array("I", ids).tobytes(),
        None,
        None if cache is None else _copy(cache.stats),
        0 if cache is None else cache.bytes,
        keys,
    )


def _copy(stats: CacheStats) -> CacheStats:
    return CacheStats(stats.hits, stats.misses, stats.evictions)


def lower_priority(nice: int) -> None:
    """Put the calling thread, and the threads it starts (Linux copies both to them), behind the
    normal threads it shares the cores with (in a container, those of its own cgroup): scheduled
    idle-class (``SCHED_IDLE``), else ``nice`` nicer.

    Idle-class rather than only nicer: a thread at nice +10 that holds a core keeps it until its
    time slice is over when the event loop wakes, which delays the decision that woke it; any thread
    of the normal class that wakes takes the core from an idle-class one at once. The risk is the
    GIL: an idle-class thread preempted while it holds it (rendering a template) keeps the loop
    waiting until it runs again, which on cores full of other work can take a while; the switch
    interval serve sets while threads tokenize (0.2 ms) keeps such holds short, and the A/B in
    ``docs/investigations/long_prompts_sched_idle_ab.md`` measured the small requests' p99 lower, not
    higher. Nothing where threads have no priority of their own."""
    if sys.platform != "linux":
        return
    thread = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, thread, os.getpriority(os.PRIO_PROCESS, thread) + nice)
        os.sched_setscheduler(thread, os.SCHED_IDLE, os.sched_param(0))
    except OSError as exc:  # a sandbox forbidding it: run as near the loop's priority as allowed
        log.info("tokenizing threads keep more of the event loop's CPU priority: %s", exc)


def start_library_pool() -> None:
    """Have the tokenizer library start its thread pool (rayon's, made on the first batch encoded
    with parallelism on) in this thread, whose priority its threads then inherit."""
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0}, unk_token="a"))
    backend.encode_batch(["a", "a"])
