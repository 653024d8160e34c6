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
import sys
from typing import TextIO

from extproc.demo.options import DemoError, check_ports_free, check_setup, demo_options
from extproc.demo.stack import Demo
from extproc.demo.traffic import Traffic, send_sample_traffic
from extproc.demo.view import render_demo_frame, render_demo_line

#: A TTY redraws every second; logs get one line every few seconds so they stay readable.
TTY_INTERVAL = 1.0
LOG_INTERVAL = 5.0
_HIDE_CURSOR, _SHOW_CURSOR = "\x1b[?25l", "\x1b[?25h"


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


# -- main -----------------------------------------------------------------------------------------


async def run_demo(args: argparse.Namespace, stop: asyncio.Event) -> None:
    """The ``demo`` command: start everything, show the live view until stop or ``--duration``."""
    options = demo_options(args)
    check_ports_free(
        {"--port": options.port, "--admin-port": options.admin_port, "--grpc-port": options.grpc_port}
    )
    check_setup()
    out = sys.stdout
    tty = out.isatty()
    traffic = Traffic() if options.traffic else None
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


async def _live_view(demo: Demo, traffic: Traffic | None, intro: str, out: TextIO, tty: bool) -> None:
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
