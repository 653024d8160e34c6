"""Long prompts against short ones: what tokenizing them costs `serve`'s decisions (issue 13 targets).

`serve` (a subprocess) routes precisely with the real Llama 3 tokenizer (128k vocabulary, its own
chat template; ``scripts/fetch_tokenizers.py``) over 8 endpoints that declare KV events. The gRPC
load client plays Envoy (``grpc_load.one_stream``); nothing else runs. Bodies never repeat except
the small one, so no cache of whole bodies can help. Measured, per `serve` variant, in one run:

- **small**: decisions/s of a 64-byte chat, 16 streams (the reference for the ratios below),
  measured before and after each conversation measure: a ratio takes the mean of the two around it;
- **conversations 8k / 32k**: 16 clients, each walking its own conversations (history of ~8k or
  ~32k tokens plus one new ~30-word user turn per request; the answer joins the history). Each
  client takes its 8 conversations in turn, so a history grows by ~1k tokens over the measure, not
  by ~7k (the report gives the range); every conversation's first two turns are sent before it,
  and the measure starts once serve has tokenized them (those past their budget are routed
  approximately and, from a conversation's second turn on, tokenized afterwards: the report gives
  how long that took);
- **cold 8k**: unique ~8k-token chats, 16 streams: `serve`'s prompt tokens/s against the tokenizer
  library's own ``encode_batch`` on the same texts in this process (all cores);
- **no stall**: the small requests' p99 from the load client at 16 streams (the issue's setup),
  alone and while another client (a process of its own) streams unique ~32k-token chats one after
  another, alternating 5 times, each side's latencies pooled; and, stricter, the same with the
  small requests sent one at a time (once);
- **next turn**: one stream, once serve has nothing left to tokenize; p50 of a conversation's next
  turn (same ~8k history, a new last message) against p50 of cold ~8k prompts, each with the share
  tokenized in time, and a 64-byte chat's p50: the round trip both pay. Each is timed from opening
  the stream to the routing answer (``grpc_load.Exchange.decided_s``), what the request waits for
  its route, as Envoy times its own call; the whole stream (that, plus the body echoed back, the
  response-headers exchange a real request has after its engine answers, and the close) is
  reported too. The three kinds go in alternating blocks, each kind pooled; serve's own mean
  decision time per kind is given too;
- **next turn, through Envoy**: the same three kinds in the same blocks, sent over HTTP through the
  shipped gateway (real Envoy, FULL_DUPLEX) to fake engines, timed by Envoy itself: p50 of its
  ext_proc call for the request headers, which serve answers once the endpoint is picked
  (``bench/envoy_timing.py``). Envoy (C++) is then serve's client, as in production, instead of
  the Python load client, whose own share of a round trip is larger than serve's (no target of
  its own: the issue's is taken with the load client);
- **event loop**: `serve`'s own ``extproc_event_loop_lag_seconds``: the 10 ms timer ticks more
  than 5 ms late over the whole run, and the largest bucket reached; also per measure, with the
  first small one (no tokenizing at all) as the control for what the machine alone costs; the
  full garbage collections (``extproc_gc_pause_seconds``), which stop the loop too; and, directly,
  how long each prompt's tokenization held the loop (``extproc_tokenize_loop_seconds``): the
  timer's lateness adds up everything that ran before it (several requests, collections, the
  machine's other threads), the hold is tokenizing alone.

Variants: ``inline`` (``--tokenize-threads 0``: tokenized on the event loop, as before), ``threads``
(the default: worker threads, bounded) and ``processes`` (``--tokenize-processes 2``: two worker
processes, bounded the same way). Writes ``bench/results/long_prompts.{json,md}``.

    python bench/long_prompts.py [--seconds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import orjson
import tokenizers
from envoy_timing import TimedGateway
from grpc_load import Exchange, StreamError, chat_body, closed_loop, exchange, one_stream, request_messages
from machine import machine, provenance, record
from stack import ServeProcess

from extproc.demo.catalog import LocalWorkerSet, catalog_yaml
from extproc.pb.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "scripts"))
sys.path.insert(0, str(HERE.parent / "tests"))
from fetch_tokenizers import ensure  # noqa: E402
from ports import free_port  # noqa: E402

MODEL = "bench-model"
STREAMS = 16
#: Conversations per stream, taken in turn: each advances one turn (~65 tokens) per request, and
#: with one conversation per stream a 5 s measure (~1,700 turns) would end their "~8k-token"
#: histories at ~15k; with 8, they end at ~9k (the report gives each measure's range).
CONVERSATIONS_PER_STREAM = 8
#: Turns of every conversation sent before a conversation measure. Past its budget, a prompt is
#: tokenized afterwards only when its opening recurs (``extproc.tokenize.openings``): a
#: conversation's first turn, overloaded, is not, its second is.
WARM_TURNS = 2
#: The longest wait for serve to learn the conversations' first turns (see :func:`learned`).
LEARN_LIMIT_S = 60.0
#: Small requests timed alone and beside the 32k prompts: with 1,000, a p99 is the 10th worst, not
#: one unlucky pause of a shared machine.
STALL_SAMPLES = 1000
#: Unique ~32k-token bodies prepared for the stall measure (it sends fewer: see "valid").
LONG_BODIES = 400
#: Alternations of the 16-stream stall measure (alone, then beside the 32k prompts).
STALL_ROUNDS = 5
#: Next turns and cold prompts for the next-turn ratio, one stream: p50s of this many each, sent
#: in NEXT_TURN_ROUNDS blocks of each kind in turn.
NEXT_TURN_SAMPLES = 240
NEXT_TURN_ROUNDS = 6
VARIANTS = {
    "inline": ["--tokenize-threads", "0"],
    "threads": [],
    "processes": ["--tokenize-processes", "2"],
}
#: Targets of issue 13, as ratios (higher is better, except the stall and next-turn ratios).
TARGETS = {
    "conversations_8k": 0.50,
    "conversations_32k": 0.25,
    "cold_tokens": 0.70,
    "stall": 1.5,
    "next_turn": 0.20,
}
_WORDS = tuple(
    " ".join(
        (
            "the of and to in is was for on that with as by at from this which be are an or it not",
            "have model cache token engine router prefix request latency queue batch prompt memory",
            "block server gateway pool worker decode prefill context window history answer question",
            "system user",
        )
    ).split(" ")
)


class Texts:
    """Random English-like text, calibrated to the tokenizer: ``of(tokens)`` is about that long."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, seed: int) -> None:
        self.rng = random.Random(seed)
        sample = self.words(4000)
        self.chars_per_token = len(sample) / len(tokenizer.encode(sample, add_special_tokens=False).ids)

    def words(self, count: int) -> str:
        return " ".join(self.rng.choice(_WORDS) for _ in range(count))

    def of(self, tokens: int) -> str:
        text = self.words(int(tokens * self.chars_per_token / 5) + 1)
        return text[: int(tokens * self.chars_per_token)]


