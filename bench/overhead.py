"""Overhead benchmark: what real Envoy + our ext_proc add, decisions/s of one serve, JSON parsing.

    python bench/overhead.py [--quick] [--out bench/results/overhead.json]

Everything runs on loopback on this machine: two fake backends and the HTTP client in this process,
``extproc serve`` as a subprocess, four real Envoys (``--concurrency 1``) from the shipped
``envoy/gateway.yaml``: "direct" (both ext_proc filters removed: override_host falls back to round
robin), "full_duplex", "buffered" and "fd_no_accounting" (FULL_DUPLEX without the in-flight
accounting filter, which prices that filter's second gRPC stream), all through the same serve.
Writes JSON and a markdown summary.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import orjson
import uvloop
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpc_load import chat_body, closed_loop, percentiles, run_load, stream_logic_us
from machine import machine, machine_busy_seconds

from extproc.demo.backends import Backend
from extproc.demo.catalog import LocalWorkerSet, catalog_yaml
from extproc.gateway.config import EXTPROC_FILTER, HCM_FILTER, load_config, render_config, shipped_config
from extproc.gateway.process import EnvoyProcess, envoy_binary

MODEL, ALIAS = "bench-model", "bench-alias"
#: The shipped configs' in-flight accounting filter (envoy/README.md).
ACCOUNTING_FILTER = "extproc-accounting"
# "fd_no_accounting": FULL_DUPLEX without the accounting filter, to price its second ext_proc stream.
GATEWAYS = ("direct", "full_duplex", "buffered", "fd_no_accounting")
# (request, gateway, model asked for, prompt bytes); "added" = minus (same size, direct).
SCENARIOS = [("small", g, MODEL, 64) for g in GATEWAYS] + [("alias", g, ALIAS, 64) for g in GATEWAYS[1:3]]
SCENARIOS += [("100kb", g, MODEL, 100_000) for g in GATEWAYS[:3]]


#: Per request: loopback answers take milliseconds; this only stops a wedged request hanging the run.
_TIMEOUT = aiohttp.ClientTimeout(total=30.0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:  # PR_SET_PDEATHSIG: serve must not outlive a SIGKILLed bench.
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


async def start_serve(tmp: Path, grpc_port: int, admin_port: int) -> asyncio.subprocess.Process:
    """``python -m extproc serve`` on loopback, SERVING on grpc.health.v1 (or RuntimeError + its log)."""
    flags = ["--source", f"file:{tmp / 'catalog.yaml'}", "--listen", f"127.0.0.1:{grpc_port}"]
    flags += ["--admin-listen", f"127.0.0.1:{admin_port}", "--seed", "1", "--drain-seconds", "1"]
    log = os.open(tmp / "serve.log", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        proc = await asyncio.create_subprocess_exec(
            *[sys.executable, "-m", "extproc", "--log-level", "warning", "serve", *flags],
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
        )
    finally:
        os.close(log)
    deadline = time.monotonic() + 30.0
    async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline and proc.returncode is None:
            with contextlib.suppress(grpc.aio.AioRpcError):
                answer = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    return proc
            await asyncio.sleep(0.1)
    await stop_process(proc)
    raise RuntimeError(f"serve did not become SERVING:\n{(tmp / 'serve.log').read_text()[-3000:]}")


async def stop_process(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 5.0)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


def gateway_config(kind: str, ports: tuple[int, int, int], pool: list[Backend]) -> dict[str, Any]:
    listen, admin, extproc_port = ports
    config = render_config(
        load_config(shipped_config("gateway.yaml")),
        listen_port=listen,
        admin_port=admin,
        extproc_address=("127.0.0.1", extproc_port),
        pool_endpoints=[(b.host, b.port) for b in pool],
        body_mode="BUFFERED" if kind == "buffered" else "FULL_DUPLEX_STREAMED",
    )
    dropped = {"direct": {EXTPROC_FILTER, ACCOUNTING_FILTER}, "fd_no_accounting": {ACCOUNTING_FILTER}}
    if kind in dropped:
        listener = next(x for x in config["static_resources"]["listeners"] if x["name"] == "gateway")
        hcm = next(f for f in listener["filter_chains"][0]["filters"] if f["name"] == HCM_FILTER)
        filters = hcm["typed_config"]["http_filters"]
        filters[:] = [f for f in filters if f["name"] not in dropped[kind]]
    return config


async def post(session: aiohttp.ClientSession, url: str, body: bytes) -> bytes:
    async with session.post(url, data=body, headers={"content-type": "application/json"}) as resp:
        data = await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}: {data[:300]!r}")
        return data


async def latency(urls: dict[str, str], rounds: int, per_round: int, warmup: int) -> dict[str, Any]:
    """Concurrency 1, one keep-alive connection per gateway, scenario order rotated every round."""
    bodies = {(s, g): chat_body(m, size) for s, g, m, size in SCENARIOS}
    samples: dict[tuple[str, str], list[float]] = {key: [] for key in bodies}
    checks: dict[str, Any] = {}
    sessions = {
        g: aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1), timeout=_TIMEOUT) for g in GATEWAYS
    }
    deadline = time.monotonic() + 900.0
    try:
        for (scenario, gateway), body in bodies.items():
            seen = orjson.loads(await post(sessions[gateway], urls[gateway], body))["x_backend"]
            checks[f"{scenario}/{gateway}"] = {k: seen[k] for k in ("model", "destination_header")}
            # Routed by ext_proc (header set) except direct; aliases arrive rewritten.
            if (gateway != "direct") != bool(seen["destination_header"]) or seen["model"] != MODEL:
                raise RuntimeError(f"{scenario}/{gateway}: not routed as expected: {seen}")
            for _ in range(warmup):
                await post(sessions[gateway], urls[gateway], body)
        keys = list(bodies)
        for r in range(rounds):
            for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
                if time.monotonic() > deadline:
                    raise RuntimeError("latency stage over its 900 s budget: is the machine busy?")
                session, url, body, out = sessions[key[1]], urls[key[1]], bodies[key], samples[key]
                for _ in range(per_round):
                    started = time.perf_counter()
                    await post(session, url, body)
                    out.append(time.perf_counter() - started)
    finally:
        for session in sessions.values():
            await session.close()
    rows = []
    for (scenario, gateway), values in samples.items():
        stats = percentiles(values)
        base = percentiles(samples[("100kb" if scenario == "100kb" else "small", "direct")])
        added = {f"added_{q}": stats[q] - base[q] for q in ("p50_ms", "p90_ms", "p99_ms", "mean_ms")}
        rows.append({"request": scenario, "gateway": gateway, "n": len(values), **stats, **added})
    return {"rows": rows, "checks": checks}


def json_micro(repeats: int) -> list[dict[str, Any]]:
    """Best-of-``repeats`` parse time of a chat body, stdlib json vs orjson (both given bytes)."""
    rows = []
    for label, size in (("1 KB", 1_000), ("100 KB", 100_000), ("1 MB", 1_000_000)):
        turns = [{"role": "user", "content": "word " * 100} for _ in range(max(1, round(size / 540)))]
        body = orjson.dumps({"model": MODEL, "messages": turns})
        row: dict[str, Any] = {"size": label, "bytes": len(body)}
        for name, fn in (("json", json.loads), ("orjson", orjson.loads)):
            timer = timeit.Timer(functools.partial(fn, body))
            number, _ = timer.autorange()
            row[f"{name}_us"] = min(timer.repeat(repeats, number)) / number * 1e6
        row["speedup"] = row["json_us"] / row["orjson_us"]
        rows.append(row)
    return rows


def _run(*args: str) -> str:
    return subprocess.run(args, capture_output=True, text=True, check=False).stdout.strip()


async def wait_quiet(limit: float = 0.25, within: float = 180.0) -> float:
    """Wait (at most ``within`` s) until the machine uses under ``limit`` cores over 2 s; the last reading."""
    deadline = time.monotonic() + within
    while True:
        before = machine_busy_seconds()
        await asyncio.sleep(2.0)
        busy = (machine_busy_seconds() - before) / 2.0
        if busy < limit or time.monotonic() > deadline:
            return busy


async def run(quick: bool) -> dict[str, Any]:
    seconds = 3.0 if quick else 10.0
    results: dict[str, Any] = {
        "machine": machine(
            envoy=_run(envoy_binary(), "--version").split("version:")[-1].strip(), grpcio=grpc.__version__
        ),
        "quick": quick,
    }
    results["machine"]["busy_cores_before"] = await wait_quiet()
    results["json_parse"] = json_micro(3 if quick else 7)
    async with contextlib.AsyncExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="extproc-bench-")))
        pool = [Backend(f"b{i}", chunks=1, chunk_delay=0) for i in (1, 2)]
        for backend in pool:
            await backend.start("127.0.0.1")
            stack.push_async_callback(backend.stop)
        sets = [LocalWorkerSet("bench", MODEL, [b.address for b in pool], aliases=[ALIAS])]
        (tmp / "catalog.yaml").write_text(catalog_yaml(sets))
        results["stream_logic_us"] = stream_logic_us(tmp / "catalog.yaml", chat_body(MODEL))
        grpc_port, admin_port = free_port(), free_port()
        proc = await start_serve(tmp, grpc_port, admin_port)
        stack.push_async_callback(stop_process, proc)
        envoys: dict[str, EnvoyProcess] = {}
        urls: dict[str, str] = {}
        for kind in GATEWAYS:
            ports = (free_port(), free_port(), grpc_port)
            envoys[kind] = await stack.enter_async_context(
                EnvoyProcess(gateway_config(kind, ports, pool), concurrency=1)
            )
            urls[kind] = f"http://127.0.0.1:{ports[0]}/v1/chat/completions"
        rounds, per_round, warmup = (3, 100, 50) if quick else (5, 400, 200)
        results["latency"] = await latency(urls, rounds, per_round, warmup)
        results["decisions"] = []
        for concurrency in (1, 16, 64):
            target, body = f"127.0.0.1:{grpc_port}", chat_body(MODEL)
            load = await run_load(
                target, concurrency=concurrency, duration=seconds, body=body, server_pid=proc.pid
            )
            results["decisions"].append(load)
        results["through_envoy"] = []
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=16), timeout=_TIMEOUT
        ) as session:
            for kind in ("direct", "full_duplex", "fd_no_accounting"):
                pids = {"envoy": envoys[kind].pid or 0} | ({"serve": proc.pid} if kind != "direct" else {})

                async def call(url: str = urls[kind]) -> str:
                    await post(session, url, chat_body(MODEL))
                    return "200"

                load = await closed_loop(call, concurrency=16, duration=seconds, pids=pids)
                results["through_envoy"].append({"gateway": kind, **load})
        results["serve_log_tail"] = (tmp / "serve.log").read_text(errors="replace").splitlines()[-20:]
    results["machine"]["loadavg_at_end"] = os.getloadavg()
    return results


def _f(value: float | str | None, digits: int = 2) -> str:
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value or "-")


def _table(head: str, rows: list[list[Any]]) -> list[str]:
    cols = head.count("|") - 1
    return ["", head, "|" + "--:|" * cols, *("| " + " | ".join(map(str, row)) + " |" for row in rows), ""]


def _decision_row(d: dict[str, Any]) -> list[Any]:
    lat, cpu, rate = d["latency"], d["cpu"], d["per_s"]
    cells = (lat["p50_ms"], lat["p99_ms"], cpu["serve"])
    return [
        d["concurrency"],
        f"{rate:.0f}",
        *map(_f, cells),
        f"{cpu['serve'] / max(rate, 1) * 1e6:.0f}",
        _f(cpu["bench"]),
        _f(cpu["machine"]),
        d["errors"],
    ]


def markdown(r: dict[str, Any]) -> str:
    m, lat = r["machine"], "latency"
    out = [
        "# Overhead benchmark" + (" (--quick)" if r["quick"] else ""),
        f"\n{m['date']}, commit {m['git_commit'][:12]}{' + uncommitted changes' if m['git_dirty'] else ''}; "
        f"{m['cpu_model']}, {m['cores']} cores; Python {m['python']}; Envoy {m['envoy']}; grpcio "
        f"{m['grpcio']}; load avg {m['loadavg_at_start'][0]:.2f} at start, "
        f"{m['loadavg_at_end'][0]:.2f} at end; {m['busy_cores_before']:.2f} cores busy just before. "
        "All processes (Envoys, serve, bench client + backends) share these cores on loopback.",
        "\n## 1. Latency at concurrency 1 (ms; added = minus Envoy direct with the same body)",
    ]
    keys = ("p50_ms", "p90_ms", "p99_ms", "mean_ms", "added_p50_ms", "added_p99_ms")
    rows = [[x["request"], x["gateway"], x["n"], *(_f(x[k]) for k in keys)] for x in r[lat]["rows"]]
    out += _table("| request | gateway | n | p50 | p90 | p99 | mean | added p50 | added p99 |", rows)
    out.append("## 2. Decisions/s of one `serve` (gRPC load client, Envoy-like FULL_DUPLEX streams)")
    out.append(
        "\nCPU = CPU-seconds per second (1.0 = one core busy; machine = every process, of 2.0); the load "
        "client is the bench process. "
        f"For scale, a whole stream's product logic without gRPC (RequestStream.handle of the same messages, "
        f"in-process) takes {_f(r['stream_logic_us'], 0)} µs."
    )
    rows = [_decision_row(d) for d in r["decisions"]]
    head = "| streams | decisions/s | p50 ms | p99 ms | serve CPU | serve CPU µs/decision | client CPU "
    out += _table(head + "| machine CPU | errors |", rows)
    out.append("## 2b. Through Envoy, 16 concurrent HTTP clients (client + backends = the bench process)")
    rows = [
        [t["gateway"], f"{t['per_s']:.0f}", _f(t[lat]["p50_ms"]), _f(t[lat]["p99_ms"]), cpu, t["errors"]]
        for t in r["through_envoy"]
        for cpu in [", ".join(f"{k} {v:.2f}" for k, v in t["cpu"].items())]
    ]
    out += _table("| gateway | req/s | p50 ms | p99 ms | CPU by process | errors |", rows)
    out.append("## 3. Parsing a chat body (µs per parse, best of N)")
    rows = [
        [j["size"], j["bytes"], _f(j["json_us"], 1), _f(j["orjson_us"], 1), f"{j['speedup']:.1f}x"]
        for j in r["json_parse"]
    ]
    out += _table("| body | bytes | json.loads | orjson.loads | speedup |", rows)
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description="Envoy + ext_proc overhead benchmark (loopback only)")
    parser.add_argument("--quick", action="store_true", help="short runs (~40 s) for a smoke check")
    default = Path(__file__).resolve().parent / "results" / "overhead.json"
    parser.add_argument("--out", type=Path, default=default, help="JSON results; .md summary beside it")
    args = parser.parse_args()
    try:
        results = uvloop.run(run(args.quick))
    except KeyboardInterrupt:
        sys.exit("interrupted: every process started was stopped; no results written")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
