"""``extproc reconcile`` against a real API server, beside ``serve --source kube`` and simulated engines.

Everything runs as it would in a pod: real subprocesses for the engines (``extproc sim``, serving
``/v1/models`` and publishing KV events over ZMQ), the router and one or two reconcilers; objects
go in with kubectl; the test watches ``status`` follow. Each test has its own namespace and Lease.
Engines listen on distinct loopback addresses (127.0.0.2, 127.0.0.3) with the same ports, as pods
of one Service do.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from ports import free_port

from .kubeenv import KubeEnv

HTTP_ROUTE_CRD = Path(__file__).with_name("httproute-crd.yaml")
MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"  # the simulator's default model
WINDOW = 4096
ENGINES = ("127.0.0.2", "127.0.0.3")
#: Short leases so a handover takes seconds, not the 15 s default.
FAST_LEASE = ("--lease-duration", "3", "--lease-renew-interval", "1", "--lease-retry-interval", "0.5")


class World:
    """One test's namespace, processes and objects."""

    def __init__(self, env: KubeEnv, namespace: str, logs: Path) -> None:
        self.env = env
        self.ns = namespace
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.http_port = free_port(ENGINES[0])
        self.kv_port = free_port(ENGINES[0])
        self.serve_admin = free_port()

    # -- processes -----------------------------------------------------------------------------

    def start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        with (self.logs / f"{name}.log").open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "extproc", *args], stdout=log, stderr=subprocess.STDOUT
            )
        self.procs[name] = proc
        return proc

    def engine(self, ip: str) -> None:
        self.start(
            f"sim-{ip}", "sim", "--listen", f"{ip}:{self.http_port}", "--kv-events-port", str(self.kv_port),
            "--max-model-len", str(WINDOW), "--time-scale", "0.01",
        )  # fmt: skip
        self.wait(lambda: _http_ok(f"http://{ip}:{self.http_port}/health"), f"engine {ip} up")

    def serve(self) -> None:
        self.start(
            "serve", "serve", "--source", "kube", "--namespaces", self.ns,
            "--kubeconfig", str(self.env.kubeconfig), "--listen", "127.0.0.1:0",
            "--admin-listen", f"127.0.0.1:{self.serve_admin}", "--scrape-interval", "0",
        )  # fmt: skip

    def reconciler(self, identity: str, *extra: str, namespaces: tuple[str, ...] = ()) -> int:
        """Start one reconciler (of our namespace and ``namespaces``); returns its admin port."""
        admin = free_port()
        watched = ",".join((self.ns, *namespaces))
        self.start(
            identity, "reconcile", "--kubeconfig", str(self.env.kubeconfig), "--namespaces", watched,
            "--serve-admin", f"http://127.0.0.1:{self.serve_admin}", "--serve-poll-interval", "0.5",
            "--lease-namespace", self.ns, "--identity", identity, "--admin-listen", f"127.0.0.1:{admin}",
            "--resync-interval", "5", *extra,
        )  # fmt: skip
        self.wait(lambda: _http_ok(f"http://127.0.0.1:{admin}/healthz"), f"reconciler {identity} up")
        return admin

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    # -- objects -------------------------------------------------------------------------------

    def replace_slice(self, obj: dict[str, Any]) -> None:
        """kubectl apply would strategic-merge-patch the slice, which the v1 shim refuses."""
        obj["metadata"]["namespace"] = self.ns
        self.env.kubectl("replace", "-f", "-", input=json.dumps(obj))

    def apply(self, *objects: dict[str, Any]) -> None:
        for obj in objects:
            obj.setdefault("metadata", {})["namespace"] = obj["metadata"].get("namespace", self.ns)
        self.env.kubectl(
            "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects})
        )

    def worker_set(self, **spec: Any) -> dict[str, Any]:
        return {
            "apiVersion": "kinference.buoyant.io/v1alpha1",
            "kind": "InferenceWorkerSet",
            "metadata": {"name": "llama"},
            "spec": {
                "serviceRef": {"name": "llama", "port": "http"},
                "profile": "default",
                "kvBlockSize": 16,
                "kvEvents": {"port": "kv"},
                "modelDiscovery": {"mode": "Endpoint", "interval": "1s"},
                "models": [{"name": MODEL, "aliases": ["chat"]}],
                **spec,
            },
        }

    def service(self) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "llama"},
            "spec": {
                "ports": [
                    {"name": "http", "port": 80, "targetPort": self.http_port},
                    {"name": "kv", "port": 5557, "targetPort": self.kv_port},
                ]
            },
        }

    def endpoint_slice(self, ready: tuple[str, ...], terminating: tuple[str, ...] = ()) -> dict[str, Any]:
        return {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {"name": "llama-1", "labels": {"kubernetes.io/service-name": "llama"}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": self.http_port}, {"name": "kv", "port": self.kv_port}],
            "endpoints": [{"addresses": [ip], "conditions": {"ready": True}} for ip in ready]
            + [
                {"addresses": [ip], "conditions": {"ready": False, "terminating": True}} for ip in terminating
            ],
        }

    def route(self, name: str, namespace: str, set_namespace: str | None = None) -> dict[str, Any]:
        ref: dict[str, Any] = {
            "group": "kinference.buoyant.io",
            "kind": "InferenceWorkerSet",
            "name": "llama",
        }
        if set_namespace is not None:
            ref["namespace"] = set_namespace
        return {
            "apiVersion": "gateway.networking.k8s.io/v1",
            "kind": "HTTPRoute",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"rules": [{"backendRefs": [{"name": "other", "port": 80}]}, {"backendRefs": [ref]}]},
        }

    # -- reading -------------------------------------------------------------------------------

    def object(self, kind: str, name: str) -> dict[str, Any]:
        obj: dict[str, Any] = json.loads(
            self.env.kubectl("get", kind, name, "-n", self.ns, "-o", "json").stdout
        )
        return obj

    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = self.object("inferenceworkerset", "llama").get("status", {})
        return status

    def lease(self) -> dict[str, Any]:
        spec: dict[str, Any] = self.object("lease", "extproc-reconciler").get("spec", {})
        return spec

    def wait_status(
        self, check: Callable[[dict[str, Any]], bool], what: str, within: float = 60.0
    ) -> dict[str, Any]:
        found: dict[str, Any] = {}

        def met() -> bool:
            nonlocal found
            found = self.status()
            return check(found)

        self.wait(met, what, within, lambda: json.dumps(found, indent=1))
        return found

    def wait(
        self, check: Callable[[], bool], what: str, within: float = 60.0, show: Callable[[], str] = lambda: ""
    ) -> None:
        """Poll until ``check()``; on timeout fail with ``show()`` and the processes' logs."""
        deadline = time.monotonic() + within
        while not check():
            if time.monotonic() > deadline:
                tails = "\n".join(
                    f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}"
                    for p in sorted(self.logs.glob("*.log"))
                )
                pytest.fail(f"timed out waiting for {what}\n{show()}\n{tails}")
            time.sleep(0.2)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