class Conversation:
    """A history and its next user turn; ``advance`` adds the turn and a short answer."""

    def __init__(self, texts: Texts, history_tokens: int) -> None:
        self.texts = texts
        self.messages: list[dict[str, str]] = [{"role": "system", "content": texts.of(history_tokens)}]

    def history_tokens(self) -> float:
        """About how many tokens the history holds (its messages' text; the template adds ~5 each)."""
        return sum(len(m["content"]) for m in self.messages) / self.texts.chars_per_token

    def body(self) -> bytes:
        self.turn = {"role": "user", "content": self.texts.words(30)}
        messages = [*self.messages, self.turn]
        return orjson.dumps({"model": MODEL, "messages": messages, "max_tokens": 64})

    def advance(self) -> None:
        self.messages += [self.turn, {"role": "assistant", "content": self.texts.words(20)}]


class Turns:
    """Each call takes the idle conversation that waited longest, sends its next turn, and puts it
    back advanced."""

    def __init__(self, send: Callable[[bytes], Awaitable[str]], conversations: list[Conversation]) -> None:
        self._send = send
        self.conversations = conversations
        self._idle: asyncio.Queue[Conversation] = asyncio.Queue()
        for conversation in conversations:
            self._idle.put_nowait(conversation)

    async def warm(self, concurrency: int, turns: int = WARM_TURNS) -> None:
        """Send every conversation's first ``turns`` turns, ``concurrency`` at a time: what serve
        knows of a live conversation before its next turn."""
        for _ in range(0, turns * len(self.conversations), concurrency):
            await asyncio.gather(*(self.next() for _ in range(concurrency)))

    def history_tokens(self) -> float:
        return statistics.fmean(c.history_tokens() for c in self.conversations)

    async def next(self) -> str:
        conversation = await self._idle.get()
        try:
            label = await self._send(conversation.body())
            conversation.advance()
            return label
        finally:
            self._idle.put_nowait(conversation)


def cold_body(texts: Texts, tokens: int) -> bytes:
    messages = [{"role": "user", "content": texts.of(tokens)}]
    return orjson.dumps({"model": MODEL, "messages": messages, "max_tokens": 64})


#: The loop's lag (a 10 ms timer's lateness), how long each prompt's tokenization held it, and
#: the loop thread's CPU time in those holds; with the prefixes of their figures in lag_summary.
LOOP_HISTOGRAMS = {
    "extproc_event_loop_lag_seconds": "",
    "extproc_tokenize_loop_seconds": "hold_",
    "extproc_tokenize_loop_cpu_seconds": "hold_cpu_",
}


async def loop_lag(admin_port: int) -> dict[str, dict[str, float]]:
    """Bucket counts (cumulative, by ``le``) of serve's LOOP_HISTOGRAMS, by name."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{admin_port}/metrics") as resp,
    ):
        text = await resp.text()
    buckets: dict[str, dict[str, float]] = {name: {} for name in LOOP_HISTOGRAMS}
    for line in text.splitlines():
        name = line.split("_bucket{", 1)[0]
        if name in buckets and "_bucket{" in line:
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets[name][le] = float(line.rsplit(" ", 1)[1])
    return buckets


def lag_summary(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, Any]:
    """The timer's ticks, how many were over 5 ms late, and the largest bucket reached; the same
    of the prompts' holds of the loop (``hold_*``), and of their CPU time (``hold_cpu_*``)."""
    out: dict[str, Any] = {}
    for name, prefix in LOOP_HISTOGRAMS.items():
        delta = {le: after[name][le] - before[name].get(le, 0.0) for le in after[name]}
        total = delta.get("+Inf", 0.0)
        over_5ms = total - delta.get("0.005", 0.0)
        worst = next((le for le in sorted(delta, key=lambda x: float(x)) if delta[le] == total), "+Inf")
        out[prefix + ("ticks" if not prefix else "prompts")] = total
        out[prefix + "over_5ms"] = over_5ms
        out[prefix + "worst_bucket_le"] = worst
    return out


