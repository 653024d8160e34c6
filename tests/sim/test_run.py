"""``extproc sim`` as a user runs it, and N engines started together (the fleet helper)."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import aiohttp
import pytest
from ports import free_port
from processes import run_extproc

from extproc.errors import ConfigError
from extproc.sim.fleet import SimFleet, check_port_layout, replica_settings
from extproc.sim.run import add_sim_parser, sim_settings
from extproc.sim.settings import KVEventSettings, SimSettings


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kv-replay-port", "5658"], "--kv-replay-port needs --kv-events-port"),
        (["--listen", "nowhere"], "--listen: expected HOST:PORT"),
        (["--time-scale", "0"], "--time-scale must be positive"),
        (["--data-parallel-size", "0"], "--data-parallel-size must be in 1-64"),
        (["--lora-modules", "sql"], "--lora-modules: expected NAME=PATH"),
        (["--chat-template", "/no/such/template.jinja"], "neither a file nor a shipped template"),
        (["--kv-events-port", "5557", "--kv-replay-port", "5558", "--data-parallel-size", "2"], "overlap"),
        (["--replicas", "2", "--listen", "127.0.0.1:9000", "--kv-events-port", "9001"], "overlap"),
        (
            ["--kv-events-port", "0", "--kv-drop-probability", "2"],
            "--kv-drop-probability (drop_probability) must be in 0-1",
        ),
        (["--kv-delay-ms", "5"], "--kv-delay-ms needs --kv-events-port"),
        (["--num-gpu-blocks-override", "0"], "num_gpu_blocks"),
        (["--cpu-offload-blocks", "-1"], "cpu_offload_blocks must be an integer >= 0"),
        (["--cpu-load-tokens-per-s", "1e5"], "--cpu-load-tokens-per-s needs --cpu-offload-blocks"),
        (["--tokenize-cache-mb", "-1"], "--tokenize-cache-mb must be 0 (off) or more"),
    ],
    ids=[
        "replay-without-pub",
        "bad-listen",
        "zero-time-scale",
        "zero-dp",
        "bad-lora",
        "missing-template",
        "dp-port-overlap",
        "replica-port-overlap",
        "bad-drop",
        "delay-without-pub",
        "zero-blocks",
        "negative-cpu-blocks",
        "cpu-rate-without-tier",
        "negative-tokenize-cache",
    ],
)
async def test_bad_flags_exit_2_naming_the_flag(args: list[str], message: str) -> None:
    """Bad flags exit 2 with a message naming what is wrong, never a traceback."""
    returncode, output = await run_extproc("sim", *args)
    assert returncode == 2, output
    assert message in output
    assert "Traceback" not in output


def test_cpu_offload_flags_reach_the_engine() -> None:
    """--cpu-offload-blocks and --cpu-load-tokens-per-s set the engine's CPU tier."""
    parser = argparse.ArgumentParser()
    add_sim_parser(parser.add_subparsers())
    args = parser.parse_args(["sim", "--cpu-offload-blocks", "96000", "--cpu-load-tokens-per-s", "2e5"])
    engine = sim_settings(args).engine
    assert (engine.cpu_offload_blocks, engine.cpu_load_tokens_per_s) == (96_000, 200_000.0)
    default = sim_settings(parser.parse_args(["sim"])).engine
    assert default.cpu_offload_blocks == 0


def test_the_hash_algorithm_flag_reaches_the_engine() -> None:
    parser = argparse.ArgumentParser()
    add_sim_parser(parser.add_subparsers())
    args = parser.parse_args(["sim", "--prefix-caching-hash-algo", "xxhash"])
    assert sim_settings(args).engine.prefix_caching_hash_algo == "xxhash"
    assert sim_settings(parser.parse_args(["sim"])).engine.prefix_caching_hash_algo == "sha256"


def test_the_tokenize_cache_flag_is_off_by_default_and_in_mib() -> None:
    parser = argparse.ArgumentParser()
    add_sim_parser(parser.add_subparsers())
    assert sim_settings(parser.parse_args(["sim"])).tokenize_cache_bytes == 0
    args = parser.parse_args(["sim", "--tokenize-cache-mb", "1.5"])
    assert sim_settings(args).tokenize_cache_bytes == 1_572_864


async def test_sim_prints_where_it_listens_and_stops_on_sigterm() -> None:
    """The command prints its HTTP and KV-event endpoints, serves, and exits 0 on SIGTERM."""
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "extproc",
        "sim",
        "--listen",
        f"127.0.0.1:{port}",
        "--kv-events-port",
        "0",
        "--kv-replay-port",
        "0",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode()
        assert f"sim http://127.0.0.1:{port}" in line and "kv=tcp://127.0.0.1:" in line and "replay=" in line
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/health") as resp:
            assert resp.status == 200
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_replicas_get_consecutive_ports_and_kv_ports_strided_by_ranks() -> None:
    """Replica i listens on base + i; its KV ports start at base + i * data_parallel_size."""
    kv = KVEventSettings(port=5557, replay_port=5657)
    base = SimSettings(listen="127.0.0.1:8000", data_parallel_size=2, kv_events=kv)
    check_port_layout(base, 3)
    second = replica_settings(base, 2)
    assert second.listen == "127.0.0.1:8002"
    assert second.kv_events is not None
    assert (second.kv_events.port, second.kv_events.replay_port) == (5561, 5661)


def test_overlapping_port_ranges_are_refused() -> None:
    """HTTP ports of 10 replicas would run into the KV ports: refused before anything starts."""
    base = SimSettings(listen="127.0.0.1:5550", kv_events=KVEventSettings(port=5557))
    with pytest.raises(ConfigError, match="overlap"):
        check_port_layout(base, 10)


async def test_fleet_starts_independent_engines_on_free_ports() -> None:
    """A fleet on port 0 gives every engine its own HTTP port and cache."""
    settings = SimSettings(listen="127.0.0.1:0", time_scale=0.01, kv_events=KVEventSettings(port=0))
    async with SimFleet(settings, replicas=3) as fleet, aiohttp.ClientSession() as http:
        assert len(set(fleet.addresses)) == 3
        first = fleet.servers[0]
        body = {"prompt": list(range(100, 140)), "max_tokens": 1}
        async with http.post(f"http://{first.address}/v1/completions", json=body) as resp:
            assert resp.status == 200
        queries = [server.ranks[0].core.prefix_cache_queries for server in fleet.servers]
        assert queries == [40, 0, 0]
        endpoints = {server.state()["ranks"][0]["kv_events"]["endpoint"] for server in fleet.servers}
        assert len(endpoints) == 3
