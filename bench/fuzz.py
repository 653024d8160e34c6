"""Structure-aware fuzzing of `serve`: malformed and adversarial ext_proc streams, straight to the
gRPC port and through real Envoy in both body modes. The bar: no answer is a 500 (a bug), no
in-flight count leaks, and `serve` is still routing at the end.

Streams straight to the port mix wrong message orders (bodies before or after the end, headers
twice, response messages first, nothing at all), hostile JSON (nesting near and past every parser's
limit, invalid UTF-8, huge and control-character model names, duplicate keys, NaN), hostile tool
calls, and odd headers (paths, methods, request ids with CR/LF, subset hints). Requests through
Envoy use the same bodies and headers over HTTP. Seeded: the same seed sends the same streams.

    python bench/fuzz.py [--streams 100000] [--http 5000] [--seed 1]

Writes ``bench/results/fuzz.{json,md}``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import orjson
from machine import machine, provenance, record

from extproc.demo.backends import Backend
from extproc.demo.catalog import LocalWorkerSet, catalog_yaml
from extproc.gateway.config import load_config, render_config, shipped_config
from extproc.gateway.process import EnvoyProcess
from extproc.pb.envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from extproc.pb.envoy.service.ext_proc.v3 import external_processor_pb2 as ep

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
from ports import free_port  # noqa: E402

MODEL, ALIAS = "bench-model", "bench-alias"
PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"


# -- what is sent -----------------------------------------------------------------------------------


def hostile_bodies(rng: random.Random) -> list[bytes]:
    """Bodies a client could send; every one must get a 4xx or be routed, never a 500."""
    chat = {"model": ALIAS, "messages": [{"role": "user", "content": "hi"}]}
    deep = rng.choice([254, 255, 300, 1000, 1023, 1024, 5000])
    tool_args = "[" * rng.choice([100, 10_000, 100_000])
    return [
        orjson.dumps(chat),
        orjson.dumps({**chat, "model": MODEL}),
        orjson.dumps(chat)[:-1] + b', "x": ' + b"[" * deep + b"]" * deep + b"}",
        b'{"model": "' + ALIAS.encode() + b'", "messages": ' + b"[" * deep + b"]" * deep + b"}",
        b"",
        b"{",
        b"\xff\xfe\x00garbage",
        b"[1, 2, 3]",
        b'"just a string"',
        b'{"model": null}',
        b'{"model": 5, "messages": []}',
        orjson.dumps({"model": "m" * rng.choice([1000, 100_000, 1_000_000])}),
        orjson.dumps({"model": "bad\r\nlevel=ERROR forged\x00"}),
        b'{"model": "' + ALIAS.encode() + b'", "model": "' + MODEL.encode() + b'", "messages": []}',
        b'{"model": "' + ALIAS.encode() + b'", "temperature": NaN}',
        orjson.dumps(chat)[:-1] + b', "max_tokens": 1' + b"0" * 30 + b"}",
        orjson.dumps({**chat, "max_tokens": -1}),
        orjson.dumps(
            {
                "model": ALIAS,
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"function": {"name": "f", "arguments": tool_args}}],
                    },
                    {"role": "user", "content": "x"},
                ],
            }
        ),
        orjson.dumps(
            {"model": ALIAS, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}
        ),
        orjson.dumps({"model": MODEL, "prompt": [[1, 2], [3]]}),
        orjson.dumps({"model": MODEL, "prompt": ["a"] * 3}),
        orjson.dumps({**chat, "tools": {"not": "a list"}, "chat_template_kwargs": 7}),
    ]


HEADER_SETS: list[dict[str, str]] = [
    {":method": "POST", ":path": "/v1/chat/completions"},
    {":method": "POST", ":path": "/v1/completions?x=1"},
    {":method": "POST", ":path": "/v1/chat/completions/"},
    {":method": "POST", ":path": ""},
    {":method": "GET", ":path": "/v1/models"},
    {":method": "GET", ":path": "/v1/models/" + "%FF" * 50},
    {":method": "DELETE", ":path": "/v1/chat/completions"},
    {":method": "POST", ":path": "/" + "a" * 10_000},
    {":method": "POST", ":path": "/v1/chat/completions", "x-request-id": "r\r\nlevel=ERROR forged"},
    {":method": "POST", ":path": "/v1/chat/completions", "x-request-id": "r" * 100_000},
    {},
]


def headers_message(
    headers: dict[str, str], *, eos: bool, mode: int, subset: Any = None
) -> ep.ProcessingRequest:
    request = ep.ProcessingRequest()
    request.protocol_config.request_body_mode = mode  # type: ignore[assignment]
    for key, value in headers.items():
        header = request.request_headers.headers.headers.add()
        header.key, header.raw_value = key, value.encode()
    request.request_headers.end_of_stream = eos
    if subset is not None:
        namespace = request.metadata_context.filter_metadata["envoy.lb.subset_hint"]
        namespace.update({"x-gateway-destination-endpoint-subset": subset})
    return request


def body_message(data: bytes, *, eos: bool) -> ep.ProcessingRequest:
    request = ep.ProcessingRequest()
    request.request_body.body = data
    request.request_body.end_of_stream = eos
    return request


def other_message(kind: str) -> ep.ProcessingRequest:
    request = ep.ProcessingRequest()
    getattr(request, kind).SetInParent()
    return request


def body_pool(seed: int, variants: int = 8) -> list[bytes]:
    """Every hostile body, in a few random variants, built once (some are megabytes)."""
    return [body for n in range(variants) for body in hostile_bodies(random.Random(seed + n))]


def adversarial_stream(rng: random.Random, bodies: list[bytes]) -> list[ep.ProcessingRequest]:
    """One stream: a well-formed prefix, then mutations in order, content and repetition."""
    mode = rng.choice([pm.ProcessingMode.BUFFERED, pm.ProcessingMode.FULL_DUPLEX_STREAMED])
    headers = dict(rng.choice(HEADER_SETS))
    body = rng.choice(bodies)
    subset = rng.choice([None, None, [], ["10.9.9.9:1"], "127.0.0.1,garbage", [""]])
    bodiless = rng.random() < 0.15
    messages = [headers_message(headers, eos=bodiless, mode=mode, subset=subset)]
    if not bodiless:
        cut = rng.randrange(len(body) + 1) if body else 0
        messages += [body_message(body[:cut], eos=False), body_message(body[cut:], eos=True)]
    shape = rng.random()
    if shape < 0.10:
        messages.insert(0, body_message(body, eos=True))  # a body before the headers
    elif shape < 0.20:
        messages.append(headers_message(headers, eos=True, mode=mode))  # headers twice
    elif shape < 0.30:
        messages.append(body_message(b"after the end", eos=True))
    elif shape < 0.40:
        messages.insert(
            0, other_message(rng.choice(["response_headers", "response_trailers", "request_trailers"]))
        )
    elif shape < 0.45:
        messages = []
    elif shape < 0.50:
        messages.append(other_message("request_trailers"))
    if rng.random() < 0.3:
        messages.append(other_message("response_headers"))
    return messages


# -- running it -------------------------------------------------------------------------------------


async def fuzz_grpc(
    target: str, streams: int, rng: random.Random, bodies: list[bytes], concurrency: int = 32
) -> Counter[str]:
    """Send ``streams`` adversarial streams; count outcomes (``http_500`` and ``grpc_*`` are bugs)."""
    outcomes: Counter[str] = Counter()
    pending = iter(range(streams))
    async with grpc.aio.insecure_channel(target) as channel:
        call_of = channel.stream_stream(
            PROCESS,
            request_serializer=ep.ProcessingRequest.SerializeToString,
            response_deserializer=ep.ProcessingResponse.FromString,
        )

        async def worker() -> None:
            for _ in pending:
                messages = adversarial_stream(rng, bodies)
                call = call_of(None, timeout=10)
                try:
                    with contextlib.suppress(asyncio.InvalidStateError):
                        # serve may end a stream once its answer said all (Envoy stops there too)
                        for message in messages:
                            await call.write(message)
                        await call.done_writing()
                    answers = [a async for a in call]
                except grpc.aio.AioRpcError as exc:
                    outcomes[f"grpc_{exc.code().name}"] += 1
                    continue
                statuses = [
                    a.immediate_response.status.code for a in answers if a.HasField("immediate_response")
                ]
                if 500 in statuses:
                    outcomes["http_500"] += 1
                elif statuses:
                    outcomes[f"http_{statuses[0]}"] += 1
                else:
                    outcomes["routed_or_acknowledged"] += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes


async def fuzz_http(
    url: str,
    requests: int,
    rng: random.Random,
    bodies: list[bytes],
    examples: list[str],
    concurrency: int = 8,
) -> Counter[str]:
    """Send ``requests`` hostile HTTP requests; count statuses, keep a few 5xx answers in ``examples``."""
    outcomes: Counter[str] = Counter()
    pending = iter(range(requests))
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def worker() -> None:
            for _ in pending:
                body = rng.choice(bodies)
                path = rng.choice(["/v1/chat/completions", "/v1/completions", "/v1/models", "/x"])
                headers = {"content-type": "application/json"}
                if rng.random() < 0.2:
                    headers["x-gateway-destination-endpoint"] = "127.0.0.1:1"  # never honoured
                try:
                    method = "GET" if path == "/v1/models" else "POST"
                    async with session.request(method, url + path, data=body, headers=headers) as resp:
                        answer = await resp.read()
                        outcomes[f"http_{resp.status}"] += 1
                        if resp.status >= 500 and len(examples) < 5:
                            examples.append(
                                f"{resp.status} {method} {path} {body[:60]!r} -> {answer[:120]!r}"
                            )
                except aiohttp.ClientError as exc:
                    outcomes[f"client_{type(exc).__name__}"] += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes


async def inflight_total(admin: str, *, within: float = 10.0) -> int:
    """serve's in-flight total once it is 0, or after ``within`` seconds (a leak never gets there)."""
    deadline = time.monotonic() + within
    async with aiohttp.ClientSession() as session:
        while True:
            async with session.get(f"{admin}/debug/state") as resp:
                total = sum((await resp.json())["inflight"].values())
            if total == 0 or time.monotonic() > deadline:
                return int(total)
            await asyncio.sleep(0.1)