def added(snapshots: Iterable[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Bucket counts of several :func:`loop_lag` snapshots added up: with the sums of the snapshots
    before and after each of several measures, :func:`lag_summary` covers them all."""
    total: dict[str, dict[str, float]] = {name: {} for name in LOOP_HISTOGRAMS}
    for snapshot in snapshots:
        for name, buckets in snapshot.items():
            for le, count in buckets.items():
                total[name][le] = total[name].get(le, 0.0) + count
    return total


def gc_summary(samples: dict[str, float]) -> dict[str, float]:
    """Collections over the run: full ones (generation 2), how many, their total and the slow ones;
    young ones (generations 0 and 1), how many and the slow ones (whichever thread's allocation
    triggers a collection runs it holding the GIL, so a slow one in a tokenizing thread stops the
    loop too)."""

    def sample(name: str) -> float:
        return samples.get(f"extproc_gc_pause_seconds_{name}", 0.0)

    def over_5ms(generation: str) -> float:
        count = sample(f'count{{generation="{generation}"}}')
        return count - sample(f'bucket{{generation="{generation}",le="0.005"}}')

    return {
        "full": sample('count{generation="2"}'),
        "full_seconds": sample('sum{generation="2"}'),
        "full_over_5ms": over_5ms("2"),
        "young": sample('count{generation="0"}') + sample('count{generation="1"}'),
        "young_over_5ms": over_5ms("0") + over_5ms("1"),
        # Of the young ones, those serve ran itself on finding the young generation over its bound.
        "young_bounded": samples.get("extproc_gc_young_bounded_total", 0.0),
    }


async def latencies(call: Callable[[], Awaitable[object]], count: int) -> list[float]:
    out = []
    for _ in range(count):
        started = time.perf_counter()
        await call()
        out.append(time.perf_counter() - started)
    return out


async def exchanges(call: Callable[[], Awaitable[Exchange]], count: int) -> dict[str, Any]:
    """``count`` exchanges one after another, as a measure :func:`precise_share` can wrap: each one's
    seconds to its routing answer (``decided``) and of its whole stream."""
    done = [await call() for _ in range(count)]
    return {"decided": [e.decided_s for e in done], "whole_stream": [e.whole_s for e in done]}


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def metric_values(admin_port: int, prefix: str) -> dict[str, float]:
    """Every sample of ``serve``'s /metrics whose line starts with ``prefix``, by its whole name."""
    url = f"http://127.0.0.1:{admin_port}/metrics"
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        text = await resp.text()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(prefix)
    }


async def learned(admin_port: int, limit: float = LEARN_LIMIT_S) -> float:
    """Seconds until serve has nothing left to tokenize (its late prompts run too), at most ``limit``;
    also what a measure of small requests alone waits for.

    The conversations' first turns are cold long prompts: past their budget serve routes them
    approximately and tokenizes them afterwards (from a conversation's second turn on, when its
    opening recurs), which teaches it their prefixes. A live
    conversation's turns come seconds apart (an answer generated, a user typing), time serve has to
    do that; the closed loop sends them back to back, so the measure waits for it once.
    """
    started = time.perf_counter()
    while time.perf_counter() - started < limit:
        if not sum((await metric_values(admin_port, "extproc_tokenize_pending")).values()):
            break
        await asyncio.sleep(0.05)
    return time.perf_counter() - started


#: serve's histograms whose mean per kind the next-turn measure reports: a decision's time from the
#: body's end to the answer, and how long its tokenization held the loop (both in seconds).
SERVE_CLOCKS = ("extproc_decision_duration_seconds", "extproc_tokenize_loop_seconds")


async def serve_totals(admin_port: int) -> dict[str, tuple[float, float]]:
    """Each of :data:`SERVE_CLOCKS`: its sum and count so far."""
    values = await metric_values(admin_port, "extproc_")
    return {name: (values.get(f"{name}_sum", 0.0), values.get(f"{name}_count", 0.0)) for name in SERVE_CLOCKS}


async def with_loop_lag(admin_port: int, measure: Awaitable[dict[str, Any]]) -> dict[str, Any]:
    """Run ``measure`` and add serve's loop lag during it (``loop_lag``; see :func:`lag_summary`)."""
    before = await loop_lag(admin_port)
    result = await measure
    result["loop_lag"] = lag_summary(before, await loop_lag(admin_port))
    return result


async def precise_share(admin_port: int, measure: Awaitable[dict[str, Any]]) -> dict[str, Any]:
    """Run ``measure`` and add the share of its requests matched precisely (tokenized in time)."""
    before = await metric_values(admin_port, "extproc_prefix_lookups_total")
    result = await measure
    after = await metric_values(admin_port, "extproc_prefix_lookups_total")
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    total = sum(delta.values())
    result["precise_share"] = (
        delta.get('extproc_prefix_lookups_total{mode="precise"}', 0.0) / total if total else 0.0
    )
    return result


#: Envoy-sized messages both ways (the bodies here reach ~140 kB).
CHANNEL_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


def _send_bodies(target: str, bodies: list[bytes], ready: Any, stop: Any, sent: Any, refused: bool) -> None:
    """A child process: send ``bodies`` one stream after another until ``stop``, counting in ``sent``
    (``refused``: serve is expected to refuse them, and an answer that is not a route counts too)."""

    async def run() -> None:
        async with grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS) as channel:
            stub = ep_grpc.ExternalProcessorStub(channel)  # type: ignore[no-untyped-call]
            ready.set()
            for body in bodies:
                if stop.is_set():
                    return
                try:
                    await one_stream(stub, request_messages(body))
                except StreamError:
                    if not refused:
                        raise
                sent.value += 1

    asyncio.run(run())


class LongPromptClient:
    """Another client, in a process of its own, streaming ``bodies`` to serve while in use."""

    def __init__(self, target: str, bodies: list[bytes], refused: bool = False) -> None:
        context = multiprocessing.get_context("spawn")  # no fork of a process running gRPC
        self._ready, self._stop = context.Event(), context.Event()
        self._sent = context.Value("i", 0)
        self._process = context.Process(
            target=_send_bodies,
            args=(target, bodies, self._ready, self._stop, self._sent, refused),
            daemon=True,
        )

    @property
    def sent(self) -> int:
        return int(self._sent.value)

    @property
    def pid(self) -> int | None:
        """The client process's, once started."""
        return self._process.pid

    async def __aenter__(self) -> LongPromptClient:
        self._process.start()
        if not await asyncio.to_thread(self._ready.wait, 60):
            self._process.kill()
            raise RuntimeError("the long-prompt client did not start within 60 s")
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        await asyncio.to_thread(self._process.join, 60)
        if self._process.is_alive():
            self._process.kill()


