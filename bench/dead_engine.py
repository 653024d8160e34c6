"""What a dying engine costs clients, through real Envoy, behind both shipped cluster types.

Four simulated vLLM engines (``extproc sim``, one process each, publishing KV events), `serve` with
precise prefix routing (the simulator's tokenizer, KV events, the default 1 s scrape), and Envoy
running a shipped config: ``gateway.yaml`` (override_host, retries) or
``gateway-original-dst.yaml`` (ORIGINAL_DST, no retries). Twelve closed-loop clients each walk
their own conversation, so every engine holds some of them in its cache and prefix routing keeps
sending each conversation back to it.

After a warm-up, the engine holding the most cached blocks gets SIGKILL. Recorded, from the kill:
the requests that failed, how long Envoy still tried to connect to the dead engine (its
``upstream_cx_connect_fail`` counter, polled every 50 ms; with override_host a retry hides each
such try from the client), when `serve` marked it unreachable, when its blocks left the index,
and, once it is started again on the same ports, how long until it serves requests again.

A SIGKILLed process on loopback refuses connections at once. A pod that vanishes from the network
(its node gone) makes connections time out instead; that case is not measured here.

Everything runs on 127.0.0.1 and is stopped at the end. Writes
``bench/results/dead_engine.{json,md}`` (``--out`` to write elsewhere).

    python bench/dead_engine.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from machine import machine, provenance, record
from stack import MODEL, ServeProcess, SimEngine, engines_started, gateway, write_catalog

from extproc.gateway.process import EnvoyProcess

HERE = Path(__file__).resolve().parent
ENGINES = 4
CLIENTS = 12
WARMUP_S = 6.0
DOWN_S = 6.0
BACK_S = 6.0
POLL_S = 0.05


# -- load -----------------------------------------------------------------------------------------


@dataclass(slots=True)
class Outcome:
    sent: float
    done: float
    status: int


def conversation(client: int, turn: int) -> list[dict[str, str]]:
    """A conversation of its own per client: a long system prompt, then a growing history."""
    system = f"You are assistant number {client}. " + " ".join(f"fact{client}-{i}" for i in range(120))
    messages = [{"role": "system", "content": system}]
    for t in range(turn):
        messages.append({"role": "user", "content": f"question {t} from client {client}"})
        messages.append({"role": "assistant", "content": f"answer {t}"})
    messages.append({"role": "user", "content": f"question {turn} from client {client}"})
    return messages


async def client(
    session: aiohttp.ClientSession, url: str, number: int, outcomes: list[Outcome], stop: asyncio.Event
) -> None:
    turn = 0
    while not stop.is_set():
        body = {"model": MODEL, "max_tokens": 16, "messages": conversation(number, turn % 12)}
        sent = time.monotonic()
        try:
            async with session.post(url, json=body) as resp:
                await resp.read()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError):
            status = -1
        outcomes.append(Outcome(sent, time.monotonic(), status))
        turn += 1
        await asyncio.sleep(0.02)


# -- observation ----------------------------------------------------------------------------------


async def envoy_counter(session: aiohttp.ClientSession, admin: int, name: str) -> int:
    async with session.get(f"http://127.0.0.1:{admin}/stats?filter=^{name}$&format=json") as resp:
        stats = (await resp.json())["stats"]
    return int(stats[0]["value"]) if stats else 0


@dataclass(frozen=True, slots=True)
class View:
    """What serve's /debug/state says of one endpoint."""

    unreachable: bool
    blocks: int
    #: Its KV-event sources: (connected, complete, why not) each.
    sources: list[tuple[bool, bool, str | None]]


async def serve_view(session: aiohttp.ClientSession, serve: ServeProcess, address: str) -> View:
    async with session.get(f"http://127.0.0.1:{serve.admin_port}/debug/state") as resp:
        state = await resp.json()
    sources = [s for name, s in state["prefix"]["sources"].items() if address in name]
    return View(
        unreachable=bool(state["engines"]["endpoints"].get(address, {}).get("unreachable")),
        blocks=sum(s["gpuBlocks"] + s["lowerTierBlocks"] for s in sources),
        sources=[(s["connected"], s["complete"], s["reason"]) for s in sources],
    )


async def served_by(session: aiohttp.ClientSession, engine: SimEngine) -> float:
    """Requests ``engine`` finished since it started (its own ``vllm:request_success`` counter)."""
    try:
        async with session.get(f"http://{engine.address}/metrics") as resp:
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError):
        return 0.0
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total")
    )


def first(times: list[tuple[float, bool]], since: float) -> float | None:
    return next((round(t - since, 3) for t, hit in times if hit and t >= since), None)


