"""``serve --source kube --pool-name`` as the endpoint picker of an InferencePool, end to end.

A real API server with the upstream InferencePool CRD (``vendor/``), Pods whose status the test
writes (Ready, loopback IPs: there is no kubelet), simulated engines listening on those IP:port
pairs, ``serve`` in-process and real Envoy (the ORIGINAL_DST config: it connects where we point)
in front. A worker set of another model routes beside the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from integration.sim_gateway import LLAMA, engine_settings
from ports import free_port
from waiting import eventually

from extproc.serve.app import Server
from extproc.settings import ServeSettings, SourceSettings
from extproc.sim.server import SimServer

from .kubeenv import KubeEnv
from .test_source import endpoint, endpoint_slice, service, worker_set

POOL_CRD = Path(__file__).parent / "vendor" / "inference.networking.k8s.io_inferencepools.yaml"
POOL_CRD_NAME = "inferencepools.inference.networking.k8s.io"
OTHER = "other-model"
#: Every pod serves the same two ports (data-parallel ranks): a pool's targetPorts are pool-wide.
PORTS = (free_port(), free_port())
PODS = {"pod-a": "127.0.0.2", "pod-b": "127.0.0.3", "pod-c": "127.0.0.4"}
WITHIN = 3.0


def pool_object(ns: str, **annotations: str) -> dict[str, Any]:
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "llama", "namespace": ns, "annotations": annotations},
        "spec": {
            "selector": {"matchLabels": {"app": "llama"}},
            "targetPorts": [{"number": p} for p in PORTS],
            "endpointPickerRef": {"name": "extproc", "port": {"number": 9002}},
        },
    }


def pod_object(ns: str, name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": {"app": "llama"}, "finalizers": ["test/hold"]},
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]},
    }


class Cluster:
    def __init__(self, env: KubeEnv, ns: str) -> None:
        self.env, self.ns = env, ns

    def apply(self, *objects: dict[str, Any]) -> None:
        self.env.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objects))

    def ready(self, pod: str, ready: bool = True) -> None:
        ip = PODS[pod]
        status = {
            "status": {
                "phase": "Running",
                "podIP": ip,
                "podIPs": [{"ip": ip}],
                "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            }
        }
        self.env.kubectl(
            "patch",
            "pod",
            pod,
            "-n",
            self.ns,
            "--subresource=status",
            "--type=merge",
            "-p",
            json.dumps(status),
        )

    def add_pod(self, pod: str) -> None:
        self.apply(pod_object(self.ns, pod))
        self.ready(pod)

    def release(self) -> None:
        """Let every pod go (their finalizer held them)."""
        for pod in PODS:
            self.env.kubectl(
                "patch", "pod", pod, "-n", self.ns, "--type=merge", "-p", '{"metadata":{"finalizers":null}}',
                check=False,
            )  # fmt: skip


@contextlib.asynccontextmanager
async def engines() -> AsyncIterator[dict[str, SimServer]]:
    """One simulated engine per pod and port, serving LLAMA; and one for the worker set's model."""
    async with contextlib.AsyncExitStack() as stack:
        sims: dict[str, SimServer] = {}
        for ip in PODS.values():
            for port in PORTS:
                settings = dataclasses.replace(engine_settings(), listen=f"{ip}:{port}", kv_events=None)
                sims[f"{ip}:{port}"] = await stack.enter_async_context(SimServer(settings))
        other = dataclasses.replace(
            engine_settings(), listen="127.0.0.5:0", kv_events=None, model=OTHER, served_model_names=(OTHER,)
        )
        sims[OTHER] = await stack.enter_async_context(SimServer(other))
        yield sims


def settings(env: KubeEnv, ns: str) -> ServeSettings:
    return ServeSettings(
        source=SourceSettings(
            kind="kube", namespaces=(ns,), kubeconfig=env.kubeconfig, pool_name="llama", pool_namespace=ns
        ),
        listen=f"127.0.0.1:{free_port()}",
        admin_listen="127.0.0.1:0",
        decision_headers=True,
        drain_seconds=0.1,
        scrape_interval=0.2,
    )


def install_crd(env: KubeEnv) -> None:
    env.kubectl("apply", "--validate=false", "-f", str(POOL_CRD))  # v1.20 lacks CEL rules
    env.wait_crd(POOL_CRD_NAME)


async def ask(session: aiohttp.ClientSession, url: str, model: str) -> tuple[int, str | None, dict[str, Any]]:
    body = {"model": model, "prompt": "hello", "max_tokens": 2}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        return resp.status, resp.headers.get("x-extproc-endpoint"), json.loads(await resp.text())


async def picks(session: aiohttp.ClientSession, url: str, n: int = 24) -> set[str]:
    seen = set()
    for _ in range(n):
        status, endpoint_, body = await ask(session, url, LLAMA)
        assert status == 200, body
        assert endpoint_ is not None
        seen.add(endpoint_)
    return seen


async def test_serve_starts_and_routes_worker_sets_without_the_inferencepool_crd(
    kube_env: KubeEnv, tmp_path: Path
) -> None:
    """``--pool-name`` on a cluster without the CRD: the pool is reported missing, worker sets route."""
    kube_env.kubectl("delete", "crd", POOL_CRD_NAME, "--ignore-not-found", "--wait=true")
    ns = kube_env.new_namespace("nocrd")
    async with engines() as sims:
        other = sims[OTHER]
        kube_env.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(_worker_set_objects(ns, other)))
        server = Server(settings(kube_env, ns))
        await server.start()
        try:
            await eventually(
                lambda: server.store.current.resolve(OTHER) is not None, within=20, what="worker set"
            )
            assert (
                server.store.current.unavailable()
                == f"InferencePool {ns}/llama is not there (deleted, or not created yet)"
            )
            pool_state = server.debug_state()["source"]["inferencePool"]
            assert pool_state["found"] is False
        finally:
            await server.stop()


