"""One InferencePool against the same engines declared as an InferenceWorkerSet, in one run.

A real API server (the kube tests' etcd + kube-apiserver) holds both: a worker set with its Service
and EndpointSlice in one namespace, and an InferencePool with Pods whose status this bench writes
(Ready, loopback IPs) in another, both over the same four simulated engines (``extproc sim`` on
127.0.0.2-5, KV events with replay, so routing is precise). One ``serve`` per arm reads one of them
(``--namespaces`` / ``--pool-name``); the arms alternate, twice each, on the same engines, whose
prefix caches are reset before each arm. Per arm:

- **routing quality**: 24 conversations of 6 turns (a long system prompt of their own, the history
  growing each turn) through real Envoy, 6 at a time: the engines' prefix-cache hit rate (their own
  counters) and the whole requests' latency;
- **decisions/s**: the gRPC load client against serve directly (16 streams, small chats).

    python bench/inferencepool.py [--out bench/results/inferencepool.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from grpc_load import chat_body, run_load
from kube.kubeenv import KubeEnv
from machine import machine, provenance, record
from ports import free_port
from stack import MODEL, wait_http

from extproc.gateway.config import load_config, render_config, shipped_config
from extproc.gateway.process import EnvoyProcess

HERE = Path(__file__).resolve().parent
IPS = ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5")
HTTP, KV, REPLAY = free_port(), free_port(), free_port()
POOL_CRD = HERE.parent / "tests" / "kube" / "vendor" / "inference.networking.k8s.io_inferencepools.yaml"
CONVERSATIONS, TURNS, CONCURRENCY = 24, 6, 6
ROUNDS = 4


def worker_set_objects(ns: str) -> list[dict[str, Any]]:
    ports = [("http", HTTP), ("kv-events", KV), ("kv-replay", REPLAY)]
    return [
        {
            "apiVersion": "kinference.buoyant.io/v1alpha1",
            "kind": "InferenceWorkerSet",
            "metadata": {"name": "llama", "namespace": ns},
            "spec": {
                "serviceRef": {"name": "llama", "port": "http"},
                "profile": "default",
                "kvBlockSize": 16,
                "kvEvents": {"port": "kv-events"},
                "modelDiscovery": {"mode": "Static"},
                "models": [{"name": MODEL}],
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "llama", "namespace": ns},
            "spec": {"clusterIP": "None", "ports": [{"name": n, "port": p} for n, p in ports]},
        },
        {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": "llama-a",
                "namespace": ns,
                "labels": {"kubernetes.io/service-name": "llama"},
            },
            "addressType": "IPv4",
            "ports": [{"name": n, "port": p, "protocol": "TCP"} for n, p in ports],
            "endpoints": [
                {
                    "addresses": [ip],
                    "conditions": {"ready": True},
                    "targetRef": {"kind": "Pod", "name": f"p{i}"},
                }
                for i, ip in enumerate(IPS)
            ],
        },
    ]


def pool_objects(ns: str) -> list[dict[str, Any]]:
    pool = {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {
            "name": "llama",
            "namespace": ns,
            "annotations": {
                "kinference.buoyant.io/kv-events-port": str(KV),
                "kinference.buoyant.io/kv-replay-port": str(REPLAY),
            },
        },
        "spec": {
            "selector": {"matchLabels": {"app": "llama"}},
            "targetPorts": [{"number": HTTP}],
            "endpointPickerRef": {"name": "extproc", "port": {"number": 9002}},
        },
    }
    pods = [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"p{i}", "namespace": ns, "labels": {"app": "llama"}},
            "spec": {"containers": [{"name": "vllm", "image": "vllm"}]},
        }
        for i in range(len(IPS))
    ]
    return [pool, *pods]


def mark_ready(env: KubeEnv, ns: str) -> None:
    for i, ip in enumerate(IPS):
        status = {
            "status": {
                "podIP": ip,
                "podIPs": [{"ip": ip}],
                "conditions": [{"type": "Ready", "status": "True"}],
            }
        }
        env.kubectl(
            "patch",
            "pod",
            f"p{i}",
            "-n",
            ns,
            "--subresource=status",
            "--type=merge",
            "-p",
            json.dumps(status),
        )


@contextlib.asynccontextmanager
async def engines() -> AsyncIterator[list[str]]:
    procs = []
    try:
        for ip in IPS:
            argv = ["--listen", f"{ip}:{HTTP}", "--model", MODEL, "--kv-events-port", str(KV)]
            argv += ["--kv-replay-port", str(REPLAY), "--time-scale", "0.05"]
            procs.append(
                await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "extproc",
                    "--log-level",
                    "warning",
                    "sim",
                    *argv,
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.DEVNULL,
                )
            )
        for ip in IPS:
            await wait_http(f"http://{ip}:{HTTP}/health")
        yield [f"{ip}:{HTTP}" for ip in IPS]
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()


@contextlib.asynccontextmanager
async def serve(env: KubeEnv, args: list[str], tmp: Path) -> AsyncIterator[tuple[int, str, int]]:
    grpc_port, admin_port = free_port(), free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "extproc", "--log-level", "warning", "serve", "--source", "kube",
        "--kubeconfig", str(env.kubeconfig), "--listen", f"127.0.0.1:{grpc_port}",
        "--admin-listen", f"127.0.0.1:{admin_port}", "--tokenizer", f"{MODEL}=extproc:tiny", *args,
        stdout=asyncio.subprocess.DEVNULL, stderr=(tmp / "serve.log").open("ab"),
    )  # fmt: skip
    try:
        admin = f"http://127.0.0.1:{admin_port}"
        await wait_http(f"{admin}/readyz")
        async with aiohttp.ClientSession() as session:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # the pool's models are discovered, the index synced
                async with session.get(f"{admin}/debug/state") as resp:
                    state = await resp.json()
                if MODEL in state["catalog"]["routes"]:
                    break
                await asyncio.sleep(0.1)
            else:
                raise RuntimeError("the model never got a route")
        config = render_config(
            load_config(shipped_config("gateway-original-dst.yaml")),
            listen_port=(listen := free_port()),
            admin_port=free_port(),
            extproc_address=("127.0.0.1", grpc_port),
            pool_endpoints=None,
            body_mode="FULL_DUPLEX_STREAMED",
        )
        async with EnvoyProcess(config, log_path=tmp / "envoy.log"):
            yield grpc_port, f"http://127.0.0.1:{listen}", proc.pid
    finally:
        proc.terminate()
        await proc.wait()


async def engine_counters(session: aiohttp.ClientSession, addresses: list[str]) -> tuple[float, float]:
    queries = hits = 0.0
    for address in addresses:
        async with session.get(f"http://{address}/metrics") as resp:
            for line in (await resp.text()).splitlines():
                if line.startswith("vllm:prefix_cache_queries_total"):
                    queries += float(line.rsplit(" ", 1)[1])
                elif line.startswith("vllm:prefix_cache_hits_total"):
                    hits += float(line.rsplit(" ", 1)[1])
    return queries, hits


async def conversations(url: str, addresses: list[str]) -> dict[str, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        for address in addresses:
            async with session.post(f"http://{address}/reset_prefix_cache") as resp:
                assert resp.status == 200, await resp.text()
        await asyncio.sleep(0.5)  # the resets' events reach the index
        before = await engine_counters(session, addresses)
        latencies: list[float] = []
        queue: asyncio.Queue[int] = asyncio.Queue()
        for c in range(CONVERSATIONS):
            queue.put_nowait(c)

        async def worker() -> None:
            while not queue.empty():
                c = queue.get_nowait()
                system = f"You are assistant {c}. " + " ".join(f"rule {c}-{i} applies." for i in range(120))
                messages = [{"role": "system", "content": system}]
                for turn in range(TURNS):
                    messages.append({"role": "user", "content": f"question {turn} of conversation {c}"})
                    body = {"model": MODEL, "messages": messages, "max_tokens": 8}
                    started = time.perf_counter()
                    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
                        answer = await resp.json()
                        assert resp.status == 200, answer
                    latencies.append(time.perf_counter() - started)
                    messages.append(
                        {"role": "assistant", "content": answer["choices"][0]["message"]["content"]}
                    )

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
        after = await engine_counters(session, addresses)
    latencies.sort()
    queries, hits = after[0] - before[0], after[1] - before[1]
    return {
        "requests": len(latencies),
        "hit_rate": round(hits / queries, 4) if queries else None,
        "latency_p50_ms": round(statistics.median(latencies) * 1000, 2),
        "latency_p99_ms": round(latencies[int(0.99 * (len(latencies) - 1))] * 1000, 2),
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(args.tmp)
    await asyncio.to_thread(tmp.mkdir, parents=True, exist_ok=True)
    env = KubeEnv()
    env.start()
    results: dict[str, Any] = {"machine": machine(), "rounds": []}
    try:
        env.kubectl("apply", "--validate=false", "-f", str(POOL_CRD))  # v1.20 lacks CEL rules
        env.wait_crd("inferencepools.inference.networking.k8s.io")
        ws_ns, pool_ns, empty_ns = (env.new_namespace(p) for p in ("ws", "pool", "empty"))
        env.kubectl(
            "apply", "-f", "-", input=yaml.safe_dump_all(worker_set_objects(ws_ns) + pool_objects(pool_ns))
        )
        mark_ready(env, pool_ns)
        arms = {
            "worker set": ["--namespaces", ws_ns],
            "InferencePool": ["--namespaces", empty_ns, "--pool-name", "llama", "--pool-namespace", pool_ns],
        }
        async with engines() as addresses:
            for round_ in range(ROUNDS):
                # AB BA AB BA: a drift over the run (it exists: the hit rate falls a few points from
                # the first round to the last, whatever the arm) weighs on both arms alike.
                order = list(arms.items()) if round_ % 2 == 0 else list(reversed(arms.items()))
                for name, arm_args in order:
                    print(f"round {round_ + 1}: {name} ...", flush=True)
                    async with serve(env, arm_args, tmp) as (grpc_port, url, pid):
                        quality = await conversations(url, addresses)
                        load = await run_load(
                            f"127.0.0.1:{grpc_port}",
                            concurrency=16,
                            duration=5,
                            body=chat_body(MODEL),
                            server_pid=pid,
                        )
                    results["rounds"].append({"arm": name, "round": round_ + 1, **quality, "load": load})
    finally:
        env.stop()
    return results


def report(r: dict[str, Any]) -> str:
    lines = [
        "# An InferencePool against the same engines as a worker set",
        "",
        provenance(r["machine"]),
        "",
        "`bench/inferencepool.py`: four simulated engines (precise routing: KV events), one `serve` per "
        "arm on a real API server, arms alternated AB BA AB BA. Quality: "
        f"{CONVERSATIONS} conversations x {TURNS} turns through Envoy, {CONCURRENCY} at a time, the "
        "engines' own prefix-cache hit rate. Decisions/s: the gRPC load client, 16 streams, 5 s.",
        "",
        "| arm | round | requests | engines' hit rate | latency p50 | p99 | decisions/s | decision p50 | "
        "p99 |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for arm in dict.fromkeys(row["arm"] for row in r["rounds"]):
        rows = [row for row in r["rounds"] if row["arm"] == arm]
        hit = statistics.fmean(row["hit_rate"] for row in rows)
        rate = statistics.fmean(row["load"]["per_s"] for row in rows)
        lines.insert(
            -2, f"- {arm}: mean hit rate {hit:.1%}, mean decisions/s {rate:.0f} over {len(rows)} runs."
        )
    lines.insert(-2, "")
    for row in r["rounds"]:
        load = row["load"]
        lines.append(
            f"| {row['arm']} | {row['round']} | {row['requests']} | {row['hit_rate']:.1%} | "
            f"{row['latency_p50_ms']} ms | {row['latency_p99_ms']} ms | {load['per_s']:.0f} | "
            f"{load['latency']['p50_ms']:.2f} ms | {load['latency']['p99_ms']:.2f} ms |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tmp", default="/tmp/inferencepool-bench")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "inferencepool.json")
    args = parser.parse_args()
    record(args.out, asyncio.run(main_async(args)), report)


if __name__ == "__main__":
    main()