async def run(config_name: str, workdir: Path) -> dict[str, Any]:
    async with engines_started(ENGINES) as engines:
        serve = ServeProcess(write_catalog(workdir / "catalog.yaml", engines))
        await serve.start()
        config, listen, admin = gateway(config_name, serve, engines)
        outcomes: list[Outcome] = []
        stop = asyncio.Event()
        try:
            async with EnvoyProcess(config) as _, aiohttp.ClientSession() as session:
                url = f"http://127.0.0.1:{listen}/v1/chat/completions"
                tasks = [asyncio.create_task(client(session, url, n, outcomes, stop)) for n in range(CLIENTS)]
                await asyncio.sleep(WARMUP_S)
                views = {e.address: await serve_view(session, serve, e.address) for e in engines}
                victim = max(engines, key=lambda e: views[e.address].blocks)
                blocks_before = views[victim.address].blocks
                fails_before = await envoy_counter(session, admin, "cluster.pool.upstream_cx_connect_fail")
                killed = time.monotonic()
                victim.kill()
                marks: list[tuple[float, bool]] = []  # serve says unreachable
                emptied: list[tuple[float, bool]] = []  # no blocks of it in the index
                connect_fails: list[tuple[float, int]] = []
                while time.monotonic() - killed < DOWN_S:
                    view = await serve_view(session, serve, victim.address)
                    now = time.monotonic()
                    marks.append((now, view.unreachable))
                    emptied.append((now, view.blocks == 0))
                    count = await envoy_counter(session, admin, "cluster.pool.upstream_cx_connect_fail")
                    connect_fails.append((now, count - fails_before))
                    await asyncio.sleep(POLL_S)
                tries = connect_fails[-1][1]
                last_try = next(
                    (t for (t, c), (_, prev) in zip(connect_fails[::-1], connect_fails[-2::-1], strict=False)
                     if c != prev),
                    None,
                )  # fmt: skip
                await victim.start()
                restarted = time.monotonic()
                back: float | None = None
                eligible: list[tuple[float, bool]] = []
                while time.monotonic() - restarted < BACK_S:
                    view = await serve_view(session, serve, victim.address)
                    eligible.append((time.monotonic(), not view.unreachable))
                    if back is None and await served_by(session, victim) > 0:
                        back = round(time.monotonic() - restarted, 3)
                    await asyncio.sleep(POLL_S)
                after = await serve_view(session, serve, victim.address)
                stop.set()
                await asyncio.gather(*tasks)
        finally:
            await serve.stop()
    in_flight = [o for o in outcomes if o.sent < killed <= o.done]
    after_kill = [o for o in outcomes if killed <= o.sent < killed + DOWN_S]
    return {
        "config": config_name,
        "requests": len(outcomes),
        "in_flight_at_kill": len(in_flight),
        "failed_in_flight_at_kill": sum(1 for o in in_flight if o.status != 200),
        "sent_while_down": len(after_kill),
        "failed_sent_while_down": sum(1 for o in after_kill if o.status != 200),
        "failed_in_all": sum(1 for o in outcomes if o.status != 200),
        "connect_tries_to_dead": tries,
        "last_try_after_s": None if last_try is None else round(last_try - killed, 3),
        "marked_unreachable_after_s": first(marks, killed),
        "blocks_before": blocks_before,
        "blocks_gone_after_s": first(emptied, killed),
        "eligible_again_after_restart_s": first(eligible, restarted),
        "serving_again_after_restart_s": back,
        "blocks_after_restart": after.blocks,
        "kv_sources_after_restart": after.sources,
    }


# -- main -----------------------------------------------------------------------------------------


def report(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [
        "# A dying engine, through real Envoy",
        "",
        f"{provenance(m)}. {ENGINES} simulated engines "
        f"(one process each), `serve` (precise prefix routing, default 1 s scrape), Envoy and "
        f"{CLIENTS} closed-loop clients share the cores on loopback. The engine holding the most "
        f"cached blocks gets SIGKILL after {WARMUP_S:g} s; it is started again {DOWN_S:g} s later.",
        "",
        "The target (issue 14): at most 1 s and a handful of requests before it stops being picked.",
        "",
        "| Envoy config | in flight at the kill: failed | sent while down: failed "
        "| connect tries to the dead engine | last try after s | marked unreachable after s "
        "| its blocks (before) gone after s | after restart: eligible s, serving s, blocks |",
        "|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in results["runs"]:
        lines.append(
            f"| {r['config']} | {r['in_flight_at_kill']}: {r['failed_in_flight_at_kill']} | "
            f"{r['sent_while_down']}: {r['failed_sent_while_down']} | {r['connect_tries_to_dead']} | "
            f"{r['last_try_after_s']} | {r['marked_unreachable_after_s']} | "
            f"({r['blocks_before']}) {r['blocks_gone_after_s']} | {r['eligible_again_after_restart_s']}, "
            f"{r['serving_again_after_restart_s']}, {r['blocks_after_restart']} |"
        )
    lines += [
        "",
        "How `serve` learns: Envoy's response attributes on the routing filter (`upstream.address`, "
        "`response.code_details`, `upstream.request_attempt_count`). Behind ORIGINAL_DST a refused "
        "connection ends in Envoy's own 503, which marks the engine unreachable at once (each try "
        "there is a failed request; the few that fail were sent before the first report came back). "
        "Behind override_host the retry succeeds elsewhere, so the client sees nothing; the retry "
        "away from the pick makes `serve` avoid the engine until its next scrape, which confirms it "
        'gone ("marked unreachable": its blocks leave the index then) or clears it. Requests in '
        "flight at the kill are cut either way. After the restart the engine is eligible at its "
        "first good scrape; whether it is picked soon depends on the policy, since the "
        "conversations it held now have their prefixes cached elsewhere.",
    ]
    return "\n".join(lines) + "\n"


async def measure() -> dict[str, Any]:
    results: dict[str, Any] = {"machine": machine(), "runs": []}
    with tempfile.TemporaryDirectory(prefix="extproc-dead-engine-") as tmp:
        for config_name in ("gateway.yaml", "gateway-original-dst.yaml"):
            row = await run(config_name, Path(tmp))
            print(json.dumps(row), file=sys.stderr)
            results["runs"].append(row)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=HERE / "results" / "dead_engine.json")
    out = p.parse_args().out
    results = asyncio.run(measure())
    record(out, results, report)


if __name__ == "__main__":
    main()
