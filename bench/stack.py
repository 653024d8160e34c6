"""Child processes for the end-to-end benchmarks: simulated engines, `serve`, and a gateway config.

Each is a real process on loopback ports chosen up front, so a restarted engine comes back at the
same address. Their logs go nowhere unless asked (the harness's own output stays readable).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import aiohttp

from extproc.demo.catalog import LocalObjective, LocalWorkerSet, catalog_yaml
from extproc.gateway.config import load_config, render_config, shipped_config

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from ports import free_port

MODEL = "llama-3-8b"


@dataclass(slots=True)
class SimEngine:
    """One ``extproc sim`` process (KV events with replay) serving :data:`MODEL`."""

    extra_args: Sequence[str] = ("--default-output-tokens", "16")
    port: int = field(default_factory=free_port)
    kv_port: int = field(default_factory=free_port)
    replay_port: int = field(default_factory=free_port)
    proc: asyncio.subprocess.Process | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "extproc", "--log-level", "warning", "sim",
            "--listen", self.address, "--model", MODEL,
            "--kv-events-port", str(self.kv_port), "--kv-replay-port", str(self.replay_port),
            *self.extra_args,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        await wait_http(f"http://{self.address}/health")

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def send_signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
        if self.proc is not None:
            await self.proc.wait()


@dataclass(slots=True)
class ServeProcess:
    """``extproc serve`` on the catalog file, routing precisely (a tokenizer for the model)."""

    catalog: Path
    extra_args: Sequence[str] = ()
    log: IO[bytes] | None = None
    #: ``--tokenizer MODEL=SOURCE``: the simulator's own by default, so routing is precise.
    tokenizer: str = f"{MODEL}=extproc:tiny"
    #: How Python runs it: ``-m extproc``, or a script that wraps it (bench/memtrace.py).
    launcher: Sequence[str] = ("-m", "extproc")
    grpc_port: int = field(default_factory=free_port)
    admin_port: int = field(default_factory=free_port)
    #: Extra environment (e.g. ``PYTHONPATH`` of another checkout, for a before/after run).
    env: Mapping[str, str] | None = None
    proc: asyncio.subprocess.Process | None = None

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, *self.launcher, "--log-level", "warning", "serve",
            "--source", f"file:{self.catalog}", "--listen", f"127.0.0.1:{self.grpc_port}",
            "--admin-listen", f"127.0.0.1:{self.admin_port}",
            "--tokenizer", self.tokenizer, *self.extra_args,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=self.log if self.log is not None else asyncio.subprocess.DEVNULL,
            env=None if self.env is None else {**os.environ, **self.env},
        )  # fmt: skip
        await wait_http(f"{self.admin_url}/readyz")

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


async def wait_http(url: str, within: float = 30.0) -> None:
    """Until ``url`` answers 200; RuntimeError after ``within`` seconds."""
    deadline = time.monotonic() + within
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as session:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(url) as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not answer 200 within {within} s")


@contextlib.asynccontextmanager
async def engines_started(
    count: int, extra_args: Sequence[str] | None = None
) -> AsyncIterator[list[SimEngine]]:
    engines = [SimEngine() if extra_args is None else SimEngine(extra_args) for _ in range(count)]
    try:
        await asyncio.gather(*(e.start() for e in engines))
        yield engines
    finally:
        await asyncio.gather(*(e.stop() for e in engines))


def write_catalog(
    path: Path, engines: Sequence[SimEngine], objectives: Sequence[LocalObjective] = ()
) -> Path:
    """One worker set of :data:`MODEL` over ``engines``, declaring their KV-event ports (and
    ``objectives`` for it)."""
    path.write_text(
        catalog_yaml(
            [
                LocalWorkerSet(
                    "llama",
                    MODEL,
                    [e.address for e in engines],
                    kv_ports={e.address: (e.kv_port, e.replay_port) for e in engines},
                )
            ],
            objectives,
        )
    )
    return path


def gateway(
    config_name: str, serve: ServeProcess, engines: Sequence[SimEngine]
) -> tuple[dict[str, Any], int, int]:
    """A shipped Envoy config for these processes: (config, listen port, admin port)."""
    listen, admin = free_port(), free_port()
    original_dst = "original-dst" in config_name
    config = render_config(
        load_config(shipped_config(config_name)),
        listen_port=listen,
        admin_port=admin,
        extproc_address=("127.0.0.1", serve.grpc_port),
        pool_endpoints=None if original_dst else [("127.0.0.1", e.port) for e in engines],
        body_mode="FULL_DUPLEX_STREAMED",
    )
    return config, listen, admin


def keep_http_filters(config: Any, keep: Callable[[dict[str, Any]], bool]) -> None:
    """Keep only the HTTP filters ``keep`` accepts, in every filter chain of a rendered Envoy config."""
    if isinstance(config, dict):
        for key, value in config.items():
            if key == "http_filters" and isinstance(value, list):
                value[:] = [f for f in value if keep(f)]
            else:
                keep_http_filters(value, keep)
    elif isinstance(config, list):
        for value in config:
            keep_http_filters(value, keep)


def is_accounting_filter(http_filter: dict[str, Any]) -> bool:
    """The ext_proc filter in observability mode (the shipped configs' in-flight accounting)."""
    return "observability_mode" in json.dumps(http_filter)