async def measure(streams: int, http: int, seed: int) -> dict[str, Any]:
    rng, bodies = random.Random(seed), body_pool(seed)
    backends = [Backend(f"b{i}") for i in range(2)]
    for backend in backends:
        await backend.start()
    tmp = Path(tempfile.mkdtemp(prefix="extproc-fuzz-"))
    catalog = tmp / "catalog.yaml"
    addresses = [f"127.0.0.1:{b.port}" for b in backends]
    catalog.write_text(catalog_yaml([LocalWorkerSet("bench", MODEL, addresses, aliases=[ALIAS])]))
    grpc_port, admin_port = free_port(), free_port()
    serve = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "extproc", "--log-level", "error", "serve", "--source", f"file:{catalog}",
        "--listen", f"127.0.0.1:{grpc_port}", "--admin-listen", f"127.0.0.1:{admin_port}",
    )  # fmt: skip
    admin = f"http://127.0.0.1:{admin_port}"
    results: dict[str, Any] = {"machine": machine(), "seed": seed}
    try:
        await asyncio.sleep(2.0)
        started = time.monotonic()
        results["grpc"] = dict(await fuzz_grpc(f"127.0.0.1:{grpc_port}", streams, rng, bodies))
        results["grpc_seconds"] = round(time.monotonic() - started, 1)
        results["grpc_inflight_after"] = await inflight_total(admin)
        results["http"] = {}
        examples: list[str] = []
        results["http_5xx_examples"] = examples
        for mode in ("FULL_DUPLEX_STREAMED", "BUFFERED"):
            listen = free_port()
            config = render_config(
                load_config(shipped_config("gateway.yaml")),
                listen_port=listen,
                admin_port=free_port(),
                extproc_address=("127.0.0.1", grpc_port),
                pool_endpoints=[("127.0.0.1", b.port) for b in backends],
                body_mode=mode,
            )
            async with EnvoyProcess(config):
                results["http"][mode] = dict(
                    await fuzz_http(f"http://127.0.0.1:{listen}", http, rng, bodies, examples)
                )
        results["http_inflight_after"] = await inflight_total(admin)
        async with aiohttp.ClientSession() as session, session.get(f"{admin}/debug/state") as resp:
            state = await resp.json()
        results["inflight_left"] = state["inflight"]
        results["lease_handover"] = state["leaseHandover"]
        async with aiohttp.ClientSession() as session, session.get(f"{admin}/metrics") as resp:
            metrics = await resp.text()
        results["streams_active_at_end"] = next(
            (
                float(line.split()[-1])
                for line in metrics.splitlines()
                if line.startswith("extproc_streams_active ")
            ),
            None,
        )
        async with aiohttp.ClientSession() as session, session.get(f"{admin}/readyz") as resp:
            results["ready_at_end"] = resp.status == 200
    finally:
        serve.terminate()
        await serve.wait()
        for backend in backends:
            await backend.stop()
    return results


