"""A soak: `serve` behind real Envoy for an hour at ~100 requests/s, checked for errors and leaks.

Four simulated engines (KV events, precise prefix routing), `serve` and Envoy (the shipped
``gateway.yaml``) run as child processes; this process is the client. It sends requests on a fixed
schedule (open loop, ``--rate`` per second): half short chats, half ~4k-token prompts drawn from a
few long documents (so prefixes repeat, as in RAG), half of them streaming; 10% of the clients
walk away mid-answer (a streaming one after its first chunk, a plain one after a few ms).

Every ``--sample`` seconds it records `serve`'s RSS (from /proc), its in-flight count (its
/metrics), and the client's own lag (how late each request left against its schedule). At the end
it stops sending, lets the last answers finish, and reads the in-flight count once more.

Halfway through the warm-up it stops every engine for 2 s (SIGSTOP): up to ~200 requests pile up
in flight, as in a long hiccup of a shared machine. Such a burst leaves `serve`'s RSS 1.5-2 MB
higher for good: the allocators (pymalloc's 1 MiB arenas, glibc's heap) keep pages that the
burst's short-lived objects were freed from, because a few long-lived objects share them. A second
burst no larger adds little (0.2 MB), a larger one more (docs/investigations/soak_bursts.md): a
high-water mark, not a leak. So the warm-up takes RSS to that mark before the slope is measured,
and a hiccup of the machine later in the run (40-70 in flight, seen) does not pass for a leak;
growth past the mark is measured.

Pass: 0 errors (any status but 200, or a failed connection, on a request the client did not
abandon), RSS growth after the warm-up within 5 MB/h (least-squares slope over the samples), and
in-flight back to 0. The run is *invalid* (the machine could not keep up, so it proves nothing) when
the achieved rate falls under 95% of the target, the client's p99 lag exceeds 100 ms, or the engines
fell behind: the median in-flight count of the last third after the warm-up is over twice the
first third's (plus 20), so requests queue up in serve and RSS grows with the queue. It is invalid
too when the machine was shared after the warm-up: in a sample, the hypervisor (/proc/stat's
steal) and processes other than this one and its children (the machine's busy time less theirs)
took over 0.3 cores together. Each sample records both.

Writes ``bench/results/soak.{json,md}`` (``--out`` to write elsewhere).

    python bench/soak.py                  # one hour
    python bench/soak.py --duration 120   # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from machine import (
    machine,
    machine_busy_seconds,
    machine_stolen_seconds,
    provenance,
    record,
    tree_cpu_seconds,
)
from stack import (
    MODEL,
    ServeProcess,
    SimEngine,
    engines_started,
    gateway,
    is_accounting_filter,
    keep_http_filters,
    write_catalog,
)

from extproc.gateway.process import EnvoyProcess

HERE = Path(__file__).resolve().parent
ENGINES = 4
#: Each engine's KV cache (blocks of 16 tokens; the simulator's default is 24,000). Small enough that
#: the caches fill, and evict, within the warm-up: the soak then measures the steady state, where
#: every block stored is matched by one removed, and memory that follows the index must stay flat.
#: The engines also remember prompt pieces and hash blocks with xxhash: the same ids and events, at
#: half their CPU (tokenizing every prompt whole took two thirds of it), so that on 2 cores
#: the engines keep up for the whole hour and serve's memory is measured on a machine not saturated.
ENGINE_ARGS = (
    "--default-output-tokens",
    "16",
    "--num-gpu-blocks-override",
    "4000",
    "--tokenize-cache-mb",
    "16",
    "--prefix-caching-hash-algo",
    "xxhash",
)
ABANDON_SHARE = 0.10
LONG_SHARE = 0.5
STREAM_SHARE = 0.5
#: ~4k tokens of the simulator's tokenizer (about 4 characters a token).
LONG_CHARS = 16_000
DOCUMENTS = 8
#: Lag and rate limits past which the run proves nothing.
MAX_P99_LAG_S = 0.1
#: In flight in the last third after the warm-up above this many times the first third's, plus
#: BACKLOG_SLACK: the engines fell behind and requests queue up, so the run proves nothing.
MAX_BACKLOG_GROWTH = 2.0
BACKLOG_SLACK = 20
MIN_RATE_SHARE = 0.95
MAX_RSS_SLOPE_MB_PER_H = 5.0
#: Cores (of the machine's) that the hypervisor and this VM's other processes may take in one
#: sample after the warm-up: past it, the run shared the machine and proves nothing. A burst of
#: one core for a few seconds (a type checker run beside it) put 40 requests in flight and had
#: Envoy reset 1,000 accounting streams; the hypervisor alone took 0.05 cores on average.
MAX_TAKEN_CORES = 0.3


@dataclass(slots=True)
class Tally:
    sent: int = 0
    ok: int = 0
    abandoned: int = 0
    errors: int = 0
    #: The first few errors, as "status: text", for the report.
    examples: list[str] = field(default_factory=list)
    lags: list[float] = field(default_factory=list)

    def error(self, what: str) -> None:
        self.errors += 1
        if len(self.examples) < 5:
            self.examples.append(what[:200])
            print(f"error at request {self.sent}: {what[:300]}", file=sys.stderr)


def documents(seed: int) -> list[str]:
    rng = random.Random(seed)
    words = ("cache", "token", "engine", "router", "block", "prefix", "queue", "model", "gateway", "batch")
    return [
        f"Document {d}. "
        + " ".join(rng.choice(words) + str(rng.randrange(100)) for _ in range(LONG_CHARS // 8))
        for d in range(DOCUMENTS)
    ]


def request_body(rng: random.Random, docs: list[str], number: int) -> dict[str, Any]:
    question = f"Question {number}: what does item {rng.randrange(10_000)} say?"
    if rng.random() < LONG_SHARE:
        messages = [
            {"role": "system", "content": rng.choice(docs)},
            {"role": "user", "content": question},
        ]
    else:
        messages = [{"role": "user", "content": question}]
    return {"model": MODEL, "messages": messages, "max_tokens": 16, "stream": rng.random() < STREAM_SHARE}


async def one_request(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], abandon: bool, tally: Tally
) -> None:
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                tally.error(f"{resp.status}: {(await resp.text())[:150]}")
                return
            if abandon:
                if body["stream"]:
                    await resp.content.readline()  # the first chunk, then walk away
                else:
                    await asyncio.sleep(0.005)
                resp.close()
                tally.abandoned += 1
                return
            payload = await resp.read()
            if body["stream"] and b"[DONE]" not in payload:
                tally.error("200: stream ended without [DONE]")
                return
            tally.ok += 1
    except (aiohttp.ClientError, TimeoutError) as exc:
        tally.error(f"{type(exc).__name__}: {exc}")


async def load(url: str, rate: float, duration: float, tally: Tally, seed: int) -> float:
    """Send on a fixed schedule for ``duration`` seconds; returns when the last answer is in."""
    rng = random.Random(seed)
    docs = documents(seed)
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        start = loop.time()
        number = 0
        while (due := start + number / rate) < start + duration:
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tally.lags.append(max(0.0, loop.time() - due))
            body = request_body(rng, docs, number)
            task = loop.create_task(one_request(session, url, body, rng.random() < ABANDON_SHARE, tally))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            tally.sent += 1
            number += 1
        sent_for = loop.time() - start
        await asyncio.gather(*tasks)
    return sent_for


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def serve_metric(session: aiohttp.ClientSession, serve: ServeProcess, prefix: str) -> float:
    """The sum of `serve`'s /metrics samples whose line starts with ``prefix``."""
    async with session.get(f"{serve.admin_url}/metrics") as resp:
        text = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