def _worker_set_objects(ns: str, other: SimServer) -> list[dict[str, Any]]:
    ip, port = other.address.rsplit(":", 1)
    return [
        worker_set(ns, "other", "other", "http", modelDiscovery={"mode": "Static"}, models=[{"name": OTHER}]),
        service(ns, "other", [("http", 80)]),
        endpoint_slice(ns, "other-a", "other", [("http", int(port))], [endpoint(ip, "other-0")]),
    ]


async def test_a_pool_routes_its_ready_pods_and_follows_them(
    kube_env: KubeEnv, envoy_gateway: Callable[..., Awaitable[Any]], tmp_path: Path
) -> None:
    install_crd(kube_env)
    ns = kube_env.new_namespace("pool")
    cluster = Cluster(kube_env, ns)
    async with engines() as sims, contextlib.AsyncExitStack() as stack:
        stack.callback(cluster.release)
        cluster.apply(pool_object(ns), *_worker_set_objects(ns, sims[OTHER]))
        cluster.add_pod("pod-a")
        cluster.add_pod("pod-b")
        server = Server(settings(kube_env, ns))
        stack.push_async_callback(server.stop)
        await server.start()
        gateway = await envoy_gateway(
            extproc_address=("127.0.0.1", server.grpc_port), config="gateway-original-dst.yaml"
        )
        url = gateway.url
        session = await stack.enter_async_context(
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        )
        await eventually(
            lambda: server.store.current.resolve(LLAMA) is not None,
            within=20,
            what="the pool's models discovered",
        )

        # Both ports of both pods get traffic.
        a = {f"127.0.0.2:{p}" for p in PORTS}
        b = {f"127.0.0.3:{p}" for p in PORTS}
        assert await picks(session, url, 40) == a | b

        # /v1/models lists what is served; an unknown model is 404; the worker set routes beside.
        async with session.get(f"{url}/v1/models") as resp:
            listed = {m["id"] for m in (await resp.json())["data"]}
        assert {LLAMA, OTHER} <= listed
        status, _, body = await ask(session, url, "no-such-model")
        assert status == 404 and body["error"]["code"] == "model_not_found"
        status, where, _ = await ask(session, url, OTHER)
        assert status == 200 and where == sims[OTHER].address

        # NotReady: gone within ~3 s.
        cluster.ready("pod-a", ready=False)
        await eventually(lambda: _addresses(server) == b, within=WITHIN, what="pod-a NotReady leaves")
        assert await picks(session, url) <= b

        # A new Ready pod joins, its models discovered.
        cluster.add_pod("pod-c")
        c = {f"127.0.0.4:{p}" for p in PORTS}
        await eventually(lambda: _addresses(server) == b | c, within=WITHIN, what="pod-c joins")
        await eventually(lambda: _served(server) >= b | c, within=10, what="pod-c's models discovered")
        assert await picks(session, url, 40) == b | c

        # Losing the label: gone.
        kube_env.kubectl("label", "pod", "pod-b", "-n", ns, "app-")
        await eventually(
            lambda: _addresses(server) == c, within=WITHIN, what="pod-b without the label leaves"
        )

        # Being deleted (a finalizer holds it; Ready still says True): gone.
        kube_env.kubectl("delete", "pod", "pod-c", "-n", ns, "--wait=false")
        await eventually(
            lambda: _addresses(server) == set(), within=WITHIN, what="pod-c being deleted leaves"
        )
        status, _, body = await ask(session, url, LLAMA)
        assert status == 503 and body["error"]["code"] == "no_ready_endpoint"

        # Back, then the pool deleted: a clean 503, and the worker set still routes.
        cluster.ready("pod-a")
        await eventually(lambda: _addresses(server) == a, within=WITHIN, what="pod-a Ready again")
        # An annotation the router cannot use: a problem, and the last good pool keeps routing.
        cluster.apply(pool_object(ns, **{"kinference.buoyant.io/kv-block-size": "big"}))
        await eventually(
            lambda: any(p.kind == "InferencePool" for p in server.store.current.problems),
            within=WITHIN,
            what="the bad annotation reported",
        )
        assert await picks(session, url, 8) <= a
        kube_env.kubectl("delete", "inferencepool", "llama", "-n", ns)
        await eventually(
            lambda: server.store.current.unavailable() is not None, within=WITHIN, what="pool gone"
        )
        status, _, body = await asyncio.wait_for(ask(session, url, LLAMA), 5)
        assert status == 503 and "InferencePool" in body["error"]["message"]
        status, _, _ = await ask(session, url, OTHER)
        assert status == 200


def _addresses(server: Server) -> set[str]:
    pool = server.store.current.worker_sets.get(next(iter(_pool_keys(server)), None))  # type: ignore[arg-type]
    return set() if pool is None else {e.address for e in pool.endpoints}


def _served(server: Server) -> set[str]:
    return {
        e.address
        for key in _pool_keys(server)
        for e in server.store.current.worker_sets[key].endpoints
        if (served := server.store.current.worker_sets[key].served) and e.address in served
    }


def _pool_keys(server: Server) -> list[Any]:
    picks_for = server.store.current.picks_for
    return [picks_for] if picks_for in server.store.current.worker_sets else []
