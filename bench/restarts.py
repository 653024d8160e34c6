"""What `serve` restarts cost clients, through real Envoy: killed mid-response, and rolling restarts.

1. **Kill mid-response** (one `serve`, per Envoy ext_proc variant and body mode): a streaming chat
   (40 SSE chunks, 50 ms apart) starts; right after the first chunk (within ~0.1 s of the response
   headers), or after 3 chunks, `serve` gets SIGKILL. Recorded: whether the client still received
   the whole response, and what a new request gets while `serve` is down.
   Variants: the shipped configs (the routing stream ends with the response headers; an
   accounting filter in observability mode counts the request until the response ends), the same
   with the routing filter fail open, and "before": one filter whose stream stays open until the
   response ends (response trailers sent), as the configs were until this benchmark.
2. **Rolling restart** (two `serve` replicas behind the shipped gateway config): 8 closed-loop
   clients send short streaming chats while each replica in turn gets SIGTERM, exits, and is
   started again. Recorded: requests that failed (status not 200), responses cut short, and
   requests sent in all. `serve` drains on SIGTERM (NOT_SERVING, still serving new streams for
   --drain-seconds), and Envoy's active health check moves new streams to the other replica.

Everything runs on 127.0.0.1 (fake OpenAI backends in this process, `serve` and Envoy as
children), bounded in time; every process is stopped at the end. Writes
``bench/results/restarts.{json,md}`` (``--out`` to write elsewhere).

    python bench/restarts.py
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
from machine import machine, provenance, record

from extproc.demo.backends import Backend
from extproc.demo.catalog import LocalWorkerSet, catalog_yaml
from extproc.gateway.config import BodyMode, load_config, render_config, shipped_config
from extproc.gateway.process import EnvoyProcess

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
from ports import free_port  # noqa: E402

MODEL = "llama-3-8b"
BODY = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
EXT_PROC = "envoy.filters.http.ext_proc"
#: The shipped configs' in-flight accounting filter (observability mode).
ACCOUNTING = "extproc-accounting"


# -- processes ------------------------------------------------------------------------------------


@dataclass(slots=True)
class Serve:
    """One `extproc serve` child process on a fixed gRPC port."""

    grpc_port: int
    catalog: Path
    drain_seconds: float = 5.0
    proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "extproc", "--log-level", "warning", "serve",
            "--source", f"file:{self.catalog}", "--listen", f"127.0.0.1:{self.grpc_port}",
            "--admin-listen", f"127.0.0.1:{free_port()}", "--scrape-interval", "0",
            "--drain-seconds", f"{self.drain_seconds:g}",
        )  # fmt: skip
        await _wait_listening(self.grpc_port)

    def signal(self, signum: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(signum)

    async def wait(self) -> int:
        assert self.proc is not None
        return await self.proc.wait()

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


async def _wait_listening(port: int, within: float = 15.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        await asyncio.sleep(0.05)
    raise RuntimeError(f"serve did not listen on {port} within {within} s")


def gateway_config(
    grpc_ports: list[int], backend_port: int, *, mode: BodyMode, variant: str
) -> tuple[dict[str, Any], int]:
    """The shipped gateway.yaml for these ports, its ext_proc filter changed as ``variant`` says."""
    listen = free_port()
    config = render_config(
        load_config(shipped_config("gateway.yaml")),
        listen_port=listen,
        admin_port=free_port(),
        extproc_address=("127.0.0.1", grpc_ports[0]),
        pool_endpoints=[("127.0.0.1", backend_port)],
        body_mode=mode,
    )
    resources = config["static_resources"]
    extproc = next(c for c in resources["clusters"] if c["name"] == "extproc")
    template = extproc["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
    extproc["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
        {
            **copy.deepcopy(template),
            "endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}},
        }
        for p in grpc_ports
    ]
    hcm = resources["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc = next(f for f in hcm["http_filters"] if f["name"] == EXT_PROC)["typed_config"]
    if variant == "fail-open":
        ext_proc["failure_mode_allow"] = True
    elif variant == "before":
        # One filter that keeps its stream open until the response ends (the config before the
        # accounting filter existed).
        ext_proc["processing_mode"]["response_trailer_mode"] = "SEND"
        hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != ACCOUNTING]
    return config, listen


def _loopback(port: int) -> dict[str, Any]:
    return {"address": "127.0.0.1", "port_value": port}


@contextlib.asynccontextmanager
async def backend() -> AsyncIterator[Backend]:
    server = Backend("b1", chunk_delay=0.05, chunks=40)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def write_catalog(directory: Path, backend_port: int) -> Path:
    path = directory / "catalog.yaml"
    path.write_text(catalog_yaml([LocalWorkerSet("llama", MODEL, [f"127.0.0.1:{backend_port}"])]))
    return path


# -- 1. kill mid-response -------------------------------------------------------------------------


async def stream_once(
    session: aiohttp.ClientSession, url: str, on_chunk: Any = None
) -> tuple[int, int, bool]:
    """(status, SSE data lines received, finished with [DONE]); a cut shows as done False."""
    chunks, done = 0, False
    try:
        async with session.post(url, json=BODY) as resp:
            async for line in resp.content:
                if line.startswith(b"data:"):
                    chunks += 1
                    done = done or b"[DONE]" in line
                    if on_chunk is not None:
                        on_chunk(chunks)
            return resp.status, chunks, done
    except aiohttp.ClientError:
        return -1, chunks, False


#: Chunks the client has received when serve is killed: right after the response headers, and
#: ~0.1 s later (a routing stream Envoy has not ended by then, serve ends itself: CLOSE_WAIT_S).
KILL_AFTER_CHUNKS = (1, 3)


async def kill_mid_response(
    mode: BodyMode, variant: str, workdir: Path, *, kill_after: int
) -> dict[str, Any]:
    async with backend() as pool:
        serve = Serve(free_port(), write_catalog(workdir, pool.port))
        await serve.start()
        config, listen = gateway_config([serve.grpc_port], pool.port, mode=mode, variant=variant)
        try:
            async with EnvoyProcess(config) as _, aiohttp.ClientSession() as session:
                url = f"http://127.0.0.1:{listen}/v1/chat/completions"
                await stream_once(session, url)  # warm: the gRPC connection is up

                def kill_at(count: int) -> None:
                    if count == kill_after:
                        serve.signal(signal.SIGKILL)

                status, chunks, done = await stream_once(session, url, kill_at)
                await serve.wait()
                async with session.post(url, json={**BODY, "stream": False}) as resp:
                    while_down = resp.status
        finally:
            await serve.stop()
    return {
        "body_mode": mode,
        "variant": variant,
        "killed_after_chunks": kill_after,
        "status": status,
        "chunks": chunks,
        "completed": done,
        "new_request_while_down": while_down,
    }


# -- 2. rolling restart ---------------------------------------------------------------------------


@dataclass(slots=True)
class Tally:
    sent: int = 0
    ok: int = 0
    failed: int = 0
    cut: int = 0


async def client(session: aiohttp.ClientSession, url: str, tally: Tally, stop: asyncio.Event) -> None:
    while not stop.is_set():
        tally.sent += 1
        status, _, done = await stream_once(session, url)
        if status != 200:
            tally.failed += 1
        elif not done:
            tally.cut += 1
        else:
            tally.ok += 1


async def rolling_restart(
    mode: BodyMode, workdir: Path, *, drain_seconds: float, clients: int = 8
) -> dict[str, Any]:
    async with backend() as pool:
        catalog = write_catalog(workdir, pool.port)
        replicas = [Serve(free_port(), catalog, drain_seconds), Serve(free_port(), catalog, drain_seconds)]
        for replica in replicas:
            await replica.start()
        config, listen = gateway_config(
            [r.grpc_port for r in replicas], pool.port, mode=mode, variant="shipped"
        )
        tally, stop = Tally(), asyncio.Event()
        started = time.monotonic()
        try:
            async with EnvoyProcess(config) as _, aiohttp.ClientSession() as session:
                url = f"http://127.0.0.1:{listen}/v1/chat/completions"
                await asyncio.sleep(3)  # Envoy's first health checks mark both replicas healthy
                tasks = [asyncio.create_task(client(session, url, tally, stop)) for _ in range(clients)]
                await asyncio.sleep(2)
                for replica in replicas:
                    replica.signal(signal.SIGTERM)
                    await asyncio.wait_for(replica.wait(), 30)
                    await replica.start()
                    await asyncio.sleep(3)  # healthy again before the next one goes
                stop.set()
                await asyncio.gather(*tasks)
        finally:
            for replica in replicas:
                await replica.stop()
    seconds = round(time.monotonic() - started, 1)
    return {
        "body_mode": mode,
        "drain_seconds": drain_seconds,
        "clients": clients,
        "seconds": seconds,
        **asdict(tally),
    }


# -- main -----------------------------------------------------------------------------------------


def report(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [
        "# Restarts: what `serve` going away costs clients (through real Envoy)",
        "",
        f"{provenance(m)}. Envoy, `serve`, the fake backend and the clients share the cores on loopback.",
        "",
        "## 1. `serve` SIGKILLed while a response streams (40 chunks, 50 ms apart)",
        "",
        "Killed after 1 chunk: within ~0.1 s of the response headers. After 3: ~0.1 s later, when serve",
        "has ended by itself a routing stream that Envoy left open (`CLOSE_WAIT_S`).",
        "",
        "| body mode | ext_proc variant | killed after (chunks) | response completed | chunks received "
        "| new request while down |",
        "|---|---|--:|---|--:|--:|",
    ]
    for row in results["kill"]:
        lines.append(
            f"| {row['body_mode']} | {row['variant']} | {row.get('killed_after_chunks', 3)} | "
            f"{'yes' if row['completed'] else '**no**'} | {row['chunks']} | {row['new_request_while_down']} |"
        )
    lines += [
        "",
        "## 2. Rolling restart of two replicas (SIGTERM, drain, start again; one after the other)",
        "",
        "`--drain-seconds 0` is how `serve` stopped before draining existed: it refused new streams at once.",
        "",
        "| body mode | --drain-seconds | clients | seconds | requests | ok | failed | cut short |",
        "|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for row in results["rolling"]:
        lines.append(
            f"| {row['body_mode']} | {row['drain_seconds']:g} | {row['clients']} | {row['seconds']} | "
            f"{row['sent']} | {row['ok']} | {row['failed']} | {row['cut']} |"
        )
    return "\n".join(lines) + "\n"


async def measure() -> dict[str, Any]:
    results: dict[str, Any] = {"machine": machine(), "kill": [], "rolling": []}
    with tempfile.TemporaryDirectory(prefix="extproc-restarts-") as tmp:
        workdir = Path(tmp)
        for mode in ("FULL_DUPLEX_STREAMED", "BUFFERED"):
            for variant in ("shipped", "fail-open", "before"):
                for kill_after in KILL_AFTER_CHUNKS:
                    row = await kill_mid_response(mode, variant, workdir, kill_after=kill_after)
                    print(json.dumps(row), file=sys.stderr)
                    results["kill"].append(row)
        for mode in ("FULL_DUPLEX_STREAMED", "BUFFERED"):
            for drain in (5.0, 0.0):
                row = await rolling_restart(mode, workdir, drain_seconds=drain)  # type: ignore[arg-type]
                print(json.dumps(row), file=sys.stderr)
                results["rolling"].append(row)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=HERE / "results" / "restarts.json")
    record(p.parse_args().out, asyncio.run(measure()), report)


if __name__ == "__main__":
    main()
