"""Running real Envoy with :mod:`extproc.gateway.process`: validate, start, stop, never leak."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from ports import free_port
from processes import pid_gone

from extproc.gateway.config import load_config, render_config, shipped_config
from extproc.gateway.process import EnvoyConfigError, EnvoyProcess, EnvoyStartError, validate_config


def _live_config(name: str = "gateway.yaml") -> dict[str, Any]:
    """A shipped config on free loopback ports (nothing needs to listen at the extproc/pool ends)."""
    return render_config(
        load_config(shipped_config(name)),
        listen_port=free_port(),
        admin_port=free_port(),
        extproc_address=("127.0.0.1", free_port()),
        pool_endpoints=None if "original-dst" in name else [("127.0.0.1", free_port())],
        body_mode="FULL_DUPLEX_STREAMED",
    )


def _listener(config: dict[str, Any]) -> dict[str, Any]:
    return next(x for x in config["static_resources"]["listeners"] if x["name"] == "gateway")


def _cluster(config: dict[str, Any], name: str) -> dict[str, Any]:
    return next(x for x in config["static_resources"]["clusters"] if x["name"] == name)


async def test_validate_config_reports_envoys_message() -> None:
    config = _live_config()
    _cluster(config, "pool")["type"] = "NOT_A_TYPE"
    with pytest.raises(EnvoyConfigError, match="NOT_A_TYPE"):
        await validate_config(config)


# -- EnvoyProcess -------------------------------------------------------------------------------------


async def test_envoy_process_starts_real_envoy_and_leaves_nothing_behind(tmp_path: Path) -> None:
    config = _live_config()
    log = tmp_path / "envoy.log"
    async with EnvoyProcess(
        config, admin_port=config["admin"]["address"]["socket_address"]["port_value"], log_path=log
    ) as envoy:
        pid = envoy.pid
        assert pid is not None
        assert (await envoy.admin_get("/ready")).strip() == "LIVE"
        assert "extproc::" in await envoy.admin_get("/clusters")
        # The active gRPC health check on the extproc cluster is wired (nothing listens: it fails).
        assert await envoy.wait_for_stat("cluster.extproc.health_check.attempt", 1) >= 1
        stats = await envoy.stats("^cluster\\.pool\\.")
        assert stats, "expected cluster.pool.* counters"
        assert all(name.startswith("cluster.pool.") for name in stats)
        config_path = envoy.config_path
        assert config_path is not None
        assert config_path.exists()
    assert envoy.returncode == 0  # SIGTERM is a clean shutdown for Envoy
    assert envoy.pid is None
    assert pid_gone(pid)
    assert not config_path.exists()  # temp dir removed
    assert log.exists()  # a caller-chosen log is kept


async def test_two_envoys_run_side_by_side() -> None:
    async with (
        EnvoyProcess(_live_config()) as a,
        EnvoyProcess(_live_config("gateway-original-dst.yaml")) as b,
    ):
        assert a.pid != b.pid
        assert (await a.admin_get("/ready")).strip() == (await b.admin_get("/ready")).strip() == "LIVE"


async def test_envoy_process_reports_a_broken_config_with_the_log_tail() -> None:
    config = _live_config()
    _cluster(config, "pool")["type"] = "NOT_A_TYPE"
    envoy = EnvoyProcess(config)
    with pytest.raises(EnvoyStartError) as info:
        await envoy.start()
    text = str(info.value)
    assert "exited with code 1" in text
    assert "last lines of Envoy's log" in text
    assert "NOT_A_TYPE" in text  # Envoy's own words
    assert envoy.pid is None
    assert envoy.log_path is None  # temp log cleaned up with the temp dir


async def test_envoy_process_reports_a_port_conflict(tmp_path: Path) -> None:
    # A plain listening socket (no SO_REUSEPORT) blocks Envoy's listener. Note that two *Envoys* can
    # share a listener port: Envoy sets SO_REUSEPORT by default and the kernel splits connections.
    config = _live_config()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", _listener(config)["address"]["socket_address"]["port_value"]))
        holder.listen()
        with pytest.raises(EnvoyStartError, match=r"(?s)exited with code.*ddress already in use"):
            async with EnvoyProcess(config, log_path=tmp_path / "clash.log"):
                pass


async def test_envoy_process_times_out_and_kills_envoy() -> None:
    envoy = EnvoyProcess(_live_config(), startup_timeout=0.0)
    with pytest.raises(EnvoyStartError, match=r"not LIVE on http://127\.0\.0\.1:\d+ within 0\.0 s"):
        await envoy.start()
    assert envoy.pid is None
    assert envoy.returncode is not None


def test_envoy_process_checks_the_admin_port() -> None:
    config = _live_config()
    with pytest.raises(ValueError, match="differs from the config's admin port"):
        EnvoyProcess(config, admin_port=1)


def _proc_start_time(pid: int) -> int | None:
    """Start time (clock ticks since boot) of a live, non-zombie ``pid``; None if it is gone or a zombie.

    A zombie counts as gone: it has exited, only its reaper (PID 1 once reparented) has not waited.
    """
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


async def _gone_within(pid: int, started: int, seconds: float) -> bool:
    """Poll until the process ``pid`` that started at ``started`` is gone; False after ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if _proc_start_time(pid) != started:
            return True
        await asyncio.sleep(0.05)
    return _proc_start_time(pid) != started


# Started as ``python -c``: reads a rendered config (JSON) from argv[1], prints Envoy's pid, then sleeps.
_ENVOY_CHILD = """
import asyncio, sys
from extproc.gateway.config import load_config
from extproc.gateway.process import EnvoyProcess

async def main():
    envoy = EnvoyProcess(load_config(sys.argv[1]))
    await envoy.start()
    print(envoy.pid, flush=True)
    await asyncio.sleep(120)

asyncio.run(main())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
async def test_envoy_dies_when_the_process_that_started_it_is_sigkilled(tmp_path: Path) -> None:
    """No leaked Envoy after ``kill -9`` of a test, demo or bench: EnvoyProcess sets PR_SET_PDEATHSIG.

    Envoy is started from the child's asyncio loop (the main thread), as everywhere else.
    """
    config_path = tmp_path / "envoy.json"
    config_path.write_text(json.dumps(_live_config()))
    # TMPDIR: the killed child cannot remove EnvoyProcess's temp dir, so keep it under tmp_path.
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _ENVOY_CHILD,
        str(config_path),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    envoy_pid: int | None = None
    started: int | None = None
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(child.stdout.readline(), 30.0)
        assert line.strip().isdigit(), f"child printed {line!r} instead of Envoy's pid"
        envoy_pid = int(line)
        started = _proc_start_time(envoy_pid)
        assert started is not None, "Envoy is not running in the child"

        child.kill()
        await child.wait()
        assert await _gone_within(envoy_pid, started, 10.0), f"Envoy (pid {envoy_pid}) outlived its parent"
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
        # Only SIGKILL the pid if it is still the very Envoy we started (not a reused pid).
        if envoy_pid is not None and started is not None and _proc_start_time(envoy_pid) == started:
            os.kill(envoy_pid, signal.SIGKILL)


async def test_stop_is_idempotent() -> None:
    envoy = EnvoyProcess(_live_config())
    await envoy.start()
    await envoy.stop()
    await envoy.stop()
    assert envoy.returncode == 0
