"""The cluster source against a real API server: the same objects give the file source's catalog.

Objects are applied with kubectl; the file source reads what ``kubectl get -o yaml`` prints for
them (the objects as the cluster holds them: defaults applied, creation times set), so both
sources see the same objects by two different roads and must build equal catalogs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from ports import free_port
from waiting import eventually

from extproc.catalog.build import AWAITING_DISCOVERY
from extproc.catalog.model import Catalog
from extproc.kube.reflector import ReflectorOptions
from extproc.serve.app import Server
from extproc.settings import ServeSettings, SourceSettings
from extproc.sources.file import FileSource
from extproc.sources.kube import KubeSource
from extproc.types import ModelName, WorkerSetKey

from .kubeenv import KubeEnv
from .test_reflector import TIMEOUT, kube_threads

LLAMA, QWEN = "meta-llama/Meta-Llama-3-8B-Instruct", "Qwen/Qwen2-7B-Instruct"
API = "kinference.buoyant.io/v1alpha1"
KINDS = "inferenceworkersets,services,endpointslices"


def worker_set(namespace: str, name: str, service: str, port: int | str, **spec: Any) -> dict[str, Any]:
    annotations = spec.pop("annotations", {})
    return {
        "apiVersion": API,
        "kind": "InferenceWorkerSet",
        "metadata": {"name": name, "namespace": namespace, "annotations": annotations},
        "spec": {
            "serviceRef": {"name": service, "port": port},
            "profile": f"{name}-h100",
            "kvBlockSize": 16,
            **spec,
        },
    }


def service(namespace: str, name: str, ports: list[tuple[str, int]]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"clusterIP": "None", "ports": [{"name": n, "port": p, "protocol": "TCP"} for n, p in ports]},
    }


def endpoint(ip: str, pod: str, *, ready: bool = True, terminating: bool = False) -> dict[str, Any]:
    return {
        "addresses": [ip],
        "conditions": {"ready": ready, "serving": ready, "terminating": terminating},
        "targetRef": {"kind": "Pod", "name": pod},
    }


def endpoint_slice(
    namespace: str,
    name: str,
    service_name: str,
    ports: list[tuple[str, int]],
    endpoints: list[dict[str, Any]],
) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"kubernetes.io/service-name": service_name},
        },
        "addressType": "IPv4",
        "ports": [{"name": n, "port": p, "protocol": "TCP"} for n, p in ports],
        "endpoints": endpoints,
    }


LLAMA_PORTS = [("http", 80), ("metrics", 9400), ("kv-events", 5557), ("kv-replay", 5558)]
LLAMA_POD_PORTS = [("http", 8000), ("metrics", 9090), ("kv-events", 15557), ("kv-replay", 15558)]


def cluster_objects(ns: str) -> list[dict[str, Any]]:
    """Several worker sets, named ports, ready / not ready / terminating endpoints, and one object the
    schema accepts but the router cannot use."""
    return [
        # Named serving, metrics and KV ports; replay falls back to the port named kv-replay.
        worker_set(
            ns,
            "llama",
            "llama",
            "http",
            metricsPort="metrics",
            kvEvents={"port": "kv-events"},
            modelDiscovery={"mode": "Static"},
            models=[{"name": LLAMA, "aliases": ["chat"]}],
        ),
        # Numeric serving port on a Service that does not exist yet.
        worker_set(ns, "qwen", "qwen", 8000, modelDiscovery={"mode": "Static"}, models=[{"name": QWEN}]),
        # Endpoint discovery and no models: a set that waits for discovery, sharing llama's pods.
        worker_set(ns, "discovered", "llama", 80),
        # Valid for the schema (annotations are free text), not for the router.
        worker_set(
            ns,
            "bad-ranks",
            "llama",
            "http",
            annotations={"kinference.buoyant.io/data-parallel-size": "many"},
            models=[{"name": "bad"}],
        ),
        service(ns, "llama", LLAMA_PORTS),
        service(ns, "unrelated", [("", 8080)]),
        endpoint_slice(
            ns,
            "llama-a",
            "llama",
            LLAMA_POD_PORTS,
            [
                endpoint("127.0.0.11", "llama-0"),
                endpoint("127.0.0.12", "llama-1"),
                endpoint("127.0.0.13", "llama-2", ready=False),
                endpoint("127.0.0.14", "llama-3", ready=False, terminating=True),
            ],
        ),
        endpoint_slice(ns, "llama-b", "llama", LLAMA_POD_PORTS, [endpoint("127.0.0.15", "llama-4")]),
    ]


def apply(kube_env: KubeEnv, objects: list[dict[str, Any]]) -> None:
    kube_env.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objects))


def file_catalog(kube_env: KubeEnv, namespace: str, path: Path) -> Catalog:
    """The file source's catalog of what ``kubectl get -o yaml`` prints for the namespace."""
    path.write_text(kube_env.kubectl("get", KINDS, "-n", namespace, "-o", "yaml").stdout)
    return FileSource(SourceSettings(kind="file", path=path)).load()