class Profiler:
    """A sampling profiler on serve around a measure, when asked, writing DIR/<variant>-<measure>:

    - ``py-spy`` (``--profile DIR``): serve's Python stacks by thread, collapsed, in ``.txt``
      (``py-spy`` must be on PATH; ``pip install py-spy``);
    - ``perf``: ``perf record`` of serve's event-loop thread with native frames (gRPC, uvloop, the
      interpreter), in ``.data``; read with ``perf report -i FILE --sort dso,sym``.

    Neither stops serve to sample (py-spy's native mode would, and slowed serve ~50 times)."""

    def __init__(self, out_dir: Path | None, variant: str, pid: int, tool: str = "py-spy") -> None:
        self.out_dir, self.variant, self.pid, self.tool = out_dir, variant, pid, tool

    def _command(self, out: Path) -> list[str]:
        if self.tool == "perf":
            return [
                "perf",
                "record",
                "-F",
                "999",
                "-g",
                "-t",
                str(self.pid),
                "-o",
                str(out.with_suffix(".data")),
            ]
        return [
            *("py-spy", "record", "--pid", str(self.pid), "--format", "raw", "--rate", "200"),
            *("--nonblocking", "--threads", "--output", str(out.with_suffix(".txt"))),
        ]

    @contextlib.asynccontextmanager
    async def around(self, measure: str) -> AsyncIterator[None]:
        if self.out_dir is None:
            yield
            return
        spy = await asyncio.create_subprocess_exec(
            *self._command(self.out_dir / f"{self.variant}-{measure}"),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        await asyncio.sleep(0.5)  # attached
        try:
            yield
        finally:
            if spy.returncode is None:
                spy.send_signal(signal.SIGINT)
            _, err = await spy.communicate()
            if spy.returncode not in (0, -signal.SIGINT):
                raise RuntimeError(
                    f"{self.tool} failed ({spy.returncode}): {err.decode(errors='replace')[-500:]}"
                )


async def measure_variant(
    target: str,
    admin_port: int,
    texts: Texts,
    seconds: float,
    backend: tokenizers.Tokenizer,
    profiler: Profiler,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS) as channel:
        stub = ep_grpc.ExternalProcessorStub(channel)  # type: ignore[no-untyped-call]

        async def send(body: bytes) -> str:
            return await one_stream(stub, request_messages(body))

        async def send_timed(body: bytes) -> Exchange:
            return await exchange(stub, request_messages(body))

        small = chat_body(MODEL)
        # Small before and after each conversation measure: each ratio takes the mean of the two
        # around it, so a slow or fast moment of a shared machine does not swing it alone.
        # Its loop lag is the control: no tokenizing at all, only the machine and gRPC.
        small_runs = [
            await with_loop_lag(
                admin_port, closed_loop(lambda: send(small), concurrency=STREAMS, duration=seconds)
            )
        ]
        for name, tokens in (("conversations_8k", 8_000), ("conversations_32k", 32_000)):
            count = STREAMS * CONVERSATIONS_PER_STREAM
            turns = Turns(send, [Conversation(texts, tokens) for _ in range(count)])
            await turns.warm(STREAMS)
            learned_s = await learned(admin_port)
            history = turns.history_tokens()
            async with profiler.around(name):
                measured = closed_loop(turns.next, concurrency=STREAMS, duration=seconds, warmup=0.5)
                out[name] = await with_loop_lag(admin_port, precise_share(admin_port, measured))
            out[name]["history_tokens"] = [round(history), round(turns.history_tokens())]
            out[name]["learned_s"] = learned_s
            small_runs.append(await closed_loop(lambda: send(small), concurrency=STREAMS, duration=seconds))
            out[name]["small_per_s"] = statistics.fmean(r["per_s"] for r in small_runs[-2:])
        out["small"] = {
            "per_s": statistics.fmean(r["per_s"] for r in small_runs),
            "runs_per_s": [r["per_s"] for r in small_runs],
            "errors": sum(r["errors"] for r in small_runs),
            "loop_lag": small_runs[0]["loop_lag"],
        }

        cold = [cold_body(texts, 8_000) for _ in range(4000)]
        bodies = iter(cold)
        out["cold_8k"] = await with_loop_lag(
            admin_port,
            precise_share(
                admin_port, closed_loop(lambda: send(next(bodies)), concurrency=STREAMS, duration=seconds)
            ),
        )
        used = [orjson.loads(b)["messages"][0]["content"] for b in cold[: out["cold_8k"]["completed"] or 1]]
        # Warm, as serve's tokenizer is by now: the library keeps a cache of words it has split.
        backend.encode_batch([orjson.loads(b)["messages"][0]["content"] for b in cold[-64:]])
        started = time.perf_counter()
        encoded = backend.encode_batch(used, add_special_tokens=False)
        library_s = time.perf_counter() - started
        tokens_per_prompt = statistics.fmean(len(e.ids) for e in encoded)
        out["cold_8k"]["tokens_per_prompt"] = tokens_per_prompt
        # Only prompts tokenized in time count: a fallback was routed without its tokens.
        cold = out["cold_8k"]
        cold["serve_tokens_per_s"] = cold["per_s"] * cold["precise_share"] * tokens_per_prompt
        out["cold_8k"]["library_tokens_per_s"] = sum(len(e.ids) for e in encoded) / library_s

        await learned(admin_port)  # the cold prompts' late ones
        alone = await latencies(lambda: send(small), STALL_SAMPLES)
        # The long prompts come from another client, a process of its own: sending and reading
        # back a ~140 kB body on this client's loop would delay the small requests here (the
        # client, not serve, stalling). Made before the measure, too (~10 ms a body).
        long_bodies = [cold_body(texts, 32_000) for _ in range(LONG_BODIES)]
        async with profiler.around("stall"), LongPromptClient(target, long_bodies) as long_client:
            lag_before = await loop_lag(admin_port)
            await asyncio.sleep(0.5)
            beside = await latencies(lambda: send(small), STALL_SAMPLES)
            stall_lag = lag_summary(lag_before, await loop_lag(admin_port))
        out["stall_one_stream"] = {
            "loop_lag": stall_lag,
            "p99_alone_ms": p(alone, 0.99) * 1e3,
            "p99_beside_32k_ms": p(beside, 0.99) * 1e3,
            "long_prompts_sent": long_client.sent,
            # Ran out of prepared bodies before the small requests were done: the tail was alone.
            "valid": long_client.sent < len(long_bodies),
        }
        # The setup: the small requests from the load client at 16 streams (its "today"
        # figure, 30 -> 269 ms, is a 16-stream p99), the 32k prompts from the other client. Alone
        # and beside alternate STALL_ROUNDS times and each side's latencies are pooled, so that a
        # hiccup of the shared machine (a p99 alone swung 32-121 ms between runs) weighs on both.
        alone_16: list[float] = []
        beside_16: list[float] = []
        rounds: list[dict[str, Any]] = []
        lags: list[tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]] = []
        long_sent = 0
        for _ in range(STALL_ROUNDS):
            # Alone means alone: the last round's long prompts that fell back are still being
            # tokenized (late), and would slow the small requests measured alone.
            await learned(admin_port)
            alone_run = await closed_loop(
                lambda: send(small), concurrency=STREAMS, duration=seconds, samples=alone_16
            )
            long_bodies = [cold_body(texts, 32_000) for _ in range(LONG_BODIES)]
            async with LongPromptClient(target, long_bodies) as long_client:
                await asyncio.sleep(0.5)
                lag_before = await loop_lag(admin_port)
                beside_run = await closed_loop(
                    lambda: send(small), concurrency=STREAMS, duration=seconds, samples=beside_16
                )
                lags.append((lag_before, await loop_lag(admin_port)))
            long_sent += long_client.sent
            rounds.append({"alone": alone_run, "beside": beside_run, "long_sent": long_client.sent})
        out["stall"] = {
            "loop_lag": lag_summary(added(b for b, _ in lags), added(a for _, a in lags)),
            "p99_alone_ms": p(alone_16, 0.99) * 1e3,
            "p99_beside_32k_ms": p(beside_16, 0.99) * 1e3,
            "rounds_p99_alone_beside_ms": [
                [r["alone"]["latency"]["p99_ms"], r["beside"]["latency"]["p99_ms"]] for r in rounds
            ],
            "small_per_s_alone_beside": [
                statistics.fmean(r["alone"]["per_s"] for r in rounds),
                statistics.fmean(r["beside"]["per_s"] for r in rounds),
            ],
            "errors": sum(r["alone"]["errors"] + r["beside"]["errors"] for r in rounds),
            "long_prompts_sent": long_sent,
            "valid": all(r["long_sent"] < LONG_BODIES for r in rounds),
        }

        _, bodies_of = next_turn_bodies(texts, warm=0)
        await learned(admin_port)  # the 32k prompts' late ones: one stream means a quiet serve
        # Next turns, cold prompts and small ones in alternating blocks, each kind's latencies
        # pooled: the machine's speed drifts by 20% within seconds here, and one block of each in
        # turn would put that drift in the ratio.
        kinds: dict[str, Callable[[], Awaitable[Exchange]]] = {
            kind: _later(send_timed, body_of) for kind, body_of in bodies_of.items()
        }
        # Per kind, seconds to the routing answer and of the whole stream.
        pooled: dict[str, list[float]] = {kind: [] for kind in kinds}
        pooled_whole: dict[str, list[float]] = {kind: [] for kind in kinds}
        shares: dict[str, list[float]] = {kind: [] for kind in kinds}
        # Per kind and clock: seconds and observations added while that kind was sent.
        serve_s = {kind: {name: [0.0, 0.0] for name in SERVE_CLOCKS} for kind in kinds}
        block = NEXT_TURN_SAMPLES // NEXT_TURN_ROUNDS
        async with profiler.around("next_turn"):
            for _ in range(NEXT_TURN_ROUNDS):
                for kind, call in kinds.items():
                    before = await serve_totals(admin_port)
                    timings = await precise_share(admin_port, exchanges(call, block))
                    after = await serve_totals(admin_port)
                    pooled[kind] += timings["decided"]
                    pooled_whole[kind] += timings["whole_stream"]
                    shares[kind].append(timings["precise_share"])
                    for name, totals in serve_s[kind].items():
                        totals[0] += after[name][0] - before[name][0]
                        totals[1] += after[name][1] - before[name][1]

        def mean_ms(name: str) -> dict[str, float]:
            return {
                k: s / n * 1e3 if n else float("nan")
                for k, (s, n) in ((k, v[name]) for k, v in serve_s.items())
            }

        out["next_turn"] = {
            # To the routing answer: what the request waits for its route.
            "p50_next_turn_ms": p(pooled["next_turn"], 0.5) * 1e3,
            "p50_cold_ms": p(pooled["cold"], 0.5) * 1e3,
            # The floor under both: a round trip with nothing to tokenize (the client's and gRPC's
            # costs, which a next turn pays as much as a cold prompt).
            "p50_small_ms": p(pooled["small"], 0.5) * 1e3,
            # The whole stream (what this measure timed before it timed the routing answer): the
            # same, plus the body echoed back, the response-headers exchange and the close, which
            # every kind pays alike.
            "whole_stream_p50_ms": {kind: p(values, 0.5) * 1e3 for kind, values in pooled_whole.items()},
            # A cold prompt routed without its tokens costs less than one tokenized: the ratio
            # means what it says only when both shares are 1.
            "precise_share_next_turn_cold": [statistics.fmean(shares[k]) for k in ("next_turn", "cold")],
            # serve's own time from a body's end to its answer (extproc_decision_duration_seconds),
            # mean ms: the cost without the load client's and gRPC's round trip.
            "serve_mean_ms": mean_ms("extproc_decision_duration_seconds"),
            # Of that, how long tokenizing held serve's loop (extproc_tokenize_loop_seconds), mean ms.
            "serve_tokenize_hold_mean_ms": mean_ms("extproc_tokenize_loop_seconds"),
        }
    return out


