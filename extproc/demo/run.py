"""``extproc demo``: real Envoy + simulated vLLM engines + the ext_proc server, on loopback, live.

The point is to show a newcomer the router working with one command, using the same pieces a real
deployment runs: the shipped ``envoy/gateway.yaml`` (only ports, endpoints and body mode rewritten),
``serve``'s :class:`~extproc.serve.app.Server` reading a file catalog made of the same objects a
cluster holds, and :mod:`extproc.sim` engines that behave like vLLM: they answer to the upstream
model names only (an alias that was not rewritten gets vLLM's 404), tokenize with the model's chat
template, keep a prefix cache, take model time to answer, and publish KV-cache events over ZMQ.
The catalog declares those event ports and the router gets the engines' tokenizer and templates,
so it follows every engine's cache and routes by cached prefix, as ``serve`` does in a cluster.
The engines run in this process, so the live view reads their state directly (no scrape).

Everything is started under one :class:`contextlib.AsyncExitStack`, so whatever fails or stops the
demo (an error, Ctrl-C, ``--duration``), everything that was started is stopped, Envoy included.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import socket
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO, cast

import aiohttp

from extproc.demo.catalog import LocalWorkerSet, catalog_yaml, kv_ports_of
from extproc.demo.view import (
    EndpointRow,
    EngineLine,
    Intro,
    ModelLine,
    Snapshot,
    TrafficStats,
    render_frame,
    render_intro,
    render_line,
)
from extproc.errors import ConfigError, ExtprocError
from extproc.gateway.config import BodyMode, load_config, render_config, shipped_config
from extproc.gateway.process import EnvoyError, EnvoyProcess, envoy_binary
from extproc.serve.app import Server
from extproc.settings import PrefixSettings, ServeSettings, SourceSettings, TokenizerSpec
from extproc.sim.engine_core import EngineParams
from extproc.sim.fleet import SimFleet
from extproc.sim.server import SimServer
from extproc.sim.settings import KVEventSettings, SimSettings
from extproc.telemetry import Metrics
from extproc.tokenize.registry import SHIPPED_TOKENIZER
from extproc.types import EndpointAddress

HOST = "127.0.0.1"
#: A TTY redraws every second; logs get one line every few seconds so they stay readable.
TTY_INTERVAL = 1.0
LOG_INTERVAL = 5.0
#: The engines' defaults model an 8B model on one H100 at real speed (time scale 1): ~6 ms per
#: decode step, so curl's 128 default tokens take ~0.8 s and a stream is visibly a stream. Only the
#: KV cache is smaller (2048 blocks = 32k tokens, a small GPU's worth) so its usage column moves
#: with a handful of requests instead of staying at 0.0%.
_ENGINE = EngineParams(num_gpu_blocks=2048)
_TIME_SCALE = 1.0
#: The whole chain must answer within this after Envoy is LIVE, or something is miswired.
_SELF_CHECK_SECONDS = 10.0
_TRAFFIC_WORKERS = 3
_TRAFFIC_TIMEOUT = 10.0
_HIDE_CURSOR, _SHOW_CURSOR = "\x1b[?25l", "\x1b[?25h"


class DemoError(ExtprocError):
    """The demo could not start or check itself (exit code 1); the message says which part failed."""


@dataclass(frozen=True, slots=True)
class DemoSet:
    """One worker set the demo runs: its name, the model its engines serve, and one alias."""

    name: str
    upstream: str
    alias: str
    #: How many engines serve it (``--backends`` for the llama set).
    engines: int
    #: The shipped chat template the model's real tokenizer config would bring.
    chat_template: str = "llama3"

    def engine_settings(self) -> SimSettings:
        """One engine of this set: loopback on a free port, serving only the upstream name.

        KV events and replay on free ports make the engines publish as ``vllm serve`` with
        ``--kv-events-config`` does; prompt-token details put ``cached_tokens`` in curl's ``usage``.
        """
        return SimSettings(
            listen=f"{HOST}:0",
            model=self.upstream,
            served_model_names=(self.upstream,),
            chat_template=self.chat_template,
            engine=_ENGINE,
            time_scale=_TIME_SCALE,
            enable_prompt_tokens_details=True,
            kv_events=KVEventSettings(port=0, replay_port=0),
        )


@dataclass(frozen=True, slots=True)
class Engine:
    """One running simulated engine and where it publishes KV events.

    The event endpoints are copied at start because a stopped :class:`SimServer` forgets its ranks,
    and a test wants to check afterwards that those ports were closed too.
    """

    worker_set: DemoSet
    server: SimServer
    kv_events: tuple[str, ...]
    kv_replay: tuple[str, ...]

    @property
    def address(self) -> str:
        return self.server.address

    def kv_ports(self) -> tuple[int, int | None]:
        """Rank 0's (PUB port, replay port): what the catalog declares for this endpoint."""
        return kv_ports_of(self.kv_events[0], self.kv_replay[0] or None)


