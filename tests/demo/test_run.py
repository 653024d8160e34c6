"""``extproc demo`` as a person runs it: a real process with real Envoy, real requests, real signals.

Every wait is bounded, and the ``demo`` fixture kills the demo's whole process group at teardown
(it runs in its own session), so a failing test never leaves Envoy or an engine behind. One test runs
the demo in-process to read its live view while a request is still running on an engine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

import aiohttp
import pytest
from ports import free_port
from processes import pid_gone

from extproc.demo.options import check_ports_free, demo_options
from extproc.demo.stack import Demo
from extproc.demo.traffic import DOCUMENT, SYSTEM_PROMPT, SYSTEM_PROMPTS, sample_request
from extproc.demo.view import EndpointRow, PrefixView, Snapshot, TrafficStats, render_demo_line, render_table
from extproc.errors import ConfigError

LLAMA = "meta-llama/Meta-Llama-3-8B-Instruct"
QWEN = "Qwen/Qwen2-7B-Instruct"
STARTUP_SECONDS = 30.0
EXIT_SECONDS = 20.0
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=10)


class DemoRun:
    """A running ``extproc demo`` subprocess and what it printed so far."""

    def __init__(self, proc: asyncio.subprocess.Process, ports: dict[str, int]) -> None:
        self.proc = proc
        self.ports = ports
        self.lines: list[str] = []
        self.stderr = bytearray()
        self._changed = asyncio.Event()
        self._reader = asyncio.create_task(self._read())
        self._stderr_reader = asyncio.create_task(self._read_stderr())
        self.url = ""
        self.envoy_pid = 0

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for raw in self.proc.stdout:
            self.lines.append(raw.decode(errors="replace").rstrip("\n"))
            self._changed.set()
        self._changed.set()

    async def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        while chunk := await self.proc.stderr.read(65536):
            self.stderr += chunk

    async def wait_for_line(self, pattern: str, within: float) -> re.Match[str]:
        """The first stdout line matching ``pattern``; fails with the output so far on timeout."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + within
        while True:
            for line in self.lines:
                if match := regex.search(line):
                    return match
            left = deadline - time.monotonic()
            if left <= 0 or (self._reader.done() and not self._changed.is_set()):
                pytest.fail(f"no line matching {pattern!r} within {within} s:\n{self.output()}")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)

    async def ready(self) -> None:
        """Wait for the intro; remember the gateway URL and Envoy's pid."""
        self.url = (await self.wait_for_line(r"^Gateway URL: (http://\S+)$", STARTUP_SECONDS))[1]
        self.envoy_pid = int((await self.wait_for_line(r"^Envoy admin: \S+ \(pid (\d+)\)", 1))[1])

    async def wait_exit(self) -> int:
        code = await asyncio.wait_for(self.proc.wait(), EXIT_SECONDS)
        await asyncio.wait_for(asyncio.gather(self._reader, self._stderr_reader), EXIT_SECONDS)
        return code

    def output(self) -> str:
        stderr = self.stderr[-4000:].decode(errors="replace")
        return "--- stdout ---\n" + "\n".join(self.lines) + "\n--- stderr ---\n" + stderr

    async def kill(self) -> None:
        """Teardown: the whole process group, whatever state it is in."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            await asyncio.wait_for(self.proc.wait(), EXIT_SECONDS)
        for reader in (self._reader, self._stderr_reader):
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader


StartDemo = Callable[..., Awaitable[DemoRun]]


def _free_ports() -> dict[str, int]:
    return {"--port": free_port(), "--admin-port": free_port(), "--grpc-port": free_port()}


async def _spawn_demo(
    ports: dict[str, int], *flags: str, new_session: bool = False
) -> asyncio.subprocess.Process:
    """``python -m extproc demo`` on the given ports; its own session lets teardown kill the group."""
    args = [arg for flag, port in ports.items() for arg in (flag, str(port))]
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "extproc",
        "demo",
        *args,
        *flags,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=new_session,
    )


@pytest.fixture
async def demo() -> AsyncIterator[StartDemo]:
    """Factory: ``await demo(*extra_flags) -> DemoRun`` on free ports, intro already printed."""
    runs: list[DemoRun] = []

    async def start(*flags: str) -> DemoRun:
        ports = _free_ports()
        proc = await _spawn_demo(ports, *flags, new_session=True)
        run = DemoRun(proc, ports)
        runs.append(run)
        await run.ready()
        return run

    try:
        yield start
    finally:
        for run in runs:
            await run.kill()


# -- helpers ----------------------------------------------------------------------------------------


def _chat(model: str, *, stream: bool = False, max_tokens: int = 4) -> dict[str, Any]:
    """A chat the engines answer quickly: a few tokens are ~6 ms each at the demo's real speed."""
    messages = [{"role": "user", "content": "hi"}]
    return {"model": model, "messages": messages, "stream": stream, "max_tokens": max_tokens}


