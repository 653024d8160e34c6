"""The reflector against a real API server: list, watch, resume, relist on 410, outages, stopping."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import yaml
from waiting import eventually

from extproc.kube.reflector import Reflector, ReflectorOptions
from extproc.kube.resources import SERVICES, ResourceType

from .kubeenv import KubeEnv

TIMEOUT = 30.0
#: Short server-side watches, so that resuming happens many times within a test.
SHORT_WATCHES = ReflectorOptions(watch_timeout=1, backoff_initial=0.1, backoff_max=1.0)


def service(name: str, namespace: str, port: int = 80, **annotations: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "annotations": annotations},
        "spec": {"clusterIP": "None", "ports": [{"name": "http", "port": port}]},
    }


def apply(kube_env: KubeEnv, *objects: dict[str, Any]) -> None:
    kube_env.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objects))


def kubectl_objects(
    kube_env: KubeEnv, namespace: str, plural: str = "services"
) -> dict[tuple[str, str], Any]:
    """What ``kubectl get -o json`` shows, keyed like ``Reflector.objects``."""
    listed = json.loads(kube_env.kubectl("get", plural, "-n", namespace, "-o", "json").stdout)
    return {(o["metadata"]["namespace"], o["metadata"]["name"]): o for o in listed["items"]}


def kube_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kube-")]


@contextlib.asynccontextmanager
async def running(reflector: Reflector) -> AsyncIterator[Reflector]:
    task = asyncio.create_task(reflector.run())
    try:
        yield reflector
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def reflector_for(
    kube_env: KubeEnv,
    namespaces: list[str] | None,
    *,
    resource: ResourceType = SERVICES,
    options: ReflectorOptions = SHORT_WATCHES,
    on_change: Callable[[], None] = lambda: None,
) -> Reflector:
    return Reflector(kube_env.api_client(), resource, namespaces, on_change, options=options)


async def test_mirrors_objects_exactly_as_kubectl_shows_them(kube_env: KubeEnv, namespace: str) -> None:
    """Listed in pages, then followed: the objects equal kubectl's JSON after every kind of change."""
    apply(kube_env, *(service(f"svc-{i}", namespace, 8000 + i) for i in range(5)))
    options = ReflectorOptions(page_size=2)
    async with running(reflector_for(kube_env, [namespace], options=options)) as reflector:
        await eventually(lambda: reflector.synced, what="initial list", within=TIMEOUT)
        assert reflector.objects == kubectl_objects(kube_env, namespace)
        assert reflector.lists == 1

        apply(kube_env, service("svc-0", namespace, 9999), service("svc-new", namespace))
        kube_env.kubectl("delete", "service", "svc-1", "-n", namespace)
        expected = kubectl_objects(kube_env, namespace)
        await eventually(lambda: reflector.objects == expected, what="changes followed", within=TIMEOUT)
        assert reflector.objects[(namespace, "svc-0")]["spec"]["ports"][0]["port"] == 9999
        assert (namespace, "svc-1") not in reflector.objects


async def test_on_change_runs_on_the_event_loop_after_each_change(kube_env: KubeEnv, namespace: str) -> None:
    """Readers are told on the loop's thread, and see the change already applied."""
    seen: list[tuple[str, bool]] = []
    reflector: Reflector | None = None

    def on_change() -> None:
        assert reflector is not None
        seen.append((threading.current_thread().name, (namespace, "late") in reflector.objects))

    reflector = reflector_for(kube_env, [namespace], on_change=on_change)
    async with running(reflector):
        await eventually(lambda: reflector.synced, what="initial list", within=TIMEOUT)
        apply(kube_env, service("late", namespace))
        await eventually(
            lambda: any(present for _, present in seen), what="the new Service reported", within=TIMEOUT
        )
    assert {name for name, _ in seen} == {threading.main_thread().name}