def next_turn_bodies(texts: Texts, *, warm: int) -> tuple[list[bytes], dict[str, Callable[[], bytes]]]:
    """The next-turn measure's bodies, all made before it: ``warm`` turns of one ~8k history, then,
    per kind, what gives its next body (a next turn of that history, a cold ~8k prompt, the 64-byte
    chat)."""
    conversation = Conversation(texts, 8_000)
    warm_bodies = [conversation.body() for _ in range(warm)]
    turns = iter([conversation.body() for _ in range(NEXT_TURN_SAMPLES)])
    colds = iter([cold_body(texts, 8_000) for _ in range(NEXT_TURN_SAMPLES)])
    small = chat_body(MODEL)
    bodies_of: dict[str, Callable[[], bytes]] = {
        "next_turn": lambda: next(turns),
        "cold": lambda: next(colds),
        "small": lambda: small,
    }
    return warm_bodies, bodies_of


async def next_turn_through_envoy(gateway: TimedGateway, texts: Texts, admin_port: int) -> dict[str, Any]:
    """The next-turn measure again, through real Envoy and timed by it (``bench/envoy_timing.py``):
    p50 of its ext_proc call for the request headers, which in FULL_DUPLEX_STREAMED is the routing
    decision as the request pays for it, with Envoy (C++) as serve's client instead of the Python
    load client. The same three kinds in the same alternating blocks, one request at a time."""
    warm, kinds = next_turn_bodies(texts, warm=WARM_TURNS)
    block = NEXT_TURN_SAMPLES // NEXT_TURN_ROUNDS

    async def measure() -> dict[str, Any]:
        async with gateway:
            for body in warm:  # the history, tokenized once (as the gRPC measure's first turn)
                await gateway.post("warm", body)
            await learned(admin_port)
            for _ in range(NEXT_TURN_ROUNDS):
                for kind, body_of in kinds.items():
                    for _ in range(block):
                        await gateway.post(kind, body_of())
        return {}

    out = await precise_share(admin_port, measure())
    decisions: dict[str, list[float]] = {kind: [] for kind in kinds}
    for timing in gateway.timings():
        if timing.kind in decisions:
            decisions[timing.kind].append(timing.decision_us / 1e3)
    for kind, values in decisions.items():
        out[f"p50_{kind}_ms"] = p(values, 0.5) if values else float("nan")
        out[f"p50_{kind}_round_trip_ms"] = p(gateway.round_trips[kind], 0.5) * 1e3
    out["logged"] = {kind: len(values) for kind, values in decisions.items()}
    return out