@dataclass(frozen=True, slots=True)
class DemoOptions:
    """Validated flags."""

    port: int
    admin_port: int
    grpc_port: int
    backends: int
    body_mode: BodyMode
    duration: float | None
    traffic: bool

    def sets(self) -> tuple[DemoSet, ...]:
        return (
            DemoSet("llama-3-8b", "meta-llama/Meta-Llama-3-8B-Instruct", "chat", self.backends, "llama3"),
            DemoSet("qwen-2-7b", "Qwen/Qwen2-7B-Instruct", "qwen", 1, "chatml"),
        )


# -- CLI ------------------------------------------------------------------------------------------


def add_demo_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``extproc demo`` to the CLI; :func:`run_demo` is its handler."""
    p = sub.add_parser(
        "demo",
        help="run real Envoy + simulated vLLM engines + the router on loopback, with a live view",
        description="Start Envoy, a few simulated vLLM engines (extproc sim) and the ext_proc router on "
        "127.0.0.1, print curl examples, and show live where requests go and how full each engine is. "
        "Ctrl-C stops everything.",
    )
    p.add_argument("--port", type=int, default=8080, help="gateway listener port (8080)")
    p.add_argument("--admin-port", type=int, default=9901, help="Envoy admin port (9901)")
    p.add_argument("--grpc-port", type=int, default=9002, help="ext_proc gRPC port (9002)")
    p.add_argument("--backends", type=int, default=3, help="engines of the llama worker set (3)")
    p.add_argument(
        "--body-mode",
        choices=["FULL_DUPLEX_STREAMED", "BUFFERED"],
        default="FULL_DUPLEX_STREAMED",
        help="how Envoy sends request bodies to the router (FULL_DUPLEX_STREAMED)",
    )
    p.add_argument("--duration", type=float, default=None, help="stop by itself after SECONDS")
    p.add_argument(
        "--traffic", action="store_true", help="also send a trickle of sample requests, to watch routing"
    )
    p.set_defaults(handler=run_demo)


def demo_options(args: argparse.Namespace) -> DemoOptions:
    """Flags -> options; ConfigError names the flag that is wrong."""
    ports = {"--port": args.port, "--admin-port": args.admin_port, "--grpc-port": args.grpc_port}
    for flag, port in ports.items():
        if not 1 <= port <= 65535:
            raise ConfigError(f"{flag} must be in 1-65535, got {port}")
    by_port: dict[int, str] = {}
    for flag, port in ports.items():
        if port in by_port:
            raise ConfigError(f"{by_port[port]} and {flag} are both {port}; they need different ports")
        by_port[port] = flag
    if not 1 <= args.backends <= 64:
        raise ConfigError(f"--backends must be in 1-64, got {args.backends}")
    if args.duration is not None and not args.duration > 0:
        raise ConfigError(f"--duration must be a positive number of seconds, got {args.duration}")
    return DemoOptions(
        port=args.port,
        admin_port=args.admin_port,
        grpc_port=args.grpc_port,
        backends=args.backends,
        body_mode=cast(BodyMode, args.body_mode),
        duration=args.duration,
        traffic=bool(args.traffic),
    )


def check_ports_free(ports: dict[str, int], host: str = HOST) -> None:
    """ConfigError naming the first taken port and its flag.

    A plain bind (SO_REUSEADDR only, as Envoy and gRPC also set it) fails if anything listens on
    the port, including sockets with SO_REUSEPORT: Envoy and gRPC set that too, so without this
    check a second demo would silently share the first one's ports and traffic.
    """
    for flag, port in ports.items():
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as exc:
                reason = exc.strerror or str(exc)
                raise ConfigError(
                    f"port {port} on {host} is not available ({reason}); "
                    f"it is set by {flag}: pick a free one, e.g. {flag} {_suggest_port()}"
                ) from None


def _suggest_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def _check_setup() -> None:
    """Missing Envoy or config files are the user's setup to fix (exit 2), not a crash."""
    try:
        envoy_binary()
    except EnvoyError as exc:
        raise ConfigError(str(exc)) from None
    try:
        shipped_config("gateway.yaml")
    except FileNotFoundError as exc:
        raise ConfigError(f"{exc} (the demo runs from a source checkout)") from None