def report(results: dict[str, Any]) -> str:
    m = results["machine"]
    grpc_bugs = results["grpc"].get("http_500", 0) + sum(
        n for k, n in results["grpc"].items() if k in ("grpc_UNKNOWN", "grpc_INTERNAL")
    )
    http_500 = sum(outcomes.get("http_500", 0) for outcomes in results["http"].values())
    lines = [
        "# Fuzz: malformed and adversarial ext_proc streams",
        "",
        f"{provenance(m)}; seed {results['seed']}.",
        "",
        f"- **Straight to the gRPC port**: {sum(results['grpc'].values()):,} streams in "
        f"{results['grpc_seconds']} s; answers that were 500 or a gRPC UNKNOWN/INTERNAL: **{grpc_bugs}**; "
        f"in-flight total afterwards (within 10 s): **{results['grpc_inflight_after']}**.",
        f"- **Through Envoy** (both body modes): answers 500: **{http_500}**; in-flight total afterwards: "
        f"**{results['http_inflight_after']}**; `serve` ready at the end: {results['ready_at_end']}.",
        "",
        "| where | outcome | count |",
        "|---|---|--:|",
    ]
    for outcome, count in sorted(results["grpc"].items()):
        lines.append(f"| gRPC port | {outcome} | {count} |")
    for mode, outcomes in results["http"].items():
        for outcome, count in sorted(outcomes.items()):
            lines.append(f"| Envoy {mode} | {outcome} | {count} |")
    lines += [
        "",
        "`routed_or_acknowledged`: streams the picker answered without an error of its own (routed, or a",
        "stream that ended before a decision). `grpc_INVALID_ARGUMENT`: bytes that are no ProcessingRequest.",
        "Envoy's own answers (e.g. 404 from the backend for an unknown path) count under their status.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=100_000)
    p.add_argument("--http", type=int, default=5_000, help="requests through Envoy, per body mode")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=HERE / "results" / "fuzz.json")
    args = p.parse_args()
    results = asyncio.run(measure(args.streams, args.http, args.seed))
    record(args.out, results, report)


if __name__ == "__main__":
    main()