async def _post_json(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with session.post(url, json=body) as resp:
        text = await resp.text()
        assert resp.status == 200, text
        answer: dict[str, Any] = json.loads(text)
        return answer


async def _sse_chunks(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Every JSON chunk of an SSE answer, checked to end with ``[DONE]``."""
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        text = (await resp.read()).decode()
    events = [block[len("data: ") :] for block in text.split("\n\n") if block.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def _served_per_set(summary: str) -> dict[str, list[int]]:
    """``llama-3-8b=[3/4/5] qwen-2-7b=[2]`` in a one-line summary -> served counts per engine."""
    return {
        name: [int(n) for n in counts.split("/")]
        for name, counts in re.findall(r"(\S+)=\[([\d/]+)\]", summary)
    }


def _engine_ports(run: DemoRun) -> list[int]:
    """HTTP and ZMQ ports of every engine, from the intro's ``Engines`` lines."""
    ports = []
    for line in run.lines:
        if match := re.match(
            r"^  \S+ +127\.0\.0\.1:(\d+)  events tcp://127\.0\.0\.1:(\d+)  replay tcp://127\.0\.0\.1:(\d+)$",
            line,
        ):
            ports += [int(port) for port in match.groups()]
    return ports


async def _assert_nothing_listens(ports: list[int], within: float = 5.0) -> None:
    """Every port refuses connections, soon: ZMQ releases a closed socket's port in its I/O thread."""
    deadline = time.monotonic() + within
    for port in ports:
        while True:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                if probe.connect_ex(("127.0.0.1", port)) != 0:
                    break
            assert time.monotonic() < deadline, f"port {port} still listening after {within} s"
            await asyncio.sleep(0.01)


async def _assert_all_stopped(run: DemoRun) -> None:
    """Envoy's pid is gone, its admin API does not answer, every demo port can be bound again, and
    no engine listens any more (HTTP, KV events, replay)."""
    deadline = time.monotonic() + 5
    while not pid_gone(run.envoy_pid):
        assert time.monotonic() < deadline, f"Envoy pid {run.envoy_pid} still alive after the demo exited"
        await asyncio.sleep(0.05)
    admin = run.ports["--admin-port"]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        with pytest.raises(aiohttp.ClientConnectionError):
            await session.get(f"http://127.0.0.1:{admin}/ready")
    check_ports_free(run.ports)
    await _assert_nothing_listens(_engine_ports(run))


# -- the demo, end to end -----------------------------------------------------------------------------


async def test_demo_routes_through_real_envoy_and_stops_cleanly_on_sigint(demo: StartDemo) -> None:
    run = await demo("--traffic", "--duration", "120")
    assert len(_engine_ports(run)) == 4 * 3, run.output()  # 3 llama + 1 qwen engines, 3 ports each
    chat_url = f"{run.url}/v1/chat/completions"
    async with aiohttp.ClientSession(timeout=REQUEST_TIMEOUT) as session:
        # The alias is rewritten to the upstream name the llama engines serve (they 404 others).
        answers = []
        for _ in range(6):
            answers += await asyncio.gather(*(_post_json(session, chat_url, _chat("chat")) for _ in range(5)))
        assert {a["model"] for a in answers} == {LLAMA}
        assert {a["usage"]["completion_tokens"] for a in answers} == {4}

        # A stream is a stream: the text arrives over several chunks, from the qwen engine.
        chunks = await _sse_chunks(session, chat_url, _chat("qwen", stream=True, max_tokens=8))
        assert {c["model"] for c in chunks} == {QWEN}
        assert len([c for c in chunks if c["choices"][0]["delta"].get("content")]) > 1

        async with session.get(f"{run.url}/v1/models") as resp:
            assert resp.status == 200
            ids = {m["id"] for m in (await resp.json())["data"]}
        assert {"chat", "qwen", LLAMA, QWEN} <= ids

    # Not a TTY: one-line summaries, which show the demo's own traffic moving too.
    await run.wait_for_line(r"^demo t=\S+ served=\d+ .*traffic: sent=[1-9]", 15)
    run.proc.send_signal(signal.SIGINT)
    assert await run.wait_exit() == 0, run.output()
    # The last two lines: why it stopped, then the final summary (the demo's traffic all succeeded).
    assert run.lines[-2].startswith("stopped (signal)"), run.output()
    final = run.lines[-1]
    traffic = re.search(r"traffic: sent=(\d+) ok=(\d+) failed=(\d+)$", final)
    assert traffic is not None and int(traffic[2]) > 0 and traffic[3] == "0", run.output()
    # Every engine served (the engines' own counts), and the sample prompts' shared system prompt
    # was found in the engines' prefix caches.
    served = _served_per_set(final)
    assert len(served["llama-3-8b"]) == 3 and min(served["llama-3-8b"]) > 0, final
    assert served["qwen-2-7b"][0] > 0, final
    hits = re.search(r" prefix_hits=(\d+)% ", final)
    assert hits is not None and int(hits[1]) > 0, final
    # The router matched every prompt precisely (tokenizer + KV events), and indexed every engine.
    lookups = re.search(r" lookups: precise=(\d+) approximate=(\d+) indexed=([\d/]+),(\d+) ", final)
    assert lookups is not None and int(lookups[1]) > 0 and lookups[2] == "0", final
    assert sum(int(n) for n in lookups[3].split("/")) > 0 and int(lookups[4]) > 0, final
    assert "Traceback" not in run.output()
    await _assert_all_stopped(run)


async def test_demo_buffered_mode_stops_by_itself_after_duration(demo: StartDemo) -> None:
    run = await demo("--body-mode", "BUFFERED", "--backends", "2", "--duration", "4")
    await run.wait_for_line(r"^Body mode: BUFFERED", 1)
    await run.wait_for_line(r"^  chat -> .* \(2 endpoints\)$", 1)
    engine = (await run.wait_for_line(r"^  llama-3-8b +(127\.0\.0\.1:\d+) ", 1))[1]
    body = _chat("chat")
    async with aiohttp.ClientSession(timeout=REQUEST_TIMEOUT) as session:
        answer = await _post_json(session, f"{run.url}/v1/chat/completions", body)
        # The rewritten body reached the engine whole: it counts the same prompt tokens as the
        # engine's own tokenizer does for the original messages.
        tokenized = await _post_json(session, f"http://{engine}/tokenize", {"messages": body["messages"]})
    assert answer["model"] == LLAMA
    assert answer["usage"]["prompt_tokens"] == tokenized["count"] > 0
    assert await run.wait_exit() == 0, run.output()
    assert any(line.startswith("stopped (duration elapsed)") for line in run.lines), run.output()
    await _assert_all_stopped(run)


async def test_live_view_shows_what_the_engines_are_doing() -> None:
    """In-process, so the test reads the same snapshots the live view draws, while a stream runs."""
    options = demo_options(_args(port=free_port(), admin_port=free_port(), grpc_port=free_port(), backends=2))
    body = {
        "model": "chat",
        "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Hello!"}],
        "max_tokens": 300,  # ~2 s of decoding: long enough to be seen running
        "stream": True,
    }
    async with Demo(options) as demo_, aiohttp.ClientSession(timeout=REQUEST_TIMEOUT) as session:
        url = f"{demo_.url}/v1/chat/completions"
        async with session.post(url, json=body) as resp:
            assert resp.status == 200
            await resp.content.readline()  # the first chunk: the request is on an engine now
            busy = await _wait_for_row(demo_, lambda r: r.running == 1 and r.in_flight == 1)
            assert busy.kv_cache_usage > 0 and busy.prefix_queries > 0
            row = next(
                line for line in render_table(demo_.snapshot(None)).splitlines() if busy.address in line
            )
            assert row.split()[2:5] == ["0", "1", "1/0"], row  # served, in flight, run/wait
            await resp.read()
        done = await _wait_for_row(demo_, lambda r: r.served == 1 and r.in_flight == 0 and r.running == 0)
        assert done.address == busy.address and done.kv_cache_usage == 0
        # Three more with the same system prompt: two engines, so one sees it twice and hits its cache.
        for _ in range(3):
            await _post_json(session, url, {**body, "stream": False, "max_tokens": 2})
        # The router ends its in-flight count when Envoy reports the response's end, just after the
        # client has it: wait for that rather than for a fixed time.
        snapshot = await _wait_for_snapshot(demo_, lambda s: not any(r.in_flight for r in s.endpoints))
        assert sum(r.served for r in snapshot.endpoints) == 4
        assert sum(r.prefix_hits for r in snapshot.endpoints) > 0
        total = render_table(snapshot).splitlines()[-3].split()
        assert total[:4] == ["total", "4", "0", "0/0"] and total[4] not in ("-", "0%"), total
        engines = demo_.engines
        assert demo_.envoy is not None and demo_.envoy.pid is not None
        envoy_pid = demo_.envoy.pid
    assert pid_gone(envoy_pid)
    await _assert_nothing_listens(
        [e.server.port for e in engines] + [int(a.rsplit(":", 1)[1]) for e in engines for a in e.kv_events]
    )