async def test_follows_only_the_namespaces_asked_for(kube_env: KubeEnv) -> None:
    """A namespace list watches each of them; all namespaces (None) sees every one."""
    first, second, other = (kube_env.new_namespace("scope") for _ in range(3))
    for ns in (first, second, other):
        apply(kube_env, service("llama", ns))
    listed = reflector_for(kube_env, [first, second])
    everything = reflector_for(kube_env, None)
    async with running(listed), running(everything):
        await eventually(lambda: listed.synced and everything.synced, what="initial lists", within=TIMEOUT)
        apply(kube_env, service("qwen", second), service("qwen", other))
        want = {(first, "llama"), (second, "llama"), (second, "qwen")}
        await eventually(
            lambda: set(listed.objects) == want, what="listed namespaces followed", within=TIMEOUT
        )
        await eventually(
            lambda: (other, "qwen") in everything.objects, what="all namespaces followed", within=TIMEOUT
        )
        assert {(first, "llama"), (other, "llama")} <= set(everything.objects)


async def test_watch_resumes_after_its_timeout_without_listing_again(
    kube_env: KubeEnv, namespace: str
) -> None:
    """Watches that the server ends on time are resumed from the last resourceVersion, not relisted."""
    async with running(reflector_for(kube_env, [namespace])) as reflector:
        await eventually(lambda: reflector.synced, what="initial list", within=TIMEOUT)
        await eventually(lambda: reflector.watches >= 3, what="several watches in a row", within=TIMEOUT)
        apply(kube_env, service("after-resume", namespace))
        await eventually(
            lambda: (namespace, "after-resume") in reflector.objects,
            what="change after resumes",
            within=TIMEOUT,
        )
        assert reflector.lists == 1
        assert reflector.last_error is None


async def test_relists_on_410_and_drops_what_vanished(kube_env: KubeEnv, namespace: str) -> None:
    """An object deleted while the watch was away disappears once the expired watch makes it list again."""
    apply(kube_env, service("stays", namespace), service("vanishes", namespace))
    async with running(reflector_for(kube_env, [namespace])) as reflector:
        await eventually(lambda: reflector.synced, what="initial list", within=TIMEOUT)
        kube_env.stop_apiserver()
        try:
            # Behind the API server's back: its history restarts after this revision, so the
            # reflector's resourceVersion is too old when it comes back (410 Gone).
            etcd_delete(kube_env, f"/registry/services/specs/{namespace}/vanishes")
        finally:
            kube_env.start_apiserver()
        await eventually(lambda: reflector.lists == 2, what="a second list after 410", within=TIMEOUT)
        assert set(reflector.objects) == {(namespace, "stays")}
        apply(kube_env, service("after-relist", namespace))
        await eventually(
            lambda: (namespace, "after-relist") in reflector.objects,
            what="watch after relist",
            within=TIMEOUT,
        )


async def test_keeps_what_it_knows_while_the_api_server_is_away(kube_env: KubeEnv, namespace: str) -> None:
    """No API server: objects stay and the error is reported; back: the error clears, changes flow."""
    apply(kube_env, service("llama", namespace))
    async with running(reflector_for(kube_env, [namespace])) as reflector:
        await eventually(lambda: reflector.synced, what="initial list", within=TIMEOUT)
        known = dict(reflector.objects)
        kube_env.stop_apiserver()
        try:
            await eventually(
                lambda: reflector.last_error is not None, what="the outage reported", within=TIMEOUT
            )
            assert "no answer" in (reflector.last_error or "")
            assert dict(reflector.objects) == known and reflector.synced
        finally:
            kube_env.start_apiserver()
        await eventually(lambda: reflector.last_error is None, what="recovery", within=TIMEOUT)
        apply(kube_env, service("qwen", namespace))
        await eventually(
            lambda: (namespace, "qwen") in reflector.objects, what="changes after the outage", within=TIMEOUT
        )
        assert (namespace, "llama") in reflector.objects