class Published:
    """What a source publishes; ``latest`` is the newest catalog."""

    def __init__(self) -> None:
        self.catalogs: list[Catalog] = []

    def __call__(self, catalog: Catalog) -> None:
        self.catalogs.append(catalog)

    @property
    def latest(self) -> Catalog | None:
        return self.catalogs[-1] if self.catalogs else None


async def same_catalog(published: Published, expected: Catalog, what: str) -> None:
    """Wait until the kube source published ``expected``; on failure show both as /debug/state does."""
    try:
        await eventually(lambda: published.latest == expected, what=what, within=TIMEOUT)
    except AssertionError:
        got = published.latest.to_debug() if published.latest else None
        detail = json.dumps({"kube": got, "file": expected.to_debug()}, indent=1, sort_keys=True)
        raise AssertionError(f"{what}: catalogs differ\n{detail}") from None


@contextlib.asynccontextmanager
async def watching(kube_env: KubeEnv, namespaces: list[str]) -> AsyncIterator[tuple[KubeSource, Published]]:
    settings = SourceSettings(kind="kube", namespaces=tuple(namespaces), kubeconfig=kube_env.kubeconfig)
    source = KubeSource(settings, options=ReflectorOptions(watch_timeout=5, backoff_max=1.0))
    published = Published()
    task = asyncio.create_task(source.watch(published))
    try:
        yield source, published
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_kube_and_file_sources_build_the_same_catalog(kube_env: KubeEnv, tmp_path: Path) -> None:
    """Same objects, same catalog; and the kube catalog follows slices, deletions and new Services."""
    ns = kube_env.new_namespace("same")
    objects = cluster_objects(ns)
    apply(kube_env, objects)
    async with watching(kube_env, [ns]) as (source, published):
        expected = file_catalog(kube_env, ns, tmp_path / "1.yaml")
        await same_catalog(published, expected, "initial catalog")
        assert source.synced and source.last_error is None
        # What the catalog says, not only that the two agree.
        llama = expected.worker_sets[WorkerSetKey(f"{ns}/llama")]
        assert [
            (e.address, e.pod, e.metrics_port, e.kv_events_port, e.kv_replay_port) for e in llama.endpoints
        ] == [(f"127.0.0.{i}:8000", f"llama-{i - 11}", 9090, 15557, 15558) for i in (11, 12, 15)]
        assert llama.terminating == 1
        assert expected.routes[ModelName("chat")].upstream_model == LLAMA
        assert expected.worker_sets[WorkerSetKey(f"{ns}/discovered")].problems == (AWAITING_DISCOVERY,)
        assert "not found" in expected.worker_sets[WorkerSetKey(f"{ns}/qwen")].problems[0]
        [bad] = expected.problems
        assert (bad.kind, bad.name, bad.kept_previous) == ("InferenceWorkerSet", "bad-ranks", False)
        assert WorkerSetKey(f"{ns}/bad-ranks") not in expected.worker_sets

        # An endpoint turns not ready.
        kube_env.kubectl(
            "patch", "endpointslice", "llama-b", "-n", ns, "--type=merge",
            "-p", json.dumps({"endpoints": [endpoint("127.0.0.15", "llama-4", ready=False)]}),
        )  # fmt: skip
        expected = file_catalog(kube_env, ns, tmp_path / "2.yaml")
        await same_catalog(published, expected, "endpoint not ready")
        assert [e.address for e in expected.routes[ModelName(LLAMA)].endpoints] == [
            "127.0.0.11:8000",
            "127.0.0.12:8000",
        ]

        # A worker set is deleted; qwen's Service and its slice appear.
        kube_env.kubectl("delete", "inferenceworkerset", "discovered", "-n", ns)
        apply(
            kube_env,
            [
                service(ns, "qwen", [("", 8000)]),
                endpoint_slice(ns, "qwen-x", "qwen", [("", 8000)], [endpoint("127.0.0.21", "qwen-0")]),
            ],
        )
        expected = file_catalog(kube_env, ns, tmp_path / "3.yaml")
        await same_catalog(published, expected, "deleted set and new Service")
        assert WorkerSetKey(f"{ns}/discovered") not in expected.worker_sets
        assert [e.address for e in expected.routes[ModelName(QWEN)].endpoints] == ["127.0.0.21:8000"]