async def _wait_for_snapshot(
    demo_: Demo, ready: Callable[[Snapshot], bool], within: float = 10.0
) -> Snapshot:
    """The first live-view snapshot that satisfies ``ready``, polling until ``within``."""
    deadline = time.monotonic() + within
    while True:
        snapshot = demo_.snapshot(None)
        if ready(snapshot):
            return snapshot
        if time.monotonic() > deadline:
            pytest.fail(f"no snapshot matched within {within} s; the last: {snapshot}")
        await asyncio.sleep(0.01)


async def _wait_for_row(
    demo_: Demo, ready: Callable[[EndpointRow], bool], within: float = 10.0
) -> EndpointRow:
    """The first endpoint row that satisfies ``ready``, polling until ``within``."""
    snapshot = await _wait_for_snapshot(demo_, lambda s: any(ready(r) for r in s.endpoints), within)
    return next(r for r in snapshot.endpoints if ready(r))


async def test_demo_router_follows_the_engines_and_routes_by_cached_prefix() -> None:
    """The catalog declares each engine's KV-event ports and the router tokenizes like the engines:
    it subscribes to all of them, and a chat sharing a cached system prompt goes where it is cached."""
    options = demo_options(_args(port=free_port(), admin_port=free_port(), grpc_port=free_port(), backends=2))
    async with Demo(options) as demo_, aiohttp.ClientSession(timeout=REQUEST_TIMEOUT) as session:
        assert demo_.server is not None
        catalog = demo_.server.store.current
        declared = {
            e.address: (e.kv_events_port, e.kv_replay_port)
            for ws in catalog.worker_sets.values()
            for e in ws.endpoints
        }
        assert declared == {e.address: e.kv_ports() for e in demo_.engines}
        assert all(pub and replay for pub, replay in declared.values())
        assert demo_.server.prefix.tokenizers.models() == sorted([LLAMA, QWEN])
        prefix = await _wait_for_prefix(demo_, lambda p: all(b is not None for _, b, _ in p.engines))
        assert [name for name, _, _ in prefix.engines] == ["llama-3-8b", "llama-3-8b", "qwen-2-7b"]

        url = f"{demo_.url}/v1/chat/completions"
        system = {"role": "system", "content": SYSTEM_PROMPTS[1]}
        first = {
            "model": "chat",
            "messages": [system, {"role": "user", "content": "Hello!"}],
            "max_tokens": 2,
        }
        await _post_json(session, url, first)
        owner = next(e for e in demo_.engines if e.server.requests_finished == 1)
        # The engine's blocks reach the router's index through its KV events...
        await _wait_for_prefix(demo_, lambda p: (p.engines[demo_.engines.index(owner)][1] or 0) >= 400 // 16)
        # ...so the next chat with that system prompt goes to the same engine, and hits its cache.
        second = {**first, "messages": [system, {"role": "user", "content": "What is a KV cache?"}]}
        answer = await _post_json(session, url, second)
        assert owner.server.requests_finished == 2
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 400 // 16 * 16
        prefix = demo_.prefix()
        assert prefix.lookups["precise"] == 2 and prefix.lookups["approximate"] == 0
        assert all(len(line) <= 100 for line in prefix.lines())


async def _wait_for_prefix(
    demo_: Demo, ready: Callable[[PrefixView], bool], within: float = 10.0
) -> PrefixView:
    """The first prefix view that satisfies ``ready``, polling until ``within``."""
    deadline = time.monotonic() + within
    while True:
        prefix = demo_.prefix()
        if ready(prefix):
            return prefix
        if time.monotonic() > deadline:
            pytest.fail(f"no prefix view matched within {within} s; the last: {prefix}")
        await asyncio.sleep(0.01)


def test_prefix_view_fits_the_screen_and_keeps_traffic_last() -> None:
    view = PrefixView(
        {"precise": 12, "approximate": 3, "none": 1},
        2,
        (("llama-3-8b", 60, True), ("llama-3-8b", None, False), ("qwen-2-7b", 20, False)),
    )
    assert view.lines() == [
        "router prefix lookups: precise 12  approximate 3  tokenize errors 2",
        "router index, blocks per engine (1/3 in sync): llama-3-8b 60/-  qwen-2-7b 20",
    ]
    assert view.summary() == "lookups: precise=12 approximate=3 indexed=60/-,20"
    snapshot = Snapshot("http://x", 5.0, [EndpointRow("llama-3-8b", "127.0.0.1:1", 3, 0)], {"routed": 3})
    line = render_demo_line(replace(snapshot, traffic=TrafficStats(4, 3, 1)), view)
    assert line.endswith(" lookups: precise=12 approximate=3 indexed=60/-,20 traffic: sent=4 ok=3 failed=1")
    assert _served_per_set(line) == {"llama-3-8b": [3]}  # the summary's parsers are not confused
    many = PrefixView({}, 0, tuple(("llama-3-8b", 123_456, True) for _ in range(64)))
    lines = many.lines()
    assert len(lines) > 2 and all(len(line) <= 100 for line in lines)
    assert " ".join(lines).count("123456") == 64


def test_sample_traffic_is_cheap_and_shares_prefixes() -> None:
    """--traffic keeps answers short, and its prompts share long beginnings so prefix caches hit."""
    import random

    sets = demo_options(_args()).sets()
    kinds = set()
    systems: set[str] = set()
    rng = random.Random(0)
    for _ in range(200):
        method, path, body = sample_request(rng, sets)
        kinds.add((method, path, None if body is None else body.get("stream", False)))
        if body is None:
            continue
        assert 1 <= body["max_tokens"] <= 96
        if path == "/v1/chat/completions":
            assert body["model"] == "chat"
            assert body["messages"][0]["role"] == "system"
            systems.add(body["messages"][0]["content"])
        else:
            assert body["model"] == "qwen" and body["prompt"].startswith(DOCUMENT)
    assert kinds == {
        ("POST", "/v1/chat/completions", False),
        ("POST", "/v1/chat/completions", True),
        ("POST", "/v1/completions", False),
        ("GET", "/v1/models", None),
    }
    assert systems == set(SYSTEM_PROMPTS)
    assert len(SYSTEM_PROMPT) > 1000  # hundreds of tokens: dozens of 16-token KV blocks
    # Each assistant's prompt differs from its first words on: no cached block in common.
    assert len({p[:24] for p in SYSTEM_PROMPTS}) == len(SYSTEM_PROMPTS)


# -- setup errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("reuseport", [False, True], ids=["plain", "so_reuseport"])
@pytest.mark.parametrize("flag", ["--port", "--admin-port", "--grpc-port"])
async def test_taken_port_is_a_clear_setup_error(flag: str, reuseport: bool) -> None:
    """Exit 2 naming the port and the flag, before anything starts; SO_REUSEPORT holders included
    (Envoy and gRPC listen that way, so a second demo would otherwise share the first one's port)."""
    ports = _free_ports()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        if reuseport:
            holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind(("127.0.0.1", ports[flag]))
        holder.listen()
        proc = await _spawn_demo(ports)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), EXIT_SECONDS)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    message = err.decode()
    assert proc.returncode == 2, message
    assert f"port {ports[flag]} " in message
    assert f"{flag} " in message
    assert "Traceback" not in message
    assert out == b""


