"""Where the cores go when small requests slow down beside long prompts (a diagnosis of issue 13's
"no stall" measure, which ``bench/long_prompts.py`` records).

The same setup as that measure: `serve` with the real Llama 3 tokenizer, the small requests from
this process at 16 streams, alone and then beside another client (a process of its own) streaming
unique ~32k-token chats, alternating ``--rounds`` times. Each run also records the CPU each party
used, in cores: serve's event loop (its main thread), serve's idle-class threads (tokenizing, and
the tokenizer library's pool), serve's other threads (gRPC's), this client, the long-prompt client,
the machine as a whole and what the hypervisor took (steal). A thread's figures cover the whole
run, its 1 s warm-up included. Each round also runs the small requests beside a control: a CPU
burner shaped like what the long prompts add (idle-class spinners and a normal process at the long
client's share of a core), which gives serve no work. With these the p99 beside can be told apart:
serve's own work on the long prompts (its loop's CPU per small request grows), or cores the parties
take from each other (the burner does as much). ``STALL_LONG_MODEL=NAME`` sends the long prompts for
a model serve does not route: it only receives and parses them.

    python bench/investigations/stall_cpu.py [--rounds 5] [--variant threads] [--serve-arg=...]

Writes ``bench/results/stall_cpu.{json,md}``.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import tokenizers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the bench harness
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))  # fetch_tokenizers

from fetch_tokenizers import ensure
from grpc_load import chat_body, closed_loop, one_stream, request_messages
from long_prompts import (
    CHANNEL_OPTIONS,
    MODEL,
    STREAMS,
    VARIANTS,
    LongPromptClient,
    Profiler,
    Texts,
    cold_body,
    gc_summary,
    lag_summary,
    learned,
    loop_lag,
    metric_values,
    p,
    start_serve,
)
from machine import machine, machine_stolen_seconds, provenance, record, thread_cpu_seconds

from extproc.pb.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

HERE = Path(__file__).resolve().parents[1]  # bench/: results/ and the harness are there
#: Small requests alone; beside the long prompts; beside the burner (the control, no serve work).
SIDES = ("alone", "beside", "burner")
#: Unique 32k prompts made per run beside them: serve answers ~80/s of them when it does not
#: tokenize one-off prompts late, more than long_prompts' 400 would last.
STALL_LONG_BODIES = 1000
#: The burner's normal-class process: the long-prompt client's share of a core, as measured.
BURNER_SHARE = 0.1
#: The model the long prompts name: the routed one, or (STALL_LONG_MODEL, a diagnosis) one serve does
#: not know, so it only receives and parses them (and answers 404): what that costs, without tokenizing.
LONG_MODEL = os.environ.get("STALL_LONG_MODEL", MODEL).encode()


def _burn(stop: Any, idle_class: bool, share: float) -> None:
    """A child process: spin until ``stop``, as an idle-class process (every cycle the others
    leave), or as a normal one using ``share`` of a core (spin 1 ms, sleep the rest)."""
    if idle_class:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    while not stop.is_set():
        until = time.perf_counter() + 0.001
        while time.perf_counter() < until:
            pass
        if not idle_class:
            time.sleep(0.001 * (1 - share) / share)


class Burner:
    """The control: CPU work with no serve in it, shaped like what the long prompts add beside the
    small requests (measured: ~0.1 cores of a normal-class client, ~0.2 of idle-class tokenizing):
    two idle-class spinners and one normal process using ``share`` of a core."""

    def __init__(self, share: float) -> None:
        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        self.processes = {
            name: context.Process(target=_burn, args=(self._stop, idle, share), daemon=True)
            for name, idle in (("burner_idle_0", True), ("burner_idle_1", True), ("burner_normal", False))
        }

    def pids(self) -> dict[str, int]:
        return {name: p.pid for name, p in self.processes.items() if p.pid is not None}

    async def __aenter__(self) -> Burner:
        for process in self.processes.values():
            process.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        for process in self.processes.values():
            await asyncio.to_thread(process.join, 10)
            if process.is_alive():
                process.kill()


async def measured_run(
    send_small: Any,
    seconds: float,
    serve_pid: int,
    admin_port: int,
    beside: LongPromptClient | Burner | None,
) -> dict[str, Any]:
    """One closed-loop run of small requests, with each party's cores over it, and serve's loop lag
    and full collections."""
    lag0 = await loop_lag(admin_port)
    gc0 = gc_summary(await metric_values(admin_port, "extproc_gc_pause_seconds"))
    threads0, stolen0, t0 = thread_cpu_seconds(serve_pid), machine_stolen_seconds(), time.monotonic()
    if isinstance(beside, Burner):
        pids = beside.pids()
    else:
        pids = {} if beside is None or beside.pid is None else {"long_client": beside.pid}
    latencies: list[float] = []
    run = await closed_loop(send_small, concurrency=STREAMS, duration=seconds, pids=pids, samples=latencies)
    elapsed = time.monotonic() - t0
    threads1 = thread_cpu_seconds(serve_pid)
    cores = {f"serve_{k}": (threads1[k] - threads0[k]) / elapsed for k in threads0}
    cores["bench"] = run["cpu"]["bench"]
    cores["long_client"] = run["cpu"].get("long_client", 0.0)
    cores["burner_normal"] = run["cpu"].get("burner_normal", 0.0)
    cores["burner_idle"] = sum(v for k, v in run["cpu"].items() if k.startswith("burner_idle"))
    cores["machine"] = run["cpu"]["machine"]
    cores["stolen"] = (machine_stolen_seconds() - stolen0) / elapsed
    lag = lag_summary(lag0, await loop_lag(admin_port))
    gc1 = gc_summary(await metric_values(admin_port, "extproc_gc_pause_seconds"))
    return {
        # The loop's 10 ms timer ticks over 5 ms late: each one delays every request in flight.
        "loop_late_ticks": lag["over_5ms"],
        "full_gcs": gc1["full"] - gc0["full"],
        "per_s": run["per_s"],
        "p50_ms": p(latencies, 0.5) * 1e3,
        "p99_ms": p(latencies, 0.99) * 1e3,
        "errors": run["errors"],
        "cores": cores,
        "latencies": latencies,
        "long_sent": beside.sent if isinstance(beside, LongPromptClient) else 0,
    }


async def measure(
    target: str,
    admin_port: int,
    serve_pid: int,
    rounds: int,
    seconds: float,
    profiler: Profiler,
    long_bodies_per_round: int = STALL_LONG_BODIES,
) -> dict[str, Any]:
    backend = tokenizers.Tokenizer.from_file(str(ensure("llama3") / "tokenizer.json"))
    texts = Texts(backend, seed=13)
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    async with grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS) as channel:
        stub = ep_grpc.ExternalProcessorStub(channel)  # type: ignore[no-untyped-call]
        small = chat_body(MODEL)

        async def send_small() -> str:
            return await one_stream(stub, request_messages(small))

        await closed_loop(send_small, concurrency=STREAMS, duration=seconds)  # warm, unrecorded
        for i in range(rounds):
            await learned(admin_port)
            async with profiler.around(f"alone-{i + 1}"):
                runs["alone"].append(await measured_run(send_small, seconds, serve_pid, admin_port, None))
            long_bodies = [
                cold_body(texts, 32_000).replace(MODEL.encode(), LONG_MODEL, 1)
                for _ in range(long_bodies_per_round)
            ]
            async with LongPromptClient(
                target, long_bodies, refused=MODEL.encode() != LONG_MODEL
            ) as long_client:
                await asyncio.sleep(0.5)
                async with profiler.around(f"beside-{i + 1}"):
                    runs["beside"].append(
                        await measured_run(send_small, seconds, serve_pid, admin_port, long_client)
                    )
            await learned(admin_port)  # the long prompts left to tokenize, late
            async with Burner(BURNER_SHARE) as burner:
                await asyncio.sleep(0.5)
                async with profiler.around(f"burner-{i + 1}"):
                    runs["burner"].append(
                        await measured_run(send_small, seconds, serve_pid, admin_port, burner)
                    )
    pooled = {side: [x for r in runs[side] for x in r.pop("latencies")] for side in SIDES}
    return {
        "rounds": runs,
        "p99_ms": {side: p(pooled[side], 0.99) * 1e3 for side in SIDES},
        "p50_ms": {side: p(pooled[side], 0.5) * 1e3 for side in SIDES},
        "burner_share": BURNER_SHARE,
        "valid": all(r["long_sent"] < long_bodies_per_round for r in runs["beside"]),
    }


async def run(
    variant: str,
    rounds: int,
    seconds: float,
    serve_args: tuple[str, ...],
    sampler: tuple[str, Path | None],
    long_bodies: int,
) -> dict[str, Any]:
    results: dict[str, Any] = {"machine": machine(), "variant": variant, "serve_args": list(serve_args)}
    with tempfile.TemporaryDirectory(prefix="extproc-stall-") as tmp:
        serve = await start_serve(Path(tmp), variant, serve_args)
        try:
            assert serve.proc is not None
            profiler = Profiler(sampler[1], variant, serve.proc.pid, tool=sampler[0])
            target = f"127.0.0.1:{serve.grpc_port}"
            results.update(
                await measure(
                    target, serve.admin_port, serve.proc.pid, rounds, seconds, profiler, long_bodies
                )
            )
        finally:
            await serve.stop()
    return results


def report(results: dict[str, Any]) -> str:
    rounds = results["rounds"]
    flags = " ".join(results["serve_args"])
    lines = [
        "# Small requests beside ~32k-token prompts: where the cores go",
        "",
        f"{provenance(results['machine'])}. Variant `{results['variant']}`"
        + (f", serve's extra flags `{flags}`" if flags else "")
        + f"; {len(rounds['alone'])} rounds of: alone, beside the 32k prompts, beside the burner (the "
        f"control: 2 idle-class spinners and a normal process using {results['burner_share']:g} of a core, "
        f"no work for serve); {STREAMS} streams of small requests.",
        "",
        "| pooled | alone | beside 32k prompts | beside the burner |",
        "|---|--:|--:|--:|",
        "| small p99 ms (x alone) | "
        + " | ".join(
            f"{results['p99_ms'][side]:.1f}"
            + ("" if side == "alone" else f" ({results['p99_ms'][side] / results['p99_ms']['alone']:.2f}x)")
            for side in SIDES
        )
        + " |",
        "| small p50 ms | " + " | ".join(f"{results['p50_ms'][side]:.1f}" for side in SIDES) + " |",
        "| errors | " + " | ".join(str(sum(r["errors"] for r in rounds[side])) for side in SIDES) + " |",
        "",
        *([] if results["valid"] else ["INVALID: the long-prompt client ran out of bodies.", ""]),
        "Cores each party used (CPU-seconds per second):",
        "",
        "| run | small/s | p50 ms | p99 ms | loop > 5 ms late | full GCs | 32k sent | serve loop "
        "| serve idle-class | serve other "
        "| this client | long client | burner normal | burner idle | machine | stolen |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    keys = (
        *("serve_main", "serve_idle_class", "serve_other", "bench", "long_client"),
        *("burner_normal", "burner_idle", "machine", "stolen"),
    )
    for i in range(len(rounds["alone"])):
        for side in SIDES:
            r = rounds[side][i]
            cells = " | ".join(f"{r['cores'][k]:.2f}" for k in keys)
            lines.append(
                f"| {i + 1} {side} | {r['per_s']:.0f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} "
                f"| {r.get('loop_late_ticks', 0):.0f} | {r.get('full_gcs', 0):.0f} | {r['long_sent']} "
                f"| {cells} |"
            )
    loop_ms: dict[str, float] = {}
    for side in SIDES:
        mean = {k: statistics.fmean(r["cores"][k] for r in rounds[side]) for k in keys}
        per_s = statistics.fmean(r["per_s"] for r in rounds[side])
        lines.append(
            f"| mean {side} | {per_s:.0f} | | | | | | " + " | ".join(f"{mean[k]:.2f}" for k in keys) + " |"
        )
        loop_ms[side] = mean["serve_main"] / per_s * 1e3
    lines += [
        "",
        "serve's event-loop CPU per small request done (all the loop's work, the long prompts' "
        "included), alone / beside 32k / beside the burner: "
        + " / ".join(f"{loop_ms[side]:.2f}" for side in SIDES)
        + " ms.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each closed-loop run")
    parser.add_argument(
        "--long-bodies",
        type=int,
        default=STALL_LONG_BODIES,
        help="unique 32k prompts made for each run beside them (more than are sent, or the run is invalid)",
    )
    parser.add_argument("--variant", choices=list(VARIANTS), default="threads")
    parser.add_argument("--serve-arg", action="append", default=[], metavar="ARG")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "stall_cpu.json")
    profilers = parser.add_mutually_exclusive_group()
    profilers.add_argument(
        "--perf",
        type=Path,
        metavar="DIR",
        help="perf record serve's event-loop thread during each run, into DIR/VARIANT-SIDE-N.data "
        "(a profiler takes CPU too: compare profiled runs with profiled runs only)",
    )
    profilers.add_argument(
        "--py-spy",
        type=Path,
        metavar="DIR",
        help="py-spy serve's threads during each run, into DIR/VARIANT-SIDE-N.txt",
    )
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    sampler = ("perf", args.perf) if args.perf is not None else ("py-spy", args.py_spy)
    if sampler[1] is not None:
        sampler[1].mkdir(parents=True, exist_ok=True)
    results = asyncio.run(
        run(args.variant, args.rounds, args.seconds, tuple(args.serve_arg), sampler, args.long_bodies)
    )
    record(args.out, results, report)


if __name__ == "__main__":
    main()
