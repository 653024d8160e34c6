"""Flow control against a pool with little capacity: two tenants, two priorities, a burst.

Real Envoy (the shipped gateway, FULL_DUPLEX_STREAMED) in front of one ``serve`` process and two
simulated engines with **one seat each** (``--max-num-seqs 1``, real time). A ``heavy`` tenant
keeps 12 requests in flight (80 output tokens, ~0.5 s each on an idle seat); a ``light`` tenant
sends one at a time, each twice as long (160 tokens, ~1 s). Each arm starts its own stack:

- ``fifo``: today's default, no saturation limit; everything queues first come, first served in
  the engines;
- ``shed``: ``queue_limit: 0`` and ``--max-queue 0``: today's shedding, 429 at once when full;
- ``flow``: ``queue_limit: 0`` with flow control on (``--max-queue 128``, default timeout): serve
  holds what finds the pool full, by priority, fair by tokens across fairness IDs.

Phases per arm: the light tenant alone; light beside heavy; a priority-10 objective (``premium``,
same length as light) beside heavy at priority 0; priority -1 (``scavenger``) beside heavy, with a
priority-0 probe in the same window. Then, with ``--max-queue 4 --queue-timeout 1``, a burst of 30
at priority 0 on the saturated pool followed by 2 premium requests (two seats busy for ~0.5 s serve
two more within the second's timeout, not four); and last, the latency of a
request that never queues (idle pool, 1 output token), this code beside ``--baseline`` (another
checkout's ``PYTHONPATH``), when given.

Timing is the client's: its own event loop's lag is measured throughout, and a run whose lag
passed 100 ms says so (the machine could not keep up; numbers invalid).

    python bench/flow_control.py [--baseline /tmp/old] [--out bench/results/flow_control.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine, provenance, record
from stack import MODEL, ServeProcess, engines_started, gateway, write_catalog

from extproc.demo.catalog import LocalObjective
from extproc.gateway.process import EnvoyProcess

HEAVY_TOKENS, LIGHT_TOKENS = 80, 160
HEAVY_CONCURRENCY = 12
PREMIUM_IN_BURST = 2
NEVER_QUEUED_ROUNDS, NEVER_QUEUED_REQUESTS = 3, 200
PHASE_S = 20.0
ENGINE_ARGS = ("--max-num-seqs", "1", "--time-scale", "1", "--default-output-tokens", "16")
LAG_LIMIT_S = 0.1
#: A priority-10 objective in the llm-d router's group, and a sheddable one in the older GIE group.
OBJECTIVES = (LocalObjective("premium", 10, "llama"), LocalObjective("scavenger", -1, "llama", legacy=True))


@dataclass(frozen=True, slots=True)
class Arm:
    name: str
    queue_limit: int | None
    serve_args: tuple[str, ...] = ()


ARMS = (
    Arm("fifo", None),
    Arm("shed", 0, ("--max-queue", "0")),
    Arm("flow", 0),
)


@dataclass(slots=True)
class Outcome:
    status: int
    seconds: float
    retry_after: str | None = None
    json_error: bool = False


@dataclass(slots=True)
class LagMeter:
    """How late a 10 ms timer of the client's own loop ran (the client's ability to keep time)."""

    worst: float = 0.0
    task: asyncio.Task[None] | None = field(default=None)

    async def _run(self) -> None:
        while True:
            due = time.perf_counter() + 0.01
            await asyncio.sleep(0.01)
            self.worst = max(self.worst, time.perf_counter() - due)


@contextlib.asynccontextmanager
async def lag_meter() -> AsyncIterator[LagMeter]:
    meter = LagMeter()
    meter.task = asyncio.create_task(meter._run())
    try:
        yield meter
    finally:
        meter.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await meter.task


async def ask(
    session: aiohttp.ClientSession, url: str, tokens: int, *, tenant: str, objective: str | None = None
) -> Outcome:
    headers = {"x-llm-d-inference-fairness-id": tenant}
    if objective is not None:
        headers["x-llm-d-inference-objective"] = objective
    body = {"model": MODEL, "prompt": f"{tenant} says hello", "max_tokens": tokens}
    started = time.perf_counter()
    async with session.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
        text = await resp.read()
        seconds = time.perf_counter() - started
        json_error = False
        if resp.status >= 400:
            with contextlib.suppress(ValueError):
                json_error = "error" in json.loads(text)
        return Outcome(resp.status, seconds, resp.headers.get("retry-after"), json_error)


async def loop_until(deadline: float, one: Callable[[], Awaitable[Outcome]], out: list[Outcome]) -> None:
    while time.monotonic() < deadline:
        out.append(await one())


def summary(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    ok = sorted(o.seconds for o in outcomes if o.status == 200)
    statuses: dict[str, int] = {}
    for o in outcomes:
        statuses[str(o.status)] = statuses.get(str(o.status), 0) + 1
    shed = [o for o in outcomes if o.status == 429]
    return {
        "requests": len(outcomes),
        "statuses": statuses,
        "p50_s": round(statistics.median(ok), 3) if ok else None,
        "p99_s": round(ok[min(len(ok) - 1, int(0.99 * len(ok)))], 3) if ok else None,
        "max_s": round(ok[-1], 3) if ok else None,
        "shed_with_retry_after": sum(1 for o in shed if o.retry_after),
        "shed_with_json": sum(1 for o in shed if o.json_error),
        "shed_p99_s": round(sorted(o.seconds for o in shed)[int(0.99 * (len(shed) - 1))], 3)
        if shed
        else None,
    }


@contextlib.asynccontextmanager
async def pool(
    tmp: Path, queue_limit: int | None, serve_args: Sequence[str], env: dict[str, str] | None = None
) -> AsyncIterator[tuple[str, ServeProcess]]:
    """Two one-seat engines, serve (precise, scraping) and Envoy; yields (gateway URL, serve)."""
    async with engines_started(2, ENGINE_ARGS) as engines:
        catalog = write_catalog(tmp / "catalog.yaml", engines, OBJECTIVES)
        limit = "" if queue_limit is None else f"\n    queue_limit: {queue_limit}"
        profiles = tmp / "profiles.yaml"
        profiles.write_text(f"profiles:\n  demo:\n    max_num_seqs: 1{limit}\n")
        serve = ServeProcess(catalog, extra_args=("--profiles", str(profiles), *serve_args), env=env)
        await serve.start()
        try:
            config, listen, _admin = gateway("gateway.yaml", serve, engines)
            async with EnvoyProcess(config, log_path=tmp / "envoy.log"):
                yield f"http://127.0.0.1:{listen}", serve
        finally:
            await serve.stop()


async def tenants(url: str, session: aiohttp.ClientSession) -> dict[str, Any]:
    """The four phases of one arm."""
    results: dict[str, Any] = {}
    alone: list[Outcome] = []
    for _ in range(10):
        alone.append(await ask(session, url, LIGHT_TOKENS, tenant="light"))
    results["light_alone"] = summary(alone)

    async def beside_heavy(
        one: Callable[[], Awaitable[Outcome]], seconds: float = PHASE_S
    ) -> tuple[Any, Any]:
        deadline = time.monotonic() + seconds
        heavy: list[Outcome] = []
        probe: list[Outcome] = []
        flood = [
            asyncio.create_task(
                loop_until(deadline, lambda: ask(session, url, HEAVY_TOKENS, tenant="heavy"), heavy)
            )
            for _ in range(HEAVY_CONCURRENCY)
        ]
        await asyncio.sleep(1.0)  # the pool fills first
        await loop_until(deadline, one, probe)
        await asyncio.gather(*flood)
        return summary(probe), summary(heavy)

    results["light_beside_heavy"], results["heavy"] = await beside_heavy(
        lambda: ask(session, url, LIGHT_TOKENS, tenant="light")
    )
    results["premium_beside_heavy"], results["heavy_under_premium"] = await beside_heavy(
        lambda: ask(session, url, LIGHT_TOKENS, tenant="premium", objective="premium")
    )

    async def scavenger_and_probe() -> Outcome:
        scavenged = await ask(session, url, HEAVY_TOKENS, tenant="scavenger", objective="scavenger")
        scavengers.append(scavenged)
        return await ask(session, url, HEAVY_TOKENS, tenant="probe")

    scavengers: list[Outcome] = []
    results["probe_priority_0"], _ = await beside_heavy(scavenger_and_probe, 10.0)
    results["scavenger_priority_minus_1"] = summary(scavengers)
    return results


async def burst(url: str, serve: ServeProcess, session: aiohttp.ClientSession) -> dict[str, Any]:
    """30 at priority 0 on a saturated pool, then 2 premium ones; every answer timed and read."""
    started = time.perf_counter()
    low = [asyncio.create_task(ask(session, url, HEAVY_TOKENS, tenant=f"t{i % 3}")) for i in range(30)]
    await asyncio.sleep(0.05)
    high = [
        asyncio.create_task(ask(session, url, HEAVY_TOKENS, tenant="premium", objective="premium"))
        for _ in range(PREMIUM_IN_BURST)
    ]
    low_out, high_out = await asyncio.gather(asyncio.gather(*low), asyncio.gather(*high))
    whole = time.perf_counter() - started
    in_flight = None
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        async with session.get(f"{serve.admin_url}/metrics") as resp:
            page = await resp.text()
        in_flight = sum(
            float(line.rsplit(" ", 1)[1])
            for line in page.splitlines()
            if line.startswith("extproc_inflight_requests{")
        )
        if in_flight == 0:
            break
        await asyncio.sleep(0.1)
    everything = [*low_out, *high_out]
    return {
        "priority_0": summary(low_out),
        "premium_sent_last": summary(high_out),
        "slowest_answer_s": round(max(o.seconds for o in everything), 3),
        "burst_seconds": round(whole, 3),
        "five_xx": sum(1 for o in everything if o.status >= 500),
        "in_flight_after": in_flight,
    }


async def never_queued(url: str, session: aiohttp.ClientSession, count: int = 100) -> dict[str, Any]:
    times = []
    for i in range(count):
        body = {"model": MODEL, "prompt": f"quick {i}", "max_tokens": 1}
        started = time.perf_counter()
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            await resp.read()
            assert resp.status == 200, resp.status
        times.append(time.perf_counter() - started)
    times.sort()
    return {
        "requests": count,
        "p50_ms": round(statistics.median(times) * 1000, 2),
        "p90_ms": round(times[int(0.9 * count)] * 1000, 2),
        "p99_ms": round(times[int(0.99 * count) - 1] * 1000, 2),
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"machine": machine(), "arms": {}, "invalid": []}
    timeout = aiohttp.ClientTimeout(total=120)
    async with (
        lag_meter() as lag,
        aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session,
    ):
        tmp = Path(args.tmp)
        for arm in ARMS:
            if args.arms and arm.name not in args.arms:
                continue
            print(f"arm {arm.name} ...", flush=True)
            (tmp / arm.name).mkdir(parents=True, exist_ok=True)
            async with pool(tmp / arm.name, arm.queue_limit, arm.serve_args) as (url, _serve):
                results["arms"][arm.name] = await tenants(url, session)
        print("burst ...", flush=True)
        (tmp / "burst").mkdir(parents=True, exist_ok=True)
        async with pool(tmp / "burst", 0, ("--max-queue", "4", "--queue-timeout", "1")) as (url, serve):
            results["burst"] = await burst(url, serve, session)
        print("never queued ...", flush=True)
        results["never_queued"] = {}
        checkouts = [("this", None)] + (
            [("baseline", {"PYTHONPATH": args.baseline})] if args.baseline else []
        )
        for _round in range(NEVER_QUEUED_ROUNDS):  # alternate: a drift of the machine hits both alike
            for name, env in checkouts:
                (tmp / f"nq-{name}").mkdir(parents=True, exist_ok=True)
                async with pool(tmp / f"nq-{name}", None, (), env) as (url, _serve):
                    await never_queued(url, session, 20)  # warm up
                    one = await never_queued(url, session, NEVER_QUEUED_REQUESTS)
                    results["never_queued"].setdefault(name, []).append(one)
        results["client_loop_lag_max_s"] = round(lag.worst, 4)
        if lag.worst > LAG_LIMIT_S:
            results["invalid"].append(f"the client's loop lagged {lag.worst:.3f} s (> {LAG_LIMIT_S} s)")
    return results


def report(r: dict[str, Any]) -> str:
    lines = [
        "# Flow control: two tenants and two priorities on a pool of two one-seat engines",
        "",
        provenance(r["machine"]),
        "",
        "Real Envoy, one `serve`, two simulated engines with one seat each (`bench/flow_control.py`). "
        f"Heavy: {HEAVY_CONCURRENCY} concurrent requests of {HEAVY_TOKENS} output tokens (~0.5 s on a free "
        f"seat); light and premium: one at a time, {LIGHT_TOKENS} tokens (~1 s). Latencies are the client's, "
        "whole requests through Envoy.",
        "",
    ]
    if r["invalid"]:
        lines += ["**INVALID RUN**: " + "; ".join(r["invalid"]), ""]
    else:
        lines += [f"Valid: the client's loop lagged at most {r['client_loop_lag_max_s'] * 1000:.0f} ms.", ""]
    lines += [
        "| arm | light alone p50 / p99 | light beside heavy p50 / p99 (x alone) | light's statuses | "
        "premium (prio 10) beside heavy p99 (x alone) | premium's statuses | heavy's statuses |",
        "|---|--:|--:|---|--:|---|---|",
    ]
    for name, a in r["arms"].items():
        alone = a["light_alone"]["p99_s"] or float("nan")
        beside, premium = a["light_beside_heavy"], a["premium_beside_heavy"]

        def ratio(p99: float | None, alone: float = alone) -> str:
            return "-" if p99 is None else f"{p99:.2f} s ({p99 / alone:.1f}x)"

        lines.append(
            f"| {name} | {a['light_alone']['p50_s']} / {a['light_alone']['p99_s']} s | "
            f"{beside['p50_s']} / {ratio(beside['p99_s'])} | {beside['statuses']} | "
            f"{ratio(premium['p99_s'])} | {premium['statuses']} | {a['heavy']['statuses']} |"
        )
    lines += ["", "Sheddable (priority -1) beside heavy, with a priority-0 probe in the same window:", ""]
    lines += [
        "| arm | priority -1 statuses | its 429s answered within (p99) | priority-0 probe statuses |",
        "|---|---|--:|---|",
    ]
    for name, a in r["arms"].items():
        s, p = a["scavenger_priority_minus_1"], a["probe_priority_0"]
        shed = "-" if s["shed_p99_s"] is None else f"{s['shed_p99_s'] * 1000:.0f} ms"
        lines.append(f"| {name} | {s['statuses']} | {shed} | {p['statuses']} |")
    b = r["burst"]
    low = b["priority_0"]
    lines += [
        "",
        "Burst, `--max-queue 4 --queue-timeout 1`: 30 requests at priority 0 at once, then "
        f"{PREMIUM_IN_BURST} premium ones:",
        "",
        f"- priority 0: {low['statuses']}; 429s with Retry-After {low['shed_with_retry_after']}, "
        f"with a JSON error body {low['shed_with_json']};",
        f"- premium, sent last: {b['premium_sent_last']['statuses']};",
        f"- slowest answer {b['slowest_answer_s']} s (timeout + 2 s = 3 s), 5xx: {b['five_xx']}, "
        f"in flight afterwards: {b['in_flight_after']}.",
        "",
        f"A request that never queues (idle pool, 1 output token, {NEVER_QUEUED_REQUESTS} sequential "
        f"requests after 20 to warm up, {NEVER_QUEUED_ROUNDS} rounds alternated; `baseline` is the checkout "
        "before flow control):",
        "",
        "| checkout | p50 | p90 | p99 |",
        "|---|--:|--:|--:|",
    ]
    for name, rounds in r["never_queued"].items():
        for one in rounds:
            lines.append(f"| {name} | {one['p50_ms']} ms | {one['p90_ms']} ms | {one['p99_ms']} ms |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--baseline", help="PYTHONPATH of a checkout to time the never-queued request against"
    )
    parser.add_argument("--arms", nargs="*", help="only these arms (fifo, shed, flow)")
    parser.add_argument("--tmp", default="/tmp/flow-control-bench")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "flow_control.json")
    args = parser.parse_args()
    record(args.out, asyncio.run(main_async(args)), report)


if __name__ == "__main__":
    main()