async def in_flight(session: aiohttp.ClientSession, serve: ServeProcess) -> float:
    return await serve_metric(session, serve, "extproc_inflight_requests{")


async def cache_mb(session: aiohttp.ClientSession, serve: ServeProcess) -> float:
    """What `serve`'s prompt-piece caches hold (bounded by --tokenize-cache-mb; they fill during a run)."""
    return round(await serve_metric(session, serve, "extproc_tokenize_cache_bytes{") / 2**20, 2)


async def ended_streams(session: aiohttp.ClientSession, serve: ServeProcess, how: str) -> float:
    """ext_proc streams `serve` saw end ``how`` ("closed", or "cancelled": reset by Envoy)."""
    return await serve_metric(session, serve, f'extproc_streams_ended_total{{how="{how}"')


def taken_cell(r: dict[str, Any], by: str) -> str:
    """The run's mean cores taken ``by`` ("stolen" or "others"), and its worst sample."""
    if f"machine_{by}_cores" not in r:
        return "not measured"
    worst = max(r["samples"], key=lambda sample: sample.get(f"{by}_cores", 0.0))
    return f"{r[f'machine_{by}_cores']:g} ({worst.get(f'{by}_cores', 0.0):g}, {worst['at_s']:g})"


def taken_cores(sample: dict[str, Any]) -> float:
    """The cores the hypervisor and other processes took together in a sample (a run recorded
    before the others were measured: the hypervisor's alone)."""
    return float(sample.get("stolen_cores", 0.0) + sample.get("others_cores", 0.0))