async def test_absent_optional_type_is_synced_and_empty(kube_env: KubeEnv) -> None:
    """An optional resource the server does not serve (Gateway API missing) is no error: just none."""
    absent = ResourceType("absent.example.com", "v1", "widgets", "Widget", optional=True)
    async with running(reflector_for(kube_env, None, resource=absent)) as reflector:
        await eventually(lambda: reflector.synced, what="settled", within=TIMEOUT)
        assert (reflector.available, reflector.last_error, dict(reflector.objects)) == (False, None, {})


async def test_absent_required_type_is_an_error_naming_the_crd(kube_env: KubeEnv) -> None:
    """A required resource the server does not serve keeps the reflector unsynced, and says why."""
    absent = ResourceType("absent.example.com", "v1", "gadgets", "Gadget")
    async with running(reflector_for(kube_env, None, resource=absent)) as reflector:
        await eventually(lambda: reflector.last_error is not None, what="error reported", within=TIMEOUT)
        assert "is its CRD installed?" in (reflector.last_error or "")
        assert not reflector.synced


async def test_oversized_event_is_skipped_and_a_list_catches_up(kube_env: KubeEnv, namespace: str) -> None:
    """An event over the size cap is dropped and the watch ends; a new list shows what it held."""
    apply(kube_env, service("big", namespace), service("small", namespace))
    options = ReflectorOptions(max_event_bytes=4096)
    async with running(reflector_for(kube_env, [namespace], options=options)) as reflector:
        await eventually(lambda: reflector.synced, what="initial list", within=TIMEOUT)
        apply(kube_env, service("big", namespace, padding="x" * 8192))
        apply(kube_env, service("small", namespace, 81))
        await eventually(
            lambda: reflector.objects[(namespace, "small")]["spec"]["ports"][0]["port"] == 81,
            what="next event",
            within=TIMEOUT,
            every=0.05,
        )
        assert reflector.oversized == 1
        await eventually(lambda: reflector.lists == 2, what="list after the skipped event", within=TIMEOUT)
        await eventually(
            lambda: reflector.objects == kubectl_objects(kube_env, namespace),
            what="caught up",
            within=TIMEOUT,
        )
        assert "padding" in reflector.objects[(namespace, "big")]["metadata"]["annotations"]

        # A DELETED event carries the object: one too large to read must not leave it cached for ever.
        kube_env.kubectl("delete", "service", "big", "-n", namespace)
        await eventually(
            lambda: (namespace, "big") not in reflector.objects,
            what="deletion seen by a list",
            within=TIMEOUT,
        )
        assert reflector.oversized == 2 and reflector.lists == 3


async def test_stopping_leaves_no_thread_behind(kube_env: KubeEnv) -> None:
    """Cancelling run() closes open watches at once: no request thread outlives it."""
    namespaces = [kube_env.new_namespace("stop") for _ in range(3)]
    before = kube_threads()
    reflector = reflector_for(kube_env, namespaces, options=ReflectorOptions())
    async with running(reflector):
        await eventually(lambda: reflector.watches == 3, what="three open watches", within=TIMEOUT)
        assert len(kube_threads()) == len(before) + 3
    assert kube_threads() == before


def etcd_delete(kube_env: KubeEnv, key: str) -> None:
    """Delete a key straight in etcd (its v3 JSON gateway), as if changed while nobody watched."""
    body = json.dumps({"key": base64.b64encode(key.encode()).decode()}).encode()
    url = f"http://127.0.0.1:{kube_env.etcd_port}/v3/kv/deleterange"
    with urllib.request.urlopen(urllib.request.Request(url, data=body, method="POST"), timeout=10) as answer:
        assert json.loads(answer.read()).get("deleted") == "1", f"{key} not in etcd"


@pytest.fixture(autouse=True)
def _no_leftover_threads() -> Any:
    yield
    # A stopped reflector waits stop_grace for its thread; a request still connecting then ends by
    # its own timeout (see transfer.in_thread). What must not happen is a thread that never ends.
    deadline = time.monotonic() + 5.0
    while kube_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kube_threads() == [], "a reflector thread outlived its test"