# -- the running demo -----------------------------------------------------------------------------


class Demo:
    """Engines, catalog file, router and Envoy, started in that order and stopped in reverse."""

    def __init__(self, options: DemoOptions) -> None:
        self.options = options
        self.url = f"http://{HOST}:{options.port}"
        self.sets = options.sets()
        self.engines: list[Engine] = []
        self.server: Server | None = None
        self.envoy: EnvoyProcess | None = None
        self.started = time.monotonic()
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> Demo:
        try:
            await self._start()
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    async def _start(self) -> None:
        for demo_set in self.sets:
            fleet = SimFleet(demo_set.engine_settings(), replicas=demo_set.engines)
            await self._stack.enter_async_context(fleet)
            self.engines.extend(_engine(demo_set, server) for server in fleet.servers)
        tmpdir = self._stack.enter_context(tempfile.TemporaryDirectory(prefix="extproc-demo-"))
        catalog = Path(tmpdir) / "catalog.yaml"
        catalog.write_text(catalog_yaml(self._worker_sets()), encoding="utf-8")
        await self._start_server(catalog)
        self.envoy = EnvoyProcess(self._envoy_config(), log_path=Path(tmpdir) / "envoy.log")
        # Envoy's own stop runs even if start fails halfway; registering first covers both.
        self._stack.push_async_callback(self.envoy.stop)
        await self.envoy.start()
        await self._self_check()
        self.started = time.monotonic()

    def _worker_sets(self) -> list[LocalWorkerSet]:
        """The catalog: each set with its engines, and where each engine publishes KV events."""
        return [
            LocalWorkerSet(
                name=s.name,
                model=s.upstream,
                aliases=(s.alias,),
                endpoints=[e.address for e in self.engines if e.worker_set == s],
                kv_ports={e.address: e.kv_ports() for e in self.engines if e.worker_set == s},
            )
            for s in self.sets
        ]

    def serve_settings(self, catalog: Path) -> ServeSettings:
        """``serve --source file:CATALOG --tokenizer MODEL=extproc:tiny --chat-template MODEL=T`` for
        every set: the engines' own tokenizer and template, so the router routes precisely."""
        tokenizers = tuple(TokenizerSpec(s.upstream, SHIPPED_TOKENIZER, s.chat_template) for s in self.sets)
        return ServeSettings(
            source=SourceSettings(kind="file", path=catalog),
            listen=f"{HOST}:{self.options.grpc_port}",
            admin_listen=f"{HOST}:0",
            drain_seconds=1.0,
            prefix=PrefixSettings(tokenizers=tokenizers),
        )

    async def _start_server(self, catalog: Path) -> None:
        settings = self.serve_settings(catalog)
        server = Server(settings)
        # stop() is safe on a half-started server, so registering first covers every failure point.
        self._stack.push_async_callback(server.stop)
        try:
            await server.start()
        except (ConfigError, RuntimeError) as exc:
            # The server names its own flag (--listen); the demo's user set --grpc-port.
            raise ConfigError(
                f"the router cannot listen on {HOST}:{self.options.grpc_port} ({exc}); "
                "pick another port with --grpc-port"
            ) from None
        self.server = server

    def _envoy_config(self) -> dict[str, Any]:
        return render_config(
            load_config(shipped_config("gateway.yaml")),
            listen_port=self.options.port,
            admin_port=self.options.admin_port,
            extproc_address=(HOST, self.options.grpc_port),
            pool_endpoints=[(HOST, e.server.port) for e in self.engines],
            body_mode=self.options.body_mode,
        )

    async def _self_check(self) -> None:
        """One ``GET /v1/models`` through Envoy and the router, so the URL we print works."""
        deadline = time.monotonic() + _SELF_CHECK_SECONDS
        last = "no answer"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as session:
            while time.monotonic() < deadline:
                try:
                    async with session.get(f"{self.url}/v1/models") as resp:
                        if resp.status == 200:
                            return
                        last = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                except (aiohttp.ClientError, TimeoutError) as exc:
                    last = f"{type(exc).__name__}: {exc}"
                await asyncio.sleep(0.1)
        tail = self.envoy.log_tail() if self.envoy is not None else ""
        raise DemoError(
            f"the gateway at {self.url} did not answer GET /v1/models within {_SELF_CHECK_SECONDS} s "
            f"({last}).\n--- Envoy log ---\n{tail or '(empty)'}"
        )

    def intro(self) -> Intro:
        assert self.server is not None and self.envoy is not None
        return Intro(
            url=self.url,
            envoy_admin_url=self.envoy.admin_url,
            envoy_pid=self.envoy.pid,
            metrics_url=f"http://{HOST}:{self.server.admin_port}/metrics",
            body_mode=self.options.body_mode,
            models=[ModelLine(s.alias, s.upstream, s.engines) for s in self.sets],
            duration=self.options.duration,
            engines=[
                EngineLine(e.worker_set.name, e.address, events, replay or None)
                for e in self.engines
                for events, replay in zip(e.kv_events, e.kv_replay, strict=True)
            ],
        )

    def snapshot(self, traffic: TrafficStats | None) -> Snapshot:
        """What the live view shows now: the engines' own state, the router's in-flight and outcomes."""
        inflight = self.server.inflight.snapshot() if self.server is not None else {}
        rows = []
        for e in self.engines:
            # In-process reads of each rank's scheduler and cache: what /metrics would report.
            stats = [rank.stats() for rank in e.server.ranks]
            rows.append(
                EndpointRow(
                    worker_set=e.worker_set.name,
                    address=e.address,
                    served=e.server.requests_finished,
                    in_flight=inflight.get(EndpointAddress(e.address), 0),
                    running=sum(r.num_running for r in stats),
                    waiting=sum(r.num_waiting for r in stats),
                    kv_cache_usage=sum(r.kv_cache_usage for r in stats) / len(stats) if stats else 0.0,
                    prefix_queries=sum(r.prefix_cache_queries for r in stats),
                    prefix_hits=sum(r.prefix_cache_hits for r in stats),
                )
            )
        outcomes = request_outcomes(self.server.metrics) if self.server is not None else {}
        return Snapshot(self.url, time.monotonic() - self.started, rows, outcomes, traffic)

    def prefix(self) -> PrefixView:
        """The router's side of prefix routing: how it matched prompts, what its index holds."""
        if self.server is None:
            return PrefixView({}, 0, ())
        state = self.server.prefix.debug_state()["sources"]
        engines = []
        for e in self.engines:
            source = state.get(f"{e.address}/dp0")
            blocks = None if source is None or not source["connected"] else int(source["gpuBlocks"])
            engines.append((e.worker_set.name, blocks, bool(source and source["complete"])))
        counters = self.server.prefix.scorer.counters
        return PrefixView(dict(counters.lookups), counters.tokenize_errors, tuple(engines))

    def intro_text(self) -> str:
        """The rendered intro, with a line saying how the router matches prompts to caches."""
        templates = ", ".join(f"{s.alias} {s.chat_template}" for s in self.sets)
        router = (
            f"Router: routes by cached prefix, tokenizing like the engines ({SHIPPED_TOKENIZER}: {templates})"
        )
        return render_intro(self.intro()).replace("\nTry:\n", f"\n{router}\nTry:\n", 1)