def shared_samples(samples: list[dict[str, Any]], since: float) -> list[dict[str, Any]]:
    """Samples from ``since`` on in which others took more than MAX_TAKEN_CORES."""
    return [s for s in samples if s["at_s"] >= since and taken_cores(s) > MAX_TAKEN_CORES]


class Cores:
    """Cores used by something, between two calls and since this was made, from a counter of
    CPU-seconds: when a run falls behind, these say whether the machine did."""

    def __init__(self, seconds: Callable[[], float]) -> None:
        self._read = seconds
        self._seconds, self._at = seconds(), time.monotonic()
        self._first_seconds, self._first_at = self._seconds, self._at

    def since_last(self) -> float:
        seconds, at = self._read(), time.monotonic()
        cores = (seconds - self._seconds) / max(at - self._at, 1e-9)
        self._seconds, self._at = seconds, at
        return round(max(cores, 0.0), 3)

    def since_start(self) -> float:
        seconds, at = self._read(), time.monotonic()
        return round(max((seconds - self._first_seconds) / max(at - self._first_at, 1e-9), 0.0), 3)


def stolen() -> Cores:
    """The cores the hypervisor took from this VM (see machine_stolen_seconds)."""
    return Cores(machine_stolen_seconds)


def others() -> Cores:
    """The cores this VM's processes used outside this run: this process and what it started
    (serve, Envoy, the engines) are the run, anything else is another load sharing the cores."""
    me = os.getpid()
    return Cores(lambda: machine_busy_seconds() - tree_cpu_seconds(me))