def condition(status: dict[str, Any], kind: str) -> tuple[str, str] | None:
    found = next((c for c in status.get("conditions", []) if c["type"] == kind), None)
    return None if found is None else (found["status"], found["reason"])


def ready_with(status: dict[str, Any], endpoints: int, subscribed: int) -> bool:
    return (
        status.get("endpoints", {}).get("ready") == endpoints
        and status.get("kvEvents", {}).get("subscribedEndpoints") == subscribed
        and any(m.get("contextWindow") for m in status.get("models", []))
        and status.get("state") in ("Ready", "Degraded")
    )


@pytest.fixture(scope="module")
def http_routes(kube_env: KubeEnv) -> None:
    """The test server has no Gateway API: serve HTTPRoutes from a minimal test-only CRD."""
    kube_env.apply_file(HTTP_ROUTE_CRD)
    kube_env.wait_crd("httproutes.gateway.networking.k8s.io")


@pytest.fixture
def world(kube_env: KubeEnv, namespace: str, tmp_path: Path, http_routes: None) -> Iterator[World]:
    w = World(kube_env, namespace, tmp_path)
    try:
        yield w
    finally:
        w.stop_all()


def test_status_follows_slices_discovery_kv_subscriptions_and_routes(world: World) -> None:
    """The status tracks endpoints, discovered models and windows, KV subscriptions and HTTPRoutes."""
    for ip in ENGINES:
        world.engine(ip)
    world.apply(world.service(), world.worker_set(), world.endpoint_slice(ready=ENGINES[:1]))
    world.serve()
    other = world.env.new_namespace("routes")
    admin = world.reconciler("r1", namespaces=(other,))

    status = world.wait_status(lambda s: ready_with(s, 1, 1), "one ready, subscribed endpoint")
    assert status["state"] == "Ready"
    assert status["models"] == [
        {
            "upstreamName": MODEL,
            "aliases": ["chat"],
            "readyEndpoints": 1,
            "contextWindow": {"min": WINDOW, "max": WINDOW},
        }
    ]
    assert status["kvEvents"] == {"configured": True, "subscribedEndpoints": 1}
    assert {c["type"]: c["status"] for c in status["conditions"]} == {
        "Accepted": "True", "ResolvedRefs": "True", "Ready": "True", "KVEventsReady": "True",
    }  # fmt: skip
    ready_since = next(c["lastTransitionTime"] for c in status["conditions"] if c["type"] == "Ready")

    world.replace_slice(world.endpoint_slice(ready=ENGINES, terminating=("127.0.0.9",)))
    status = world.wait_status(lambda s: ready_with(s, 2, 2), "both endpoints ready and subscribed")
    assert status["endpoints"] == {"ready": 2, "terminating": 1}
    assert status["models"][0]["readyEndpoints"] == 2
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["lastTransitionTime"] == ready_since, "Ready stayed True: its transition time stays"

    world.apply(world.route("chat", world.ns), world.route("shared", other, set_namespace=world.ns))
    status = world.wait_status(lambda s: len(s.get("referencedBy", [])) == 2, "referencedBy")
    assert status["referencedBy"] == sorted([f"{world.ns}/chat", f"{other}/shared"])

    spec = world.worker_set(models=[{"name": MODEL, "aliases": ["chat", "llama"]}])
    world.apply(spec)
    status = world.wait_status(
        lambda s: s.get("models", [{}])[0].get("aliases") == ["chat", "llama"], "the new alias"
    )
    assert {c["observedGeneration"] for c in status["conditions"]} == {2}

    table = world.env.kubectl("get", "iws", "-n", world.ns).stdout.splitlines()
    assert table[0].split() == ["NAME", "PROFILE", "READY", "MODEL", "KV", "STATE", "AGE"]
    assert table[1].split()[:6] == ["llama", "default", "2", MODEL, "2", "Ready"]
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=5).read().decode()
    assert "extproc_reconcile_leader 1.0" in metrics
    assert "extproc_reconcile_serve_reachable 1.0" in metrics
    assert 'extproc_reconcile_status_writes_total{result="ok"}' in metrics