def ratios(r: dict[str, Any]) -> dict[str, float]:
    return {
        "conversations_8k": r["conversations_8k"]["per_s"] / r["conversations_8k"]["small_per_s"],
        "conversations_32k": r["conversations_32k"]["per_s"] / r["conversations_32k"]["small_per_s"],
        "cold_tokens": r["cold_8k"]["serve_tokens_per_s"] / r["cold_8k"]["library_tokens_per_s"],
        "stall": r["stall"]["p99_beside_32k_ms"] / r["stall"]["p99_alone_ms"],
        "stall_one_stream": r["stall_one_stream"]["p99_beside_32k_ms"]
        / r["stall_one_stream"]["p99_alone_ms"],
        "next_turn": r["next_turn"]["p50_next_turn_ms"] / r["next_turn"]["p50_cold_ms"],
        "next_turn_whole_stream": r["next_turn"]["whole_stream_p50_ms"]["next_turn"]
        / r["next_turn"]["whole_stream_p50_ms"]["cold"],
        "next_turn_envoy": r["next_turn_envoy"]["p50_next_turn_ms"] / r["next_turn_envoy"]["p50_cold_ms"],
    }


async def run(
    seconds: float, variants: list[str], profile: Path | None, serve_args: tuple[str, ...] = ()
) -> dict[str, Any]:
    backend = tokenizers.Tokenizer.from_file(str(ensure("llama3") / "tokenizer.json"))
    texts = Texts(backend, seed=13)
    results: dict[str, Any] = {"machine": machine(), "seconds": seconds, "variants": {}}
    if serve_args:
        results["serve_args"] = list(serve_args)
    with tempfile.TemporaryDirectory(prefix="extproc-long-") as tmp:
        endpoints = write_catalog(Path(tmp))
        for variant in variants:
            serve = await start_serve(Path(tmp), variant, serve_args)
            admin_port = serve.admin_port
            try:
                before = await loop_lag(admin_port)
                assert serve.proc is not None
                measured = await measure_variant(
                    f"127.0.0.1:{serve.grpc_port}",
                    admin_port,
                    texts,
                    seconds,
                    backend,
                    Profiler(profile, variant, serve.proc.pid),
                )
                measured["next_turn_envoy"] = await next_turn_through_envoy(
                    TimedGateway(Path(tmp), serve.grpc_port, endpoints, free_port(), free_port()),
                    texts,
                    admin_port,
                )
                measured["fallbacks"] = await metric_values(admin_port, "extproc_tokenize_fallbacks_total")
                measured["loop_lag"] = lag_summary(before, await loop_lag(admin_port))
                measured["gc"] = gc_summary(await metric_values(admin_port, "extproc_gc_"))
            finally:
                await serve.stop()
            measured["ratios"] = ratios(measured)
            results["variants"][variant] = measured
            print(variant, json.dumps(measured["ratios"]), file=sys.stderr)
    return results


def write_catalog(tmp: Path) -> list[str]:
    """The catalog every variant's serve reads (``tmp/catalog.yaml``): 8 endpoints that declare KV
    events, on free loopback ports; returns their ``host:port``."""
    endpoints = [f"127.0.0.{i}:{free_port()}" for i in range(1, 9)]
    kv_ports = {e: (free_port(), free_port()) for e in endpoints}
    (tmp / "catalog.yaml").write_text(
        catalog_yaml([LocalWorkerSet("bench", MODEL, endpoints, kv_ports=kv_ports)])
    )
    return endpoints