@dataclass(frozen=True, slots=True)
class PrefixView:
    """What the live view shows of the router's prefix routing (rendered here, below the table)."""

    #: ``extproc_prefix_lookups_total`` by mode: precise (tokenized, KV events), approximate, none.
    lookups: Mapping[str, int]
    tokenize_errors: int
    #: Per engine, in table order: (worker set, GPU blocks the router's index holds or None when
    #: not subscribed yet, whether its event stream is complete from seq 0).
    engines: Sequence[tuple[str, int | None, bool]]

    def lines(self, width: int = 100) -> list[str]:
        """Two short lines (wrapped to ``width`` with many engines) for the TTY frame."""
        modes = [
            f"precise {self.lookups.get('precise', 0)}",
            f"approximate {self.lookups.get('approximate', 0)}",
        ]
        if self.tokenize_errors:
            modes.append(f"tokenize errors {self.tokenize_errors}")
        in_sync = sum(1 for _, blocks, complete in self.engines if blocks is not None and complete)
        # (separator, text) pieces; a line may break before any piece, e.g. between two counts.
        pieces = [("", f"router index, blocks per engine ({in_sync}/{len(self.engines)} in sync):")]
        for n, (name, counts) in enumerate(self._per_set().items()):
            pieces.append((" " if n == 0 else "  ", name))
            pieces += [(" " if i == 0 else "/", count) for i, count in enumerate(counts.split("/"))]
        index = [""]
        for sep, text in pieces:
            if index[-1] and len(index[-1]) + len(sep) + len(text) > width:
                index.append("  " + text)
            else:
                index[-1] += (sep if index[-1] else "") + text
        return ["router prefix lookups: " + "  ".join(modes), *index]

    def summary(self) -> str:
        """The one-line summary's part: ``lookups: precise=N approximate=M indexed=a/b/c,d``."""
        indexed = ",".join(self._per_set().values())
        return (
            f"lookups: precise={self.lookups.get('precise', 0)} "
            f"approximate={self.lookups.get('approximate', 0)} indexed={indexed}"
        )

    def _per_set(self) -> dict[str, str]:
        groups: dict[str, list[str]] = {}
        for name, blocks, _ in self.engines:
            groups.setdefault(name, []).append("-" if blocks is None else str(blocks))
        return {name: "/".join(counts) for name, counts in groups.items()}


