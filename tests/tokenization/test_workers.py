"""Tokenizing in worker processes: the same ids as in this process, sticky conversations, and a
worker that dies is replaced without taking serve with it. Real spawned processes throughout. And
worker threads: they give the cores to the event loop first."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from array import array
from collections.abc import AsyncIterator
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import orjson
import pytest
from waiting import eventually

from extproc.openai import parse_request
from extproc.settings import TokenizerSpec
from extproc.tokenize.pool import TokenizePool
from extproc.tokenize.registry import SHIPPED_TOKENIZER, TokenizerRegistry
from extproc.tokenize.workers import (
    THREAD_NICE,
    BodyIds,
    ProcessWorkers,
    ThreadWorkers,
    WorkerSetup,
    body_ids,
)

MODEL = "tiny"
SPECS = (TokenizerSpec(MODEL, SHIPPED_TOKENIZER, "llama3"),)
CHAT = "/v1/chat/completions"
HISTORY = "The quarterly report covers revenue, costs, hiring and the outlook. " * 80


def chat_body(*turns: str) -> bytes:
    messages = [{"role": "system", "content": HISTORY}]
    messages += [{"role": "user", "content": turn} for turn in turns]
    return orjson.dumps({"model": MODEL, "messages": messages})


@pytest.fixture
async def pool() -> AsyncIterator[TokenizePool]:
    workers = ProcessWorkers(2, WorkerSetup(SPECS, segment_cache_bytes=1 << 20))
    workers.start()
    pool = TokenizePool(budget=30.0, workers=workers)
    try:
        yield pool
    finally:
        pool.close()


async def ids_of(pool: TokenizePool, body: bytes) -> BodyIds:
    answer = await pool.run(functools.partial(body_ids, MODEL, CHAT, body), affinity=body)
    assert answer is not None
    return answer


def as_list(answer: BodyIds) -> list[int]:
    assert answer.ids is not None, answer.error
    ids = array("I")
    ids.frombytes(answer.ids)
    return ids.tolist()


async def test_a_worker_process_gives_the_ids_this_process_gives(pool: TokenizePool) -> None:
    here = TokenizerRegistry.load(SPECS).get(MODEL)
    assert here is not None
    body = chat_body("What were the costs?")
    prompt = parse_request(body, path=CHAT).read_prompt()
    assert prompt is not None
    assert as_list(await ids_of(pool, body)) == here.prompt_ids(prompt)


async def test_a_body_the_engine_would_refuse_comes_back_as_a_bad_request(pool: TokenizePool) -> None:
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": 42}]})
    answer = await ids_of(pool, body)
    assert answer.ids is None and answer.error is not None
    bad_request, message = answer.error
    assert bad_request and "content" in message


async def test_a_conversation_keeps_to_one_worker_whose_cache_it_hits(pool: TokenizePool) -> None:
    workers = pool.workers
    assert isinstance(workers, ProcessWorkers)
    for turn in range(4):
        await ids_of(pool, chat_body(*(f"Question {n}?" for n in range(turn + 1))))
    totals = workers.cache_totals(MODEL)
    assert totals is not None
    stats, held = totals
    # The long history was encoded once, then found in the same worker's cache three times.
    assert stats.hits >= 3 and held > 0
    assert sum(1 for per_model in workers.cache if MODEL in per_model) == 1


async def test_a_worker_that_dies_is_replaced_and_what_it_ran_counted_lost(pool: TokenizePool) -> None:
    workers = pool.workers
    assert isinstance(workers, ProcessWorkers)
    body = chat_body("Hiring?")
    await ids_of(pool, body)
    running = asyncio.ensure_future(pool.run(functools.partial(time.sleep, 10), affinity=body))
    await asyncio.sleep(0.5)
    victims = workers.pids()
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    with pytest.raises(BrokenProcessPool):
        await running
    assert workers.lost == 1
    # Both workers died: the next calls are served by new processes, whichever worker they go to.
    for question in ("Costs?", "Outlook?", "Revenue?"):
        assert as_list(await ids_of(pool, chat_body(question)))
    assert not set(workers.pids()) & set(victims)
    assert pool.pending == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux threads have own priorities")
def test_tokenizing_threads_yield_the_cores_to_the_event_loop() -> None:
    """The worker threads are idle-class (and nicer, should that be refused), while the thread that
    made them (the event loop's) stays in the normal class."""
    workers = ThreadWorkers(2)
    try:
        workers.start()
        _, (policy, nice) = workers.submit(lambda: (own_policy(), own_nice())).result(10)
    finally:
        workers.close()
    assert policy == os.SCHED_IDLE
    assert nice == own_nice() + THREAD_NICE
    assert own_policy() == os.SCHED_OTHER


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads thread priorities from /proc")
async def test_worker_processes_yield_the_cores_to_the_event_loop(pool: TokenizePool) -> None:
    """Every thread of a worker process (the one that runs the calls, the library's pool) is
    idle-class, as the worker threads are; this process's event loop stays in the normal class."""
    as_list(await ids_of(pool, chat_body("Hello there.")))  # a library pool exists now
    workers = pool.workers
    assert isinstance(workers, ProcessWorkers) and len(workers.pids()) == 2

    def priorities() -> set[tuple[int, int]]:
        """(nice, scheduling policy) of every thread of the worker processes."""
        threads = [
            Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            for pid in workers.pids()
            for tid in os.listdir(f"/proc/{pid}/task")
        ]
        return {(int(fields[16]), int(fields[38])) for fields in threads}

    # The process that did not run the call may still be starting (its loading lowers it).
    await eventually(
        lambda: all(nice >= THREAD_NICE and policy == os.SCHED_IDLE for nice, policy in priorities()),
        within=30,
        what="every worker-process thread idle-class",
    )
    assert own_policy() == os.SCHED_OTHER


def own_policy() -> int:
    return os.sched_getscheduler(threading.get_native_id())


def own_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads thread priorities from /proc")
def test_the_tokenizer_librarys_own_threads_yield_like_the_workers() -> None:
    """In a fresh process (the library's pool is made once per process): once the workers have
    started, even a batch encoded on the main thread runs on idle-class threads, no less nice than
    the workers."""
    script = """
import os
from extproc.tokenize.workers import ThreadWorkers, start_library_pool
workers = ThreadWorkers(1)
workers.start()
workers.submit(lambda: None).result(10)
start_library_pool()  # on the main thread too: the pool exists already, nothing new is made
main = os.getpid()
stats = [
    open(f"/proc/{main}/task/{t}/stat").read().rsplit(")", 1)[1].split()
    for t in os.listdir(f"/proc/{main}/task") if int(t) != main
]
print(" ".join(f"{fields[16]},{fields[38]}" for fields in stats))  # nice, scheduling policy
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    threads = [tuple(int(n) for n in t.split(",")) for t in done.stdout.split()]
    # The worker thread, and the library's pool (one thread per core at least).
    assert len(threads) >= 2, done.stdout
    assert all(nice >= THREAD_NICE and policy == os.SCHED_IDLE for nice, policy in threads), threads
