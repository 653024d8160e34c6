"""``extproc demo`` as a person runs it: a real process with real Envoy, real requests, real signals.

Every wait is bounded, and the ``demo`` fixture kills the demo's whole process group at teardown
(it runs in its own session), so a failing test never leaves Envoy or a backend behind.
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
from typing import Any

import aiohttp
import pytest
from ports import free_port
from processes import pid_gone

from extproc.demo.run import Demo, check_ports_free, demo_options
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


def _chat(model: str, *, stream: bool = False) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream}


async def _post_json(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with session.post(url, json=body) as resp:
        text = await resp.text()
        assert resp.status == 200, text
        answer: dict[str, Any] = json.loads(text)
        return answer


async def _first_sse_chunk(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        text = (await resp.read()).decode()
    events = [block[len("data: ") :] for block in text.split("\n\n") if block.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunk: dict[str, Any] = json.loads(events[0])
    return chunk


async def _assert_all_stopped(run: DemoRun) -> None:
    """Envoy's pid is gone, its admin API does not answer, and every demo port can be bound again."""
    deadline = time.monotonic() + 5
    while not pid_gone(run.envoy_pid):
        assert time.monotonic() < deadline, f"Envoy pid {run.envoy_pid} still alive after the demo exited"
        await asyncio.sleep(0.05)
    admin = run.ports["--admin-port"]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        with pytest.raises(aiohttp.ClientConnectionError):
            await session.get(f"http://127.0.0.1:{admin}/ready")
    check_ports_free(run.ports)


# -- the demo, end to end -----------------------------------------------------------------------------


async def test_demo_routes_through_real_envoy_and_stops_cleanly_on_sigint(demo: StartDemo) -> None:
    run = await demo("--traffic", "--duration", "120")
    chat_url = f"{run.url}/v1/chat/completions"
    async with aiohttp.ClientSession(timeout=REQUEST_TIMEOUT) as session:
        # The alias is rewritten to the upstream name the llama backends serve (they 404 others),
        # and least-loaded picking with random ties reaches every llama backend.
        answers = []
        for _ in range(6):
            answers += await asyncio.gather(*(_post_json(session, chat_url, _chat("chat")) for _ in range(5)))
        seen = [a["x_backend"] for a in answers]
        assert {b["model"] for b in seen} == {LLAMA}
        assert {b["name"] for b in seen} == {"llama-3-8b-1", "llama-3-8b-2", "llama-3-8b-3"}
        assert all(b["transfer_encoding"] == "chunked" for b in seen)  # FULL_DUPLEX_STREAMED default

        first = await _first_sse_chunk(session, chat_url, _chat("qwen", stream=True))
        assert first["x_backend"]["name"] == "qwen-2-7b-1"
        assert first["x_backend"]["model"] == QWEN

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
    final = re.search(r"traffic: sent=(\d+) ok=(\d+) failed=(\d+)$", run.lines[-1])
    assert final is not None and int(final[2]) > 0 and final[3] == "0", run.output()
    assert "Traceback" not in run.output()
    await _assert_all_stopped(run)


async def test_demo_buffered_mode_stops_by_itself_after_duration(demo: StartDemo) -> None:
    run = await demo("--body-mode", "BUFFERED", "--backends", "2", "--duration", "4")
    await run.wait_for_line(r"^Body mode: BUFFERED", 1)
    await run.wait_for_line(r"^  chat -> .* \(2 endpoints\)$", 1)
    async with aiohttp.ClientSession(timeout=REQUEST_TIMEOUT) as session:
        answer = await _post_json(session, f"{run.url}/v1/chat/completions", _chat("chat"))
    backend = answer["x_backend"]
    assert backend["model"] == LLAMA
    assert backend["name"] in {"llama-3-8b-1", "llama-3-8b-2"}
    # BUFFERED keeps Content-Length (the rewritten body's); FULL_DUPLEX_STREAMED would chunk it.
    assert backend["content_length"] == backend["body_bytes"]
    assert await run.wait_exit() == 0, run.output()
    assert any(line.startswith("stopped (duration elapsed)") for line in run.lines), run.output()
    await _assert_all_stopped(run)


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
    assert [b.name for _, b in demo_.backends] == ["llama-3-8b-1", "qwen-2-7b-1"]
    for _, backend in demo_.backends:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            assert probe.connect_ex((backend.host, backend.port)) != 0, f"{backend.name} still listening"


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
    assert [(s.alias, s.upstream, s.backends) for s in options.sets()] == [
        ("chat", LLAMA, 3),
        ("qwen", QWEN, 1),
    ]