def render_demo_frame(snapshot: Snapshot, prefix: PrefixView, intro: str = "") -> str:
    """The view's frame, then the router's prefix lines below the outcomes."""
    return render_frame(snapshot, intro) + "\n".join(prefix.lines()) + "\n"


def render_demo_line(snapshot: Snapshot, prefix: PrefixView) -> str:
    """The view's one-line summary with the prefix part before the traffic (which stays last)."""
    line = render_line(replace(snapshot, traffic=None)) + " " + prefix.summary()
    if snapshot.traffic is not None:
        t = snapshot.traffic
        line += f" traffic: sent={t.sent} ok={t.ok} failed={t.failed}"
    return line


def _engine(demo_set: DemoSet, server: SimServer) -> Engine:
    publishers = [rank.publisher for rank in server.ranks if rank.publisher is not None]
    return Engine(
        worker_set=demo_set,
        server=server,
        kv_events=tuple(p.endpoint for p in publishers),
        kv_replay=tuple(p.replay_endpoint or "" for p in publishers),
    )


def request_outcomes(metrics: Metrics) -> dict[str, int]:
    """``extproc_requests_total`` by outcome, read from the in-process registry (no HTTP scrape)."""
    out: dict[str, int] = {}
    for family in metrics.requests.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                out[sample.labels["outcome"]] = int(sample.value)
    return out