async def test_grpc_port_taken_after_the_check_still_names_the_demo_flag() -> None:
    """A port taken between the check and the start (a race) fails as clearly, with nothing left running."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        options = demo_options(_args(port=free_port(), admin_port=free_port(), grpc_port=taken, backends=1))
        demo_ = Demo(options)
        with pytest.raises(ConfigError, match=f"127.0.0.1:{taken} .*--grpc-port"):
            async with demo_:
                pytest.fail("the demo started on a taken port")
    assert demo_.envoy is None
    assert [e.worker_set.name for e in demo_.engines] == ["llama-3-8b", "qwen-2-7b"]
    ports = [e.server.port for e in demo_.engines]
    ports += [int(a.rsplit(":", 1)[1]) for e in demo_.engines for a in (*e.kv_events, *e.kv_replay)]
    assert len(ports) == 2 * 3
    await _assert_nothing_listens(ports)


def _args(**overrides: Any) -> argparse.Namespace:
    values: dict[str, Any] = {
        "port": 8080,
        "admin_port": 9901,
        "grpc_port": 9002,
        "backends": 3,
        "body_mode": "FULL_DUPLEX_STREAMED",
        "duration": None,
        "traffic": False,
    }
    values.update(overrides)
    return argparse.Namespace(**values)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"admin_port": 8080}, "--port and --admin-port are both 8080"),
        ({"grpc_port": 9901}, "--admin-port and --grpc-port are both 9901"),
        ({"port": 0}, "--port must be in 1-65535"),
        ({"grpc_port": 70000}, "--grpc-port must be in 1-65535"),
        ({"backends": 0}, "--backends must be in 1-64"),
        ({"duration": 0.0}, "--duration must be a positive number"),
    ],
)
def test_bad_flags_are_config_errors(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        demo_options(_args(**overrides))


def test_defaults_are_the_documented_ports() -> None:
    from extproc.cli import build_parser

    args = build_parser().parse_args(["demo"])
    options = demo_options(args)
    assert (options.port, options.admin_port, options.grpc_port) == (8080, 9901, 9002)
    assert (options.backends, options.body_mode, options.duration, options.traffic) == (
        3,
        "FULL_DUPLEX_STREAMED",
        None,
        False,
    )
    assert [(s.alias, s.upstream, s.engines, s.chat_template) for s in options.sets()] == [
        ("chat", LLAMA, 3, "llama3"),
        ("qwen", QWEN, 1, "chatml"),
    ]
    # Each engine answers only to its upstream name, with KV events and replay on free ports.
    settings = options.sets()[1].engine_settings()
    assert settings.served_model_names == (QWEN,) and settings.listen == "127.0.0.1:0"
    assert settings.kv_events is not None and (settings.kv_events.port, settings.kv_events.replay_port) == (
        0,
        0,
    )