def test_a_second_replica_takes_over_when_the_leader_dies(world: World) -> None:
    """Only the Lease holder writes; killing it hands over, and status keeps following the cluster."""
    world.engine(ENGINES[0])
    world.apply(world.service(), world.worker_set(), world.endpoint_slice(ready=ENGINES[:1]))
    world.serve()
    admins = {name: world.reconciler(name, *FAST_LEASE) for name in ("r1", "r2")}
    world.wait_status(lambda s: ready_with(s, 1, 1), "a ready status")
    first = world.lease()
    leader = first["holderIdentity"]
    follower = next(n for n in admins if n != leader)
    state = _get_json(f"http://127.0.0.1:{admins[follower]}/debug/state")
    assert state["leader"] is False

    world.procs[leader].send_signal(signal.SIGKILL)  # no release: the lease has to expire
    world.wait(lambda: world.lease().get("holderIdentity") == follower, f"{follower} to take the lease")
    assert world.lease()["leaseTransitions"] == first.get("leaseTransitions", 0) + 1

    world.replace_slice(world.endpoint_slice(ready=ENGINES[:1], terminating=("127.0.0.9",)))
    world.wait_status(lambda s: s.get("endpoints", {}).get("terminating") == 1, "the new leader's write")

    world.procs[follower].send_signal(signal.SIGTERM)
    assert world.procs[follower].wait(timeout=20) == 0
    assert "holderIdentity" not in world.lease(), "a clean stop releases the lease"


def test_status_catches_up_after_the_api_server_comes_back(world: World) -> None:
    """While the API server is away serve keeps routing; what changed meanwhile reaches status after."""
    for ip in ENGINES:
        world.engine(ip)
    world.apply(world.service(), world.worker_set(), world.endpoint_slice(ready=ENGINES))
    world.serve()
    world.reconciler("r1", *FAST_LEASE)
    world.wait_status(lambda s: ready_with(s, 2, 2), "both endpoints subscribed")

    def serve_sees(subscribed: int) -> bool:
        state = _get_json(f"http://127.0.0.1:{world.serve_admin}/debug/state")
        entry = state["workerSetStatus"].get(f"{world.ns}/llama", {})
        return bool(
            entry.get("endpoints", {}).get("ready") == 2
            and entry["kvEvents"]["subscribedEndpoints"] == subscribed
        )

    world.env.stop_apiserver()
    try:
        world.procs[f"sim-{ENGINES[1]}"].send_signal(signal.SIGKILL)
        world.wait(lambda: serve_sees(1), "serve to see one engine's KV stream gone, on its last known state")
    finally:
        world.env.start_apiserver()
    status = world.wait_status(
        lambda s: s.get("kvEvents", {}).get("subscribedEndpoints") == 1, "status to catch up", within=90
    )
    assert condition(status, "KVEventsReady") == ("False", "PartiallySubscribed")
    assert status["state"] == "Degraded"
    assert all(proc.poll() is None for name, proc in world.procs.items() if name != f"sim-{ENGINES[1]}")