# -- sample traffic -------------------------------------------------------------------------------


class _Traffic:
    """Counts of the demo's own sample requests (mutable; the view gets frozen copies)."""

    def __init__(self) -> None:
        self.sent = self.ok = self.failed = 0

    def stats(self) -> TrafficStats:
        return TrafficStats(self.sent, self.ok, self.failed)


#: Every sample chat starts with a long system prompt, as a deployed assistant's requests do: the
#: router sends them where that prompt is cached, and the live view's "prefix hits" climbs.
SYSTEM_PROMPT = (
    "You are the assistant of the extproc demo, a gateway that routes OpenAI-style requests through "
    "Envoy to a pool of model servers. Answer in a friendly, concise way, in plain text without "
    "markdown. When a question is about the gateway, explain which part does the work: Envoy accepts "
    "the HTTP request and streams its body to the external processor over gRPC; the processor reads "
    "the model name, maps an alias such as chat to the model the servers really load, picks one "
    "endpoint of the worker set that serves it, rewrites the body when the name changed, and tells "
    "Envoy where to send the request. The model servers run vLLM, which keeps the attention keys and "
    "values of every prompt in fixed-size blocks of sixteen tokens; blocks whose tokens match an "
    "earlier prompt are reused instead of being computed again, which is why requests that share a "
    "long beginning are cheaper on the server that has already seen it. If you do not know an "
    "answer, say so rather than guessing, and never invent numbers, names or quotations."
)
#: Three assistants, each with its own system prompt (they differ from the first sentence, so they
#: share no cached block): the router keeps each one on the engine holding its prompt.
SYSTEM_PROMPTS = (
    SYSTEM_PROMPT,
    "You talk to operators who are on call tonight and want short, exact answers. " + SYSTEM_PROMPT,
    "You talk to students who are new to model serving and like examples. " + SYSTEM_PROMPT,
)
#: The qwen set gets completions that continue one shared document, for the same reason.
DOCUMENT = (
    "Release notes, version 2.4 of the inference gateway. Requests are now routed by the load of "
    "each endpoint, counted by the router itself from the moment it picks an endpoint until the "
    "response ends. Aliases are rewritten before the body reaches the model server, so clients can "
    "keep using short names when the deployed model changes. Catalog files are reloaded on change, "
    "and an invalid edit keeps the last valid version. Question: "
)
_QUESTIONS = (
    "Hello!",
    "Summarize the plot of Hamlet.",
    "Write a haiku about routers.",
    "What is a KV cache?",
    "Why do shared prefixes make requests cheaper?",
    "What does the external processor change in a request?",
)


def sample_request(rng: random.Random, sets: Sequence[DemoSet]) -> tuple[str, str, dict[str, Any] | None]:
    """(method, path, JSON body): mostly chats through the first alias, some streams, some others.

    ``max_tokens`` stays small (8-96 tokens, 0.05-0.6 s of simulated decoding): three clients keep
    a request or two running on the engines, never a queue of long answers.
    """
    first, last = sets[0].alias, sets[-1].alias
    question = rng.choice(_QUESTIONS)
    system = rng.choice(SYSTEM_PROMPTS)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    roll = rng.random()
    if roll < 0.45:
        body = {"model": first, "messages": messages, "max_tokens": rng.randint(8, 32)}
        return "POST", "/v1/chat/completions", body
    if roll < 0.75:
        body = {"model": first, "messages": messages, "max_tokens": rng.randint(32, 96), "stream": True}
        return "POST", "/v1/chat/completions", body
    if roll < 0.95:
        body = {"model": last, "prompt": DOCUMENT + question, "max_tokens": 16}
        return "POST", "/v1/completions", body
    return "GET", "/v1/models", None