async def test_publishes_nothing_until_everything_is_listed(kube_env: KubeEnv, tmp_path: Path) -> None:
    """The first catalog is complete: never a catalog of worker sets without their endpoints."""
    ns = kube_env.new_namespace("first")
    apply(kube_env, cluster_objects(ns))
    async with watching(kube_env, [ns]) as (source, published):
        await eventually(lambda: published.latest is not None, what="first catalog", within=TIMEOUT)
        assert published.catalogs[0] == file_catalog(kube_env, ns, tmp_path / "c.yaml")
        assert source.debug_state()["synced"] is True


async def test_api_server_away_keeps_the_catalog_and_catches_up(kube_env: KubeEnv, tmp_path: Path) -> None:
    """While the API server is down nothing is published and the error shows; back, changes flow."""
    ns = kube_env.new_namespace("away")
    apply(kube_env, cluster_objects(ns))
    async with watching(kube_env, [ns]) as (source, published):
        await same_catalog(published, file_catalog(kube_env, ns, tmp_path / "1.yaml"), "initial catalog")
        count = len(published.catalogs)
        kube_env.stop_apiserver()
        try:
            await eventually(
                lambda: source.last_error is not None, what="the outage reported", within=TIMEOUT
            )
            state = source.debug_state()
            assert state["lastError"] and all(r["synced"] for r in state["resources"].values())
            assert len(published.catalogs) == count
        finally:
            kube_env.start_apiserver()
        kube_env.kubectl("delete", "inferenceworkerset", "qwen", "-n", ns)
        await same_catalog(published, file_catalog(kube_env, ns, tmp_path / "2.yaml"), "after the outage")
        await eventually(lambda: source.last_error is None, what="recovered", within=TIMEOUT)


async def test_edit_the_router_cannot_use_keeps_the_previous_version(kube_env: KubeEnv) -> None:
    """The schema lets an edit through that the router rejects: the set keeps routing as it was."""
    ns = kube_env.new_namespace("edit")
    apply(kube_env, cluster_objects(ns))
    async with watching(kube_env, [ns]) as (_, published):
        await eventually(lambda: published.latest is not None, what="first catalog", within=TIMEOUT)
        key = WorkerSetKey(f"{ns}/llama")
        before = published.latest.worker_sets[key]  # type: ignore[union-attr]
        annotation = "kinference.buoyant.io/data-parallel-size=lots"
        kube_env.kubectl("annotate", "inferenceworkerset", "llama", "-n", ns, annotation)
        await eventually(
            lambda: any(p.name == "llama" for p in published.latest.problems),  # type: ignore[union-attr]
            what="the rejected edit reported",
            within=TIMEOUT,
            every=0.05,
        )
        latest = published.latest
        assert latest is not None and latest.worker_sets[key] == before
        [problem] = [p for p in latest.problems if p.name == "llama"]
        assert problem.kept_previous