async def start_serve(tmp: Path, variant: str, serve_args: tuple[str, ...] = ()) -> ServeProcess:
    """serve in ``variant`` on ``tmp/catalog.yaml`` (:func:`write_catalog`, made if absent), with the
    real Llama 3 tokenizer; its log (serve-VARIANT.log) in ``tmp``."""
    catalog = tmp / "catalog.yaml"
    if not catalog.exists():
        write_catalog(tmp)
    with open(tmp / f"serve-{variant}.log", "wb") as log:  # noqa: ASYNC230 (local, instant)
        serve = ServeProcess(
            catalog,
            extra_args=("--scrape-interval", "0", *VARIANTS[variant], *serve_args),
            log=log,
            tokenizer=f"{MODEL}={ensure('llama3')}",
        )
        await serve.start()
    return serve


def report(results: dict[str, Any]) -> str:
    m = results["machine"]
    names = list(results["variants"])
    flags = results.get("serve_args")
    lines = [
        "# Long prompts against short ones (real Llama 3 tokenizer)",
        "",
        f"{provenance(m)}. `serve` and the gRPC load client "
        f"share the cores; {results['seconds']:g} s per closed-loop measure, {STREAMS} streams."
        + (f" serve's extra flags: `{' '.join(flags)}`." if flags else ""),
        "",
        "| measure | target | " + " | ".join(names) + " |",
        "|---|--:|" + "--:|" * len(names),
    ]
    labels = {
        "conversations_8k": "8k conversations: decisions/s, share of small",
        "conversations_32k": "32k conversations: decisions/s, share of small",
        "cold_tokens": "cold 8k prompts: tokens/s (tokenized in time), share of encode_batch",
        "stall": "small p99 beside 32k prompts, x alone (16 streams, the issue's setup)",
        "stall_one_stream": "the same, small requests one at a time (stricter; no target)",
        "next_turn": "next turn p50 to the routing answer, share of a cold prompt's",
        "next_turn_whole_stream": "the same for the load client's whole ext_proc stream (no target)",
        "next_turn_envoy": "the same timed by real Envoy (its ext_proc call for the decision; no target)",
    }
    for key, label in labels.items():
        target = (
            ""
            if key not in TARGETS
            else ("≤ " if key in ("stall", "next_turn") else "≥ ") + f"{TARGETS[key]:g}"
        )
        cells = [f"{results['variants'][n]['ratios'][key]:.2f}" for n in names]
        lines.append(f"| {label} | {target} | " + " | ".join(cells) + " |")
    raw: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        (
            "small decisions/s: before 8k / between / after 32k",
            lambda v: " / ".join(f"{x:.0f}" for x in v["small"]["runs_per_s"]),
        ),
        ("8k conversations decisions/s", lambda v: f"{v['conversations_8k']['per_s']:.1f}"),
        ("32k conversations decisions/s", lambda v: f"{v['conversations_32k']['per_s']:.1f}"),
        (
            "conversations' history tokens, mean at the start / end of the measure: 8k; 32k",
            lambda v: "; ".join(
                " / ".join(f"{t / 1e3:.1f}k" for t in v[k].get("history_tokens", ()))
                for k in ("conversations_8k", "conversations_32k")
            ),
        ),
        (
            "s serve took to learn the conversations' first two turns (late prompts): 8k / 32k",
            lambda v: " / ".join(
                f"{v[k].get('learned_s', math.nan):.1f}" for k in ("conversations_8k", "conversations_32k")
            ),
        ),
        (
            "cold 8k: serve / encode_batch tokens/s",
            lambda v: (
                f"{v['cold_8k']['serve_tokens_per_s'] / 1e3:.0f}k / "
                f"{v['cold_8k']['library_tokens_per_s'] / 1e3:.0f}k"
            ),
        ),
        (
            "small p99 alone / beside 32k ms, 16 streams (32k prompts sent meanwhile)",
            lambda v: stall_cell(v["stall"]),
        ),
        (
            "  the same, each round's p99 alone / beside ms",
            lambda v: "; ".join(
                f"{a:.0f} / {b:.0f}" for a, b in v["stall"].get("rounds_p99_alone_beside_ms", ())
            ),
        ),
        (
            "small decisions/s alone / beside 32k, 16 streams",
            lambda v: " / ".join(f"{x:.0f}" for x in v["stall"]["small_per_s_alone_beside"]),
        ),
        (
            "small p99 alone / beside 32k ms, one at a time (32k prompts sent meanwhile)",
            lambda v: stall_cell(v["stall_one_stream"]),
        ),
        (
            "next turn / cold / 64-byte chat p50 ms to the routing answer, one stream (tokenized in "
            "time: next turn / cold)",
            lambda v: (
                f"{v['next_turn']['p50_next_turn_ms']:.2f} / {v['next_turn']['p50_cold_ms']:.2f} / "
                + f"{v['next_turn'].get('p50_small_ms', float('nan')):.2f} ("
                + " / ".join(f"{x:.0%}" for x in v["next_turn"].get("precise_share_next_turn_cold", []))
                + ")"
            ),
        ),
        (
            "  the same requests' whole ext_proc stream p50 ms",
            lambda v: " / ".join(
                f"{v['next_turn'].get('whole_stream_p50_ms', {}).get(k, float('nan')):.2f}"
                for k in ("next_turn", "cold", "small")
            ),
        ),
        (
            "  serve's own mean decision ms (body end to answer): next turn / cold / 64-byte chat",
            lambda v: " / ".join(
                f"{v['next_turn'].get('serve_mean_ms', {}).get(k, float('nan')):.2f}"
                for k in ("next_turn", "cold", "small")
            ),
        ),
        (
            "  of which tokenizing held serve's loop, mean ms: next turn / cold / 64-byte chat",
            lambda v: " / ".join(
                f"{v['next_turn'].get('serve_tokenize_hold_mean_ms', {}).get(k, float('nan')):.2f}"
                for k in ("next_turn", "cold", "small")
            ),
        ),
        (
            "through Envoy, its ext_proc decision call p50 ms: next turn / cold / 64-byte chat "
            "(tokenized in time)",
            lambda v: envoy_cell(v.get("next_turn_envoy"), ""),
        ),
        (
            "  the same requests' HTTP round trip p50 ms (client, Envoy, fake engine)",
            lambda v: envoy_cell(v.get("next_turn_envoy"), "_round_trip"),
        ),
        (
            "loop ticks > 5 ms late (of all), worst bucket",
            lambda v: (
                f"{v['loop_lag']['over_5ms']:.0f} of {v['loop_lag']['ticks']:.0f}, "
                f"≤ {v['loop_lag']['worst_bucket_le']} s"
            ),
        ),
        (
            "loop ticks > 5 ms late: small (control) / 8k conv / 32k conv / cold 8k / beside 32k: one "
            "stream, 16",
            lambda v: " / ".join(
                f"{v[k]['loop_lag']['over_5ms']:.0f}"
                for k in (
                    "small",
                    "conversations_8k",
                    "conversations_32k",
                    "cold_8k",
                    "stall_one_stream",
                    "stall",
                )
            ),
        ),
        (
            "prompts whose tokenization held the loop > 5 ms (of all), longest bucket",
            lambda v: (
                f"{v['loop_lag']['hold_over_5ms']:.0f} of {v['loop_lag']['hold_prompts']:.0f}, "
                f"≤ {v['loop_lag']['hold_worst_bucket_le']} s"
            ),
        ),
        (
            "held > 5 ms of the loop thread's CPU time, longest bucket (inline: the library's own "
            "threads encode, unseen here)",
            lambda v: (
                f"{v['loop_lag']['hold_cpu_over_5ms']:.0f}, ≤ {v['loop_lag']['hold_cpu_worst_bucket_le']} s"
                if "hold_cpu_over_5ms" in v["loop_lag"]
                else "not measured"
            ),
        ),
        (
            "full GC runs (over 5 ms), their total ms",
            lambda v: (
                f"{v['gc']['full']:.0f} ({v['gc']['full_over_5ms']:.0f}), {v['gc']['full_seconds'] * 1e3:.0f}"
            ),
        ),
        (
            "young GC runs, generations 0 and 1 (over 5 ms; run by serve past its bound)",
            lambda v: (
                f"{v['gc']['young']:.0f} ({v['gc']['young_over_5ms']:.0f}; "
                f"{v['gc'].get('young_bounded', 0):.0f} past serve's bound)"
                if "young" in v["gc"]
                else "not measured"
            ),
        ),
        (
            "tokenized in time: 8k conv / 32k conv / cold 8k",
            lambda v: " / ".join(
                f"{v[k]['precise_share']:.0%}" for k in ("conversations_8k", "conversations_32k", "cold_8k")
            ),
        ),
        (
            "errors (all measures)",
            lambda v: str(
                sum(
                    v[k]["errors"]
                    for k in ("small", "conversations_8k", "conversations_32k", "cold_8k", "stall")
                )
            ),
        ),
    ]
    lines += ["", "| raw | " + " | ".join(names) + " |", "|---|" + "--:|" * len(names)]
    for label, cell in raw:
        lines.append(f"| {label} | " + " | ".join(cell(results["variants"][n]) for n in names) + " |")
    unsteady = [n for n in names if unsteady_small(results["variants"][n])]
    if unsteady:
        lines += [
            "",
            f"**UNSTEADY machine** ({', '.join(unsteady)}): the small reference, measured three times, "
            f"varied by more than {MAX_SMALL_SPREAD:.0%} (the 'small decisions/s' row), so the machine's "
            "speed changed during the run and the ratios built on it are unreliable.",
        ]
    return "\n".join(lines) + "\n"