def slope_per_hour(samples: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MB) in MB per hour."""
    if len(samples) < 3:
        return None
    xs, ys = [s for s, _ in samples], [mb for _, mb in samples]
    return statistics.linear_regression(xs, ys).slope * 3600


@dataclass(frozen=True, slots=True)
class Serving:
    """How the soak runs serve: extra flags, and optionally under the memory tracer."""

    extra_args: tuple[str, ...] = ()
    memtrace: Path | None = None
    #: Where serve's log goes (warnings and errors); nowhere by default.
    log: Path | None = None
    #: Run serve under ``memray run --native`` writing this capture (memray installed by hand).
    memray: Path | None = None
    #: Drop Envoy's accounting filter (the ext_proc filter in observability mode): one stream per
    #: request instead of two, to tell the two streams' costs apart.
    no_accounting: bool = False
    #: Seconds into the load at which every engine is stopped (SIGSTOP) for ``pause_s``: requests
    #: pile up in flight, as in a machine hiccup (see the module's docstring).
    pause_at: tuple[float, ...] = ()
    pause_s: float = 2.0


async def soak(
    rate: float, duration: float, sample: float, warmup: float, seed: int, serving: Serving
) -> dict[str, Any]:
    tally = Tally()
    samples: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="extproc-soak-") as tmp:
        async with engines_started(ENGINES, ENGINE_ARGS) as engines:
            log = serving.log.open("wb") if serving.log is not None else None
            serve = ServeProcess(write_catalog(Path(tmp) / "catalog.yaml", engines), serving.extra_args, log)
            if serving.memtrace is not None:
                serving.memtrace.mkdir(parents=True, exist_ok=True)
                os.environ["EXTPROC_MEMTRACE_DIR"] = str(serving.memtrace)
                serve.launcher = (str(HERE / "memtrace.py"),)
            elif serving.memray is not None:
                serve.launcher = (
                    "-m",
                    "memray",
                    "run",
                    "--native",
                    "--aggregate",  # a capture of GBs otherwise; leaks and peaks are still there
                    "--force",
                    "-o",
                    str(serving.memray),
                    "-m",
                    "extproc",
                )
            await serve.start()
            try:
                config, listen, _ = gateway("gateway.yaml", serve, engines)
                if serving.no_accounting:
                    keep_http_filters(config, lambda f: not is_accounting_filter(f))
                async with EnvoyProcess(config) as _, aiohttp.ClientSession() as probe:
                    assert serve.proc is not None
                    pid = serve.proc.pid
                    url = f"http://127.0.0.1:{listen}/v1/chat/completions"
                    busy0, wall0 = machine_busy_seconds(), time.monotonic()
                    taken = {"stolen_cores": stolen(), "others_cores": others()}
                    sender = asyncio.create_task(load(url, rate, duration, tally, seed))
                    pauser = asyncio.create_task(pause_engines(engines, serving.pause_at, serving.pause_s))
                    while not sender.done():
                        samples.append(
                            {
                                "at_s": round(time.monotonic() - wall0, 1),
                                "rss_mb": round(rss_mb(pid), 2),
                                "in_flight": await in_flight(probe, serve),
                                "tokenize_cache_mb": await cache_mb(probe, serve),
                                # Resets cost ~100 B each in grpc.aio when they cancel a receive
                                # (grpc/grpc#43360; serve's Receiver avoids it): the timeline shows
                                # whether RSS still follows them.
                                "streams_reset": await ended_streams(probe, serve, "cancelled"),
                                "sent": tally.sent,
                                "errors": tally.errors,
                                **{name: cores.since_last() for name, cores in taken.items()},
                            }
                        )
                        print(json.dumps(samples[-1]), file=sys.stderr)
                        await asyncio.wait([sender], timeout=sample)
                    sent_for = await sender
                    await pauser
                    busy = (machine_busy_seconds() - busy0) / (time.monotonic() - wall0)
                    taken_mean = {name: cores.since_start() for name, cores in taken.items()}
                    await asyncio.sleep(1.0)  # the accounting streams' last closes
                    final_in_flight = await in_flight(probe, serve)
                    streams_ended = {
                        how: await ended_streams(probe, serve, how) for how in ("closed", "cancelled")
                    }
                    final_rss = rss_mb(pid)
            finally:
                await serve.stop()
    lags = sorted(tally.lags)
    p99_lag = lags[int(0.99 * (len(lags) - 1))] if lags else 0.0
    achieved = tally.sent / sent_for if sent_for else 0.0
    invalid = []
    if achieved < MIN_RATE_SHARE * rate:
        invalid.append(f"achieved {achieved:.1f} req/s of {rate:g}")
    if p99_lag > MAX_P99_LAG_S:
        invalid.append(f"client p99 lag {p99_lag * 1000:.0f} ms")
    result = {
        "rate": rate,
        "duration_s": duration,
        "achieved_rate": round(achieved, 1),
        "client_p99_lag_ms": round(p99_lag * 1000, 1),
        "machine_busy_cores": round(busy, 2),
        "machine_stolen_cores": taken_mean["stolen_cores"],
        "machine_others_cores": taken_mean["others_cores"],
        "tally": {k: v for k, v in asdict(tally).items() if k != "lags"},
        "rss_start_mb": samples[0]["rss_mb"] if samples else None,
        "rss_end_mb": round(final_rss, 2),
        "in_flight_at_end": final_in_flight,
        "streams_ended": streams_ended,
        "invalid": invalid,
        "serve_args": list(serving.extra_args),
        "accounting_filter": not serving.no_accounting,
        "memtrace": serving.memtrace is not None,
        "engines_paused_at_s": list(serving.pause_at),
        "engines_paused_for_s": serving.pause_s if serving.pause_at else 0,
        "samples": samples,
    }
    return judge(result, warmup)


async def pause_engines(engines: list[SimEngine], at: tuple[float, ...], pause_s: float) -> None:
    """Stop every engine at each of ``at`` (seconds from now) for ``pause_s``, then let them go on."""
    started = time.monotonic()
    for when in sorted(at):
        await asyncio.sleep(max(0.0, started + when - time.monotonic()))
        print(f"pausing the engines for {pause_s:g} s at {when:g} s", file=sys.stderr)
        for engine in engines:
            engine.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(pause_s)
        finally:
            for engine in engines:
                engine.send_signal(signal.SIGCONT)


def pause_times(asked: list[float] | None, pause_s: float, warmup: float) -> tuple[float, ...]:
    """When to stop the engines: as asked, else once halfway through the warm-up; never with no
    pause length."""
    if pause_s <= 0:
        return ()
    return tuple(asked) if asked is not None else (warmup / 2,)


def caches_full_at(samples: list[dict[str, Any]]) -> float:
    """When serve's prompt-piece cache reached its bound: the first sample holding 95% of the most it
    ever held (0 without one). Filling a bounded cache is warm-up; growth after that is not."""
    held = [(s["at_s"], s.get("tokenize_cache_mb") or 0.0) for s in samples]
    most = max((mb for _, mb in held), default=0.0)
    return next((at for at, mb in held if most and mb >= 0.95 * most), 0.0)


def backlog_growth(in_flight: list[float]) -> tuple[float, float] | None:
    """The median in-flight count over the first and over the last third of ``in_flight``."""
    third = len(in_flight) // 3
    if third < 3:
        return None
    return statistics.median(in_flight[:third]), statistics.median(in_flight[-third:])


def judge(result: dict[str, Any], warmup: float) -> dict[str, Any]:
    """Add the RSS slope after the warm-up and the verdict to a soak's result.

    The warm-up lasts ``warmup`` seconds, or until the prompt-piece cache is full if that is later.
    """
    warmup = max(warmup, caches_full_at(result["samples"]))
    after_warmup = [(s["at_s"], s["rss_mb"]) for s in result["samples"] if s["at_s"] >= warmup]
    slope = slope_per_hour(after_warmup)
    result["warmup_s"] = warmup
    backlog = backlog_growth([s["in_flight"] for s in result["samples"] if s["at_s"] >= warmup])
    result["in_flight_median_first_last_third"] = backlog
    shared = shared_samples(result["samples"], warmup)
    result["invalid"] = [i for i in result["invalid"] if not i.startswith("the machine was shared")]
    if shared:
        worst = max(shared, key=taken_cores)
        result["invalid"].append(
            f"the machine was shared: in {len(shared)} samples after the warm-up the hypervisor and "
            f"other processes took over {MAX_TAKEN_CORES:g} cores "
            f"({taken_cores(worst):.2f} at {worst['at_s']:g} s)"
        )
    if backlog is not None and backlog[1] > MAX_BACKLOG_GROWTH * backlog[0] + BACKLOG_SLACK:
        # Requests queue up in serve (bodies, prompts, streams) while the engines fall behind:
        # RSS then grows with the queue, and its slope says nothing about leaks.
        result["invalid"] = [
            *[i for i in result["invalid"] if not i.startswith("in flight grew")],
            f"in flight grew from a median of {backlog[0]:g} to {backlog[1]:g} after the warm-up "
            "(the engines fell behind the schedule)",
        ]
    result["rss_slope_mb_per_h_after_warmup"] = None if slope is None else round(slope, 2)
    result["passed"] = (
        not result["invalid"]
        and result["tally"]["errors"] == 0
        and result["in_flight_at_end"] == 0
        and slope is not None
        and slope <= MAX_RSS_SLOPE_MB_PER_H
    )
    return result


def report(results: dict[str, Any]) -> str:
    m, r = results["machine"], results["soak"]
    t = r["tally"]
    # A long run every 5 minutes; a short one (a burst reproduced) every 10 s.
    every = 300 if r["duration_s"] >= 1800 else 10
    peak = max(r["samples"], key=lambda sample: sample["in_flight"], default={"in_flight": 0, "at_s": 0})
    verdict = (
        "INVALID (" + "; ".join(r["invalid"]) + ")"
        if r["invalid"]
        else ("passed" if r["passed"] else "FAILED")
    )
    lines = [
        "# Soak: `serve` behind Envoy under steady load",
        "",
        f"{provenance(m)}. {ENGINES} simulated engines, "
        "`serve` (precise prefix routing), Envoy (`gateway.yaml`, FULL_DUPLEX_STREAMED) and the client "
        "share the cores on loopback.",
        "",
        f"**{verdict}.** Targets (issue 14): 0 errors, RSS growth after warm-up within "
        f"{MAX_RSS_SLOPE_MB_PER_H:g} MB/h, in-flight back to 0.",
        "",
        "| measure | value |",
        "|---|--:|",
        f"| duration (warm-up) | {r['duration_s']:g} s ({r['warmup_s']:g} s) |",
        f"| target / achieved rate | {r['rate']:g} / {r['achieved_rate']} req/s |",
        f"| client p99 lag against its schedule | {r['client_p99_lag_ms']} ms |",
        f"| machine busy (of {m['cores']} cores) | {r['machine_busy_cores']} |",
        f"| cores the hypervisor took, mean (most in a sample, at s) | {taken_cell(r, 'stolen')} |",
        f"| cores other processes took, mean (most in a sample, at s) | {taken_cell(r, 'others')} |",
        f"| requests sent | {t['sent']:,} |",
        f"| answered in full | {t['ok']:,} |",
        f"| abandoned by the client on purpose | {t['abandoned']:,} |",
        f"| errors | {t['errors']:,} |",
        f"| serve RSS start -> end | {r['rss_start_mb']} -> {r['rss_end_mb']} MB |",
        f"| RSS slope after warm-up | {r['rss_slope_mb_per_h_after_warmup']} MB/h |",
        f"| in flight at the end | {r['in_flight_at_end']:g} |",
        f"| in flight, the most sampled (at s) | {peak['in_flight']:g} ({peak['at_s']:g}) |",
        "| engines stopped at (s into the load), for | "
        + (
            f"{', '.join(f'{a:g}' for a in r['engines_paused_at_s'])}, {r['engines_paused_for_s']:g} s |"
            if r.get("engines_paused_at_s")
            else "never |"
        ),
        "| in flight after warm-up, median of the first / last third | "
        + (
            " / ".join(f"{x:g}" for x in r["in_flight_median_first_last_third"])
            if r.get("in_flight_median_first_last_third")
            else "-"
        )
        + " |",
        *(
            [
                "| ext_proc streams closed / reset by Envoy | "
                f"{r['streams_ended']['closed']:,.0f} / {r['streams_ended']['cancelled']:,.0f} |"
            ]
            if "streams_ended" in r
            else []
        ),
        f"| serve's extra flags | {' '.join(r.get('serve_args') or []) or 'none'} |",
        f"| Envoy's accounting filter | {'on' if r.get('accounting_filter', True) else 'off'} |",
        "",
        "Warm-up: the first sixth of the run, or until serve's prompt-piece cache (bounded by "
        "`--tokenize-cache-mb`, 64 MiB by default) is full, whichever is later. RSS slope: least "
        "squares over the samples after it.",
        "",
        "Mix: half short chats, half ~4k-token prompts over 8 long documents (repeating prefixes), half "
        "streaming; 10% of requests abandoned by the client (after the first chunk, or after 5 ms). "
        "Each engine caches 4,000 blocks, so the caches fill and evict within the warm-up.",
    ]
    if r.get("note"):
        lines += ["", r["note"]]
    if r.get("rejudged") and not r.get("warmup_rejudged"):
        lines += ["", "Judged again after the run (`--rejudge`) by the soak's current rules, same samples."]
    if r.get("warmup_rejudged"):
        lines += [
            "",
            f"The warm-up ({r['warmup_s']:g} s) was chosen after the run (`--rejudge`), not before it: see "
            "the timeline for why.",
        ]
    if t["examples"]:
        lines += ["", "First errors:", *[f"- `{e}`" for e in t["examples"]]]
    lines += [
        "",
        f"Timeline (every {every:g} s):",
        "",
        "| s | serve RSS MB | prompt-piece cache MB | in flight | sent | errors | streams reset | "
        "cores stolen | cores others took |",
        "|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    next_at = 0.0
    for sample in r["samples"]:
        if sample["at_s"] >= next_at:
            lines.append(
                f"| {sample['at_s']:.0f} | {sample['rss_mb']} | {sample.get('tokenize_cache_mb', 'n/a')} | "
                f"{sample['in_flight']:g} | {sample['sent']:,} | {sample['errors']:,} | "
                f"{format(sample['streams_reset'], ',.0f') if 'streams_reset' in sample else 'n/a'} | "
                f"{sample.get('stolen_cores', 'n/a')} | {sample.get('others_cores', 'n/a')} |"
            )
            next_at += every
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=100.0, help="requests per second (100)")
    p.add_argument("--duration", type=float, default=3600.0, help="seconds of load (3600)")
    p.add_argument("--sample", type=float, default=10.0, help="seconds between samples (10)")
    p.add_argument("--warmup", type=float, default=None, help="seconds before RSS counts (a sixth)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=HERE / "results" / "soak.json")
    p.add_argument(
        "--serve-arg", action="append", default=[], help="an extra flag for serve (repeat for more)"
    )
    p.add_argument(
        "--memtrace",
        type=Path,
        default=None,
        help="run serve under bench/memtrace.py, writing DIR/memtrace.jsonl (slows serve; a diagnosis aid)",
    )
    p.add_argument(
        "--serve-log", type=Path, default=None, help="write serve's warnings and errors to this file"
    )
    p.add_argument(
        "--no-accounting",
        action="store_true",
        help="drop Envoy's accounting filter: one ext_proc stream per request (a diagnosis aid)",
    )
    p.add_argument(
        "--memray",
        type=Path,
        default=None,
        help="run serve under `memray run --native`, capture to FILE (pip install memray first; slows serve)",
    )
    p.add_argument(
        "--pause-engines-at",
        type=float,
        action="append",
        default=None,
        help="stop every engine this many seconds into the load for --pause-seconds (repeatable; "
        "default: once, halfway through the warm-up)",
    )
    p.add_argument(
        "--pause-seconds", type=float, default=2.0, help="how long each engine pause lasts (2; 0: none)"
    )
    p.add_argument(
        "--rejudge",
        action="store_true",
        help="no new run: judge the samples in --out again with --warmup (the report says so)",
    )
    args = p.parse_args()
    warmup = args.warmup if args.warmup is not None else args.duration / 6
    if args.rejudge:
        results = json.loads(args.out.read_text())
        results["soak"]["rejudged"] = True
        if args.warmup is not None:
            results["soak"]["warmup_rejudged"] = True
        judge(results["soak"], warmup)
    else:
        # Before the run: the commit serve runs is the one checked out when it starts.
        provenance_at_start = machine()
        serve_args = Serving(
            tuple(args.serve_arg),
            args.memtrace,
            args.serve_log,
            args.memray,
            args.no_accounting,
            pause_times(args.pause_engines_at, args.pause_seconds, warmup),
            args.pause_seconds,
        )
        result = asyncio.run(soak(args.rate, args.duration, args.sample, warmup, args.seed, serve_args))
        results = {"machine": provenance_at_start, "soak": result}
    result = results["soak"]
    record(args.out, results, report)
    sys.exit(0 if result["passed"] else 1)


if __name__ == "__main__":
    main()
