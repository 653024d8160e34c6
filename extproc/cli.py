"""The ``extproc`` command: the subcommands, logging, signals and exit codes.

Each subcommand's flags, and their mapping onto validated settings, live with what it runs
(``serve``: :mod:`extproc.serve.run`; ``demo``, ``sim``, ``reconcile``: their packages' ``run``).

Exit codes: 0 clean stop, 1 runtime failure (e.g. the catalog source cannot be read),
2 bad flags or settings.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import aiohttp
import uvloop

from extproc import __version__
from extproc.addresses import parse_host_port
from extproc.errors import ConfigError, ExtprocError
from extproc.fetch import fetch_bounded
from extproc.settings import DEFAULT_ADMIN_LISTEN
from extproc.telemetry import configure_logging

log = logging.getLogger("extproc")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="extproc", description="Envoy ext_proc router for LLM inference pools"
    )
    parser.add_argument("--version", action="version", version=f"extproc {__version__}")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True)
    from extproc.serve.run import add_serve_parser

    add_serve_parser(sub)
    from extproc.demo.run import add_demo_parser

    add_demo_parser(sub)
    from extproc.sim.run import add_sim_parser

    add_sim_parser(sub)
    from extproc.reconcile.run import add_reconcile_parser

    add_reconcile_parser(sub)
    _fitted_profiles_parser(sub)
    p = sub.add_parser("peer-key", help="print a new CURVE secret key for --peer-key-file")
    p.set_defaults(handler=_run_peer_key)
    return parser


async def _run_peer_key(_args: argparse.Namespace, _stop: asyncio.Event) -> None:
    from extproc.peers.curve import new_secret

    print(new_secret())


#: A fitted-profiles page is a few hundred bytes per profile name; past this something else answered.
_MAX_PROFILES_BYTES = 4 * 1024 * 1024


def _fitted_profiles_parser(sub: Any) -> None:
    p = sub.add_parser(
        "fitted-profiles",
        help="print a running serve's calibrated latency profiles as a --profiles file (YAML)",
    )
    p.add_argument(
        "--admin",
        default=DEFAULT_ADMIN_LISTEN,
        help=f"serve's admin address, HOST:PORT ({DEFAULT_ADMIN_LISTEN}; /debug/profiles is "
        "loopback-only: run this in the pod, or port-forward)",
    )
    p.set_defaults(handler=_run_fitted_profiles)


async def _run_fitted_profiles(args: argparse.Namespace, _stop: asyncio.Event) -> None:
    host, port = parse_host_port(args.admin, what="--admin")
    url = f"http://{host}:{port}/debug/profiles"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            body = await fetch_bounded(
                session, url, accept="application/yaml", max_bytes=_MAX_PROFILES_BYTES, error=ExtprocError
            )
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise ExtprocError(
            f"cannot read {url}: {exc or type(exc).__name__} (is serve running there?)"
        ) from exc
    sys.stdout.write(body.decode())


def _install_signals(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    """First SIGINT/SIGTERM drains and stops; a second one exits at once."""

    def on_signal(signum: int) -> None:
        if stop.is_set():
            log.warning("second signal, exiting now")
            raise SystemExit(130)
        log.info("signal=%s stopping", signal.Signals(signum).name)
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal, signum)


def run_async(main: Callable[[asyncio.Event], Coroutine[Any, Any, None]]) -> None:
    """Run ``main(stop)`` on uvloop with signal handling."""

    async def runner() -> None:
        stop = asyncio.Event()
        _install_signals(asyncio.get_running_loop(), stop)
        await main(stop)

    uvloop.run(runner())


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    configure_logging(args.log_level)
    handler: Callable[[argparse.Namespace, asyncio.Event], Coroutine[Any, Any, None]] = args.handler
    try:
        run_async(lambda stop: handler(args, stop))
    except ConfigError as exc:
        print(f"extproc: {exc}", file=sys.stderr)
        return 2
    except ExtprocError as exc:
        print(f"extproc: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