async def send_sample_traffic(url: str, sets: Sequence[DemoSet], traffic: _Traffic) -> None:
    """A few concurrent clients sending sample requests with short random pauses, until cancelled."""
    timeout = aiohttp.ClientTimeout(total=_TRAFFIC_TIMEOUT)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(_client(session, url, sets, traffic, i) for i in range(_TRAFFIC_WORKERS)))


async def _client(
    session: aiohttp.ClientSession, url: str, sets: Sequence[DemoSet], traffic: _Traffic, seed: int
) -> None:
    rng = random.Random(seed)
    while True:
        method, path, body = sample_request(rng, sets)
        traffic.sent += 1
        try:
            async with session.request(method, url + path, json=body) as resp:
                await resp.read()
                ok = resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            ok = False
        if ok:
            traffic.ok += 1
        else:
            traffic.failed += 1
        await asyncio.sleep(rng.uniform(0.05, 0.5))


# -- main -----------------------------------------------------------------------------------------


async def run_demo(args: argparse.Namespace, stop: asyncio.Event) -> None:
    """The ``demo`` command: start everything, show the live view until stop or ``--duration``."""
    options = demo_options(args)
    check_ports_free(
        {"--port": options.port, "--admin-port": options.admin_port, "--grpc-port": options.grpc_port}
    )
    _check_setup()
    out = sys.stdout
    tty = out.isatty()
    traffic = _Traffic() if options.traffic else None
    async with Demo(options) as demo:
        intro = demo.intro_text()
        if not tty:
            _write(out, intro + "\n")
        tasks = [asyncio.create_task(_live_view(demo, traffic, intro, out, tty), name="demo-view")]
        if traffic is not None:
            tasks.append(
                asyncio.create_task(send_sample_traffic(demo.url, demo.sets, traffic), name="demo-traffic")
            )
        try:
            reason = await _wait_for_end(stop, options.duration, tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if tty:
                _write(out, _SHOW_CURSOR)
        final = demo.snapshot(traffic.stats() if traffic is not None else None)
        final_line = render_demo_line(final, demo.prefix())
    _write(out, f"\nstopped ({reason}); Envoy, router and engines are shut down.\n{final_line}\n")


async def _wait_for_end(stop: asyncio.Event, duration: float | None, tasks: list[asyncio.Task[None]]) -> str:
    """Why the demo ends: a signal, ``--duration``, or a background task failing (re-raised)."""
    stopper = asyncio.create_task(stop.wait(), name="demo-stop")
    try:
        done, _ = await asyncio.wait([stopper, *tasks], timeout=duration, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await stopper
    if stopper in done:
        return "signal"
    for task in done:
        # The view and the traffic loop run until cancelled: ending at all is a bug worth reporting.
        raise DemoError(f"{task.get_name()} stopped unexpectedly: {task.exception()!r}")
    return "duration elapsed"


async def _live_view(demo: Demo, traffic: _Traffic | None, intro: str, out: TextIO, tty: bool) -> None:
    """Redraw in place every second on a TTY; otherwise a one-line summary every few seconds."""
    if tty:
        _write(out, _HIDE_CURSOR)
    while True:
        snapshot = demo.snapshot(traffic.stats() if traffic is not None else None)
        prefix = demo.prefix()
        _write(
            out,
            render_demo_frame(snapshot, prefix, intro) if tty else render_demo_line(snapshot, prefix) + "\n",
        )
        await asyncio.sleep(TTY_INTERVAL if tty else LOG_INTERVAL)


def _write(out: TextIO, text: str) -> None:
    out.write(text)
    out.flush()