async def test_status_writes_and_unrelated_services_do_not_rebuild(kube_env: KubeEnv) -> None:
    """The reconciler's status PATCHes and Services no worker set refers to cost no build."""
    ns = kube_env.new_namespace("quiet")
    apply(kube_env, cluster_objects(ns))
    async with watching(kube_env, [ns]) as (source, published):
        await eventually(lambda: published.latest is not None, what="first catalog", within=TIMEOUT)
        builds = source.builds
        status = json.dumps({"status": {"state": "Ready"}})
        kube_env.kubectl(
            "patch", "inferenceworkerset", "llama", "-n", ns,
            "--subresource=status", "--type=merge", "-p", status,
        )  # fmt: skip
        kube_env.kubectl("annotate", "service", "unrelated", "-n", ns, "touched=yes")
        worker_sets, services = (r.objects for r in source.reflectors[:2])
        await eventually(
            lambda: (
                "status" in worker_sets[(ns, "llama")]
                and "touched" in services[(ns, "unrelated")]["metadata"].get("annotations", {})
            ),
            what="both changes seen",
            within=TIMEOUT,
            every=0.05,
        )
        await eventually(lambda: source.skipped >= 1, what="the changes looked at", within=TIMEOUT)
        await asyncio.sleep(source.debounce * 4)
        assert source.builds == builds and len(published.catalogs) == 1

        # A worker set that refers to the Service later sees it at once.
        apply(kube_env, [worker_set(ns, "late", "unrelated", 8080, models=[{"name": "late"}])])
        await eventually(
            lambda: WorkerSetKey(f"{ns}/late") in published.latest.worker_sets,  # type: ignore[union-attr]
            what="the new worker set",
            within=TIMEOUT,
            every=0.05,
        )
        late = published.latest.worker_sets[WorkerSetKey(f"{ns}/late")]  # type: ignore[union-attr]
        assert not any("not found" in problem for problem in late.problems)


async def test_a_failing_publish_does_not_stop_the_watch(kube_env: KubeEnv) -> None:
    """A bug in whoever takes the catalog is logged and counted; later changes still arrive."""
    ns = kube_env.new_namespace("pubfail")
    apply(kube_env, cluster_objects(ns))
    settings = SourceSettings(kind="kube", namespaces=(ns,), kubeconfig=kube_env.kubeconfig)
    source = KubeSource(settings, options=ReflectorOptions(watch_timeout=5, backoff_max=1.0))
    published = Published()

    def publish(catalog: Catalog) -> None:
        if source.publish_failed == 0:
            raise RuntimeError("publish bug")
        published(catalog)

    task = asyncio.create_task(source.watch(publish))
    try:
        await eventually(lambda: source.publish_failed == 1, what="the failed publish", within=TIMEOUT)
        kube_env.kubectl("delete", "inferenceworkerset", "qwen", "-n", ns)
        await eventually(lambda: published.latest is not None, what="the next catalog", within=TIMEOUT)
        assert WorkerSetKey(f"{ns}/qwen") not in published.latest.worker_sets  # type: ignore[union-attr]
        assert not task.done() and source.debug_state()["publishFailed"] == 1
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# -- end to end: serve --source kube, through real Envoy ----------------------------------------------