def envoy_cell(measured: dict[str, Any] | None, suffix: str) -> str:
    if measured is None:
        return "not measured"
    cell = " / ".join(f"{measured[f'p50_{k}{suffix}_ms']:.2f}" for k in ("next_turn", "cold", "small"))
    return cell + ("" if suffix else f" ({measured['precise_share']:.0%})")


def stall_cell(stall: dict[str, Any]) -> str:
    return (
        f"{stall['p99_alone_ms']:.1f} / {stall['p99_beside_32k_ms']:.1f} ({stall['long_prompts_sent']}"
        + ("" if stall["valid"] else ", ran out: INVALID")
        + ")"
    )


#: The small reference's runs may differ by this share of their mean; more: the machine was unsteady.
MAX_SMALL_SPREAD = 0.25


def _later(
    send: Callable[[bytes], Awaitable[Exchange]], body_of: Callable[[], bytes]
) -> Callable[[], Awaitable[Exchange]]:
    """A send that builds its body when it runs (each time), not when it is made."""
    return lambda: send(body_of())


def unsteady_small(variant: dict[str, Any]) -> bool:
    runs = variant["small"]["runs_per_s"]
    return bool((max(runs) - min(runs)) > MAX_SMALL_SPREAD * statistics.fmean(runs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each closed-loop measure")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "long_prompts.json")
    parser.add_argument("--variant", action="append", choices=list(VARIANTS), help="only these (all)")
    parser.add_argument(
        "--profile", type=Path, default=None, help="py-spy serve during some measures, into this directory"
    )
    parser.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument to every serve (repeat: --serve-arg=--tokenize-budget-ms --serve-arg=80)",
    )
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    results = asyncio.run(
        run(args.seconds, args.variant or list(VARIANTS), args.profile, tuple(args.serve_arg))
    )
    record(args.out, results, report)


if __name__ == "__main__":
    main()
