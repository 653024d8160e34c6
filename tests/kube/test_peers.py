"""``serve --peer-service``: replicas find each other in a headless Service's EndpointSlices."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from ports import free_port
from waiting import until

from .kubeenv import KubeEnv

PORT = free_port()
IPS = ("127.0.0.2", "127.0.0.3")


def peers_slice(ns: str, ips: tuple[str, ...]) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "extproc-peers-a",
            "namespace": ns,
            "labels": {"kubernetes.io/service-name": "extproc-peers"},
        },
        "addressType": "IPv4",
        "ports": [{"name": "peer", "port": PORT, "protocol": "TCP"}],
        "endpoints": [{"addresses": [ip], "conditions": {"ready": True}} for ip in ips],
    }


async def debug_peers(admin_port: int) -> list[dict[str, Any]] | None:
    url = f"http://127.0.0.1:{admin_port}/debug/state"
    with contextlib.suppress(aiohttp.ClientError, OSError):
        async with aiohttp.ClientSession() as session, session.get(url) as resp:
            if resp.status == 200:
                peers: list[dict[str, Any]] = (await resp.json())["peers"]
                return peers
    return None


async def until_peers(admin_port: int, expected: list[tuple[str, bool]], within: float) -> None:
    async def seen_as_expected() -> bool:
        peers = await debug_peers(admin_port)
        return peers is not None and [(p["address"], p["connected"]) for p in peers] == expected

    await until(seen_as_expected, within=within, what=f"the peers of admin :{admin_port} are {expected}")


async def test_replicas_find_each_other_in_the_service_and_follow_it(
    kube_env: KubeEnv, tmp_path: Path
) -> None:
    ns = kube_env.new_namespace("peers")
    kube_env.kubectl("apply", "-f", "-", input=yaml.safe_dump(peers_slice(ns, IPS)))
    procs = []
    admin_ports = []
    try:
        for ip in IPS:
            admin_port = free_port()
            admin_ports.append(admin_port)
            argv = ["serve", "--source", "kube", "--namespaces", ns, "--kubeconfig", str(kube_env.kubeconfig)]
            argv += ["--listen", f"127.0.0.1:{free_port()}", "--admin-listen", f"127.0.0.1:{admin_port}"]
            argv += ["--scrape-interval", "0", "--peer-listen", f"{ip}:{PORT}"]
            argv += ["--peer-service", f"{ns}/extproc-peers"]
            procs.append(
                await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "extproc",
                    *argv,
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.DEVNULL,
                )
            )
        a, b = admin_ports
        await until_peers(a, [(f"{IPS[1]}:{PORT}", True)], within=15)
        await until_peers(b, [(f"{IPS[0]}:{PORT}", True)], within=15)
        # B leaves the Service: A stops following it (and forgets what it held).
        kube_env.kubectl(
            "replace", "-f", "-", input=yaml.safe_dump(peers_slice(ns, IPS[:1]))
        )  # a CRD here: no SMP
        await until_peers(a, [], within=5)
    finally:
        for proc in procs:
            proc.kill()
            await proc.wait()