async def test_serve_keeps_routing_while_the_api_server_is_away(
    kube_env: KubeEnv, backends: Any, envoy_gateway: Any
) -> None:
    """A running serve routes from the cluster, keeps routing during an outage, and follows changes after."""
    ns = kube_env.new_namespace("serve")
    pods = await backends(2, models=[LLAMA])
    apply(
        kube_env,
        [
            worker_set(
                ns, "llama", "llama", "http", modelDiscovery={"mode": "Static"}, models=[{"name": LLAMA}]
            ),
            service(ns, "llama", [("http", 80)]),
            # One slice per pod: each fake pod listens on its own port.
            *(
                endpoint_slice(
                    ns, f"llama-{i}", "llama", [("http", pod.port)], [endpoint(pod.host, f"llama-{i}")]
                )
                for i, pod in enumerate(pods)
            ),
        ],
    )
    settings = ServeSettings(
        source=SourceSettings.parse("kube", namespaces=ns, kubeconfig=kube_env.kubeconfig),
        listen=f"127.0.0.1:{free_port()}",
        admin_listen="127.0.0.1:0",
        scrape_interval=0,
        seed=1,
        drain_seconds=0.5,
    )
    async with Server(settings) as server:
        await eventually(lambda: server.store.loaded, what="serve has the cluster's state", within=TIMEOUT)
        gateway = await envoy_gateway(extproc_address=("127.0.0.1", server.grpc_port), pool=pods)
        async with aiohttp.ClientSession() as http:

            async def served_by() -> str:
                payload = {"model": LLAMA, "messages": [{"role": "user", "content": "hi"}]}
                async with http.post(f"{gateway.url}/v1/chat/completions", json=payload) as answer:
                    assert answer.status == 200, await answer.text()
                    return str((await answer.json())["x_backend"]["address"])

            assert {await served_by() for _ in range(12)} == {pod.address for pod in pods}
            kube_env.stop_apiserver()
            try:
                await eventually(
                    lambda: server.source.last_error is not None, what="the outage noticed", within=TIMEOUT
                )
                assert {await served_by() for _ in range(12)} == {pod.address for pod in pods}
                async with http.get(f"http://127.0.0.1:{server.admin_port}/debug/state") as answer:
                    state = (await answer.json())["source"]
                assert state["kind"] == "kube" and state["lastError"]
                assert state["resources"]["endpointslices.discovery.k8s.io"]["objects"] == 2
            finally:
                kube_env.start_apiserver()
            kube_env.kubectl("delete", "endpointslice", "llama-0", "-n", ns)
            route = ModelName(LLAMA)
            await eventually(
                lambda: len(server.store.current.routes[route].endpoints) == 1,
                what="slice deletion",
                within=TIMEOUT,
            )
            assert {await served_by() for _ in range(6)} == {pods[1].address}


@pytest.fixture(autouse=True)
def _no_leftover_threads() -> Any:
    yield
    assert kube_threads() == [], "a reflector thread outlived its test"


OBJECTIVE_CRDS = Path(__file__).with_name("inferenceobjective-crd.yaml")


def objective(
    namespace: str, name: str, priority: object, pool: str, *, legacy: bool = False
) -> dict[str, Any]:
    group = "inference.networking.x-k8s.io" if legacy else "llm-d.ai"
    return {
        "apiVersion": f"{group}/v1alpha2",
        "kind": "InferenceObjective",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"priority": priority, "poolRef": {"name": pool}},
    }


async def test_inference_objectives_of_both_groups_reach_the_catalog_and_follow_edits(
    kube_env: KubeEnv,
) -> None:
    """With the CRDs installed, objectives are watched: the llm-d.ai one wins over a legacy one of
    the same name, a legacy-only one counts, a bad one is a problem, and an edit or a deletion is
    seen."""
    kube_env.apply_file(OBJECTIVE_CRDS)
    kube_env.wait_crd("inferenceobjectives.llm-d.ai")
    kube_env.wait_crd("inferenceobjectives.inference.networking.x-k8s.io")
    ns = kube_env.new_namespace("objectives")
    apply(
        kube_env,
        [
            *cluster_objects(ns),
            objective(ns, "interactive", 10, "llama"),
            objective(ns, "interactive", 99, "llama", legacy=True),
            objective(ns, "batch", -1, "llama", legacy=True),
            objective(ns, "broken", "high", "llama"),
        ],
    )
    async with watching(kube_env, [ns]) as (_source, published):

        def priorities() -> dict[str, int]:
            catalog = published.latest
            if catalog is None:
                return {}
            return {name: found[0].priority for name, found in catalog.objectives.items()}

        await eventually(
            lambda: priorities() == {"interactive": 10, "batch": -1}, what="objectives", within=TIMEOUT
        )
        catalog = published.latest
        assert catalog is not None
        route = catalog.resolve("chat")
        assert route is not None
        found = catalog.objective("interactive", route)
        assert found is not None and found.pool == WorkerSetKey(f"{ns}/llama")
        assert any(
            p.kind == "InferenceObjective" and p.name == "broken" and "spec.priority" in p.message
            for p in catalog.problems
        )
        apply(kube_env, [objective(ns, "interactive", 5, "llama")])
        await eventually(
            lambda: priorities().get("interactive") == 5, what="an edited priority", within=TIMEOUT
        )
        kube_env.kubectl("delete", "inferenceobjectives.llm-d.ai", "interactive", "-n", ns)
        # The legacy one of the same name is all that is left.
        await eventually(lambda: priorities().get("interactive") == 99, what="a deletion", within=TIMEOUT)
