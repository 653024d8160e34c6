"""Flow control end to end: real Envoy, serve, and two simulated engines with one seat each.

The profile says an endpoint with its one seat taken is saturated (``queue_limit: 0``), so every
request beyond two waits in serve. What a client sees is asserted: statuses, ``Retry-After``, the
JSON error's code, who is served, and that nothing stays counted in flight. How long requests wait
is measured by ``bench/flow_control.py``, not here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from waiting import until

from extproc.demo.catalog import LocalObjective, catalog_yaml
from extproc.serve.app import Server
from extproc.settings import FlowSettings
from extproc.sim.server import SimServer

from .sim_gateway import ENGINE, LLAMA, engine_settings, router_settings, serve_behind_envoy, worker_set

OBJECTIVES = (LocalObjective("premium", 10, "llama"), LocalObjective("scavenger", -1, "llama", legacy=True))


@dataclasses.dataclass
class Answer:
    status: int
    retry_after: str | None
    code: str | None
    done_at: float


@contextlib.asynccontextmanager
async def one_seat_pool(
    envoy_gateway: Callable[..., Awaitable[Any]], tmp_path: Path, flow: FlowSettings
) -> Any:
    async with contextlib.AsyncExitStack() as stack:
        one_seat = dataclasses.replace(
            engine_settings(time_scale=1.0), engine=dataclasses.replace(ENGINE, max_num_seqs=1)
        )
        engines = [await stack.enter_async_context(SimServer(one_seat)) for _ in range(2)]
        catalog = tmp_path / "catalog.yaml"
        catalog.write_text(catalog_yaml([worker_set(engines)], OBJECTIVES))
        profiles = tmp_path / "profiles.yaml"
        profiles.write_text(
            f"profiles:\n  {worker_set(engines).profile}:\n    max_num_seqs: 1\n    queue_limit: 0\n"
        )
        settings = dataclasses.replace(router_settings(catalog), profiles=profiles, flow=flow)
        server, gateway = await serve_behind_envoy(stack, settings, engines, envoy_gateway)
        session = await stack.enter_async_context(
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        )
        yield gateway.url, server, session


async def ask(
    session: aiohttp.ClientSession, url: str, *, tokens: int, tenant: str = "t", objective: str | None = None
) -> Answer:
    headers = {"x-gateway-inference-fairness-id": tenant}
    if objective is not None:
        headers["x-gateway-inference-objective"] = objective
    body = {"model": LLAMA, "prompt": f"{tenant} asks", "max_tokens": tokens}
    async with session.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
        text = await resp.text()
        code = json.loads(text)["error"]["code"] if resp.status != 200 else None
        return Answer(resp.status, resp.headers.get("retry-after"), code, asyncio.get_running_loop().time())


async def metric_sum(server: Server, session: aiohttp.ClientSession, name: str) -> float:
    """The sum of a metric's series on serve's /metrics page (``name`` may end in a first label)."""
    async with session.get(f"http://127.0.0.1:{server.admin_port}/metrics") as resp:
        page = await resp.text()
    prefix = name if "{" in name else name + "{"
    return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines() if line.startswith(prefix))


async def until_metric(
    server: Server, session: aiohttp.ClientSession, name: str, holds: Callable[[float], bool], what: str
) -> None:
    async def holding() -> bool:
        return holds(await metric_sum(server, session, name))

    await until(holding, within=10, what=f"{what} ({name})", every=0.1)


async def test_a_burst_on_a_full_pool_is_answered_in_full_and_priority_pushes_in(
    envoy_gateway: Callable[..., Awaitable[Any]], tmp_path: Path
) -> None:
    """30 requests at once on two seats, at most 4 waiting: each gets 200 or a 429 with Retry-After
    and a JSON error naming why; the priority-10 requests sent last push waiting ones out and are
    all served; afterwards nothing counts as in flight."""
    async with one_seat_pool(envoy_gateway, tmp_path, FlowSettings(max_queue=4, queue_timeout=1)) as (
        url,
        server,
        session,
    ):
        low = [asyncio.create_task(ask(session, url, tokens=60, tenant=f"t{i % 3}")) for i in range(30)]
        await asyncio.sleep(0.1)
        high = [asyncio.create_task(ask(session, url, tokens=20, objective="premium")) for _ in range(4)]
        answers = await asyncio.gather(*low, *high)
        assert all(a.status in (200, 429) for a in answers), [a.status for a in answers]
        refused = [a for a in answers if a.status == 429]
        assert refused, "two seats cannot serve 30 requests within a second's wait"
        assert all(a.retry_after == "1" for a in refused)
        assert {a.code for a in refused} <= {"queue_full", "displaced", "timeout"}
        assert "displaced" in {a.code for a in refused}, "premium requests found the queue full"
        assert [a.status for a in answers[30:]] == [200] * 4
        await until_metric(
            server, session, "extproc_inflight_requests", lambda v: v == 0, "nothing in flight"
        )
        assert await metric_sum(server, session, "extproc_flow_queue_length") == 0


async def test_sheddable_is_refused_at_once_while_a_light_tenant_is_served_ahead_of_a_heavy_backlog(
    envoy_gateway: Callable[..., Awaitable[Any]], tmp_path: Path
) -> None:
    """A heavy tenant keeps 8 requests waiting; a priority -1 request gets 429 ``sheddable`` (never
    queued); the light tenant's request, sent after the heavy backlog, is served before most of it."""
    async with one_seat_pool(envoy_gateway, tmp_path, FlowSettings(max_queue=32, queue_timeout=20)) as (
        url,
        server,
        session,
    ):
        heavy = [asyncio.create_task(ask(session, url, tokens=40, tenant="heavy")) for _ in range(10)]
        await until_metric(
            server,
            session,
            "extproc_flow_queue_length",
            lambda v: v >= 8,
            "the heavy backlog waiting in serve",
        )
        # A client that gives up while waiting leaves the queue at once (Envoy resets the stream).
        queued = await metric_sum(server, session, 'extproc_flow_requests_total{outcome="queued"')
        leaver = asyncio.create_task(ask(session, url, tokens=40, tenant="heavy"))  # behind its backlog
        await until_metric(
            server, session, 'extproc_flow_requests_total{outcome="queued"', lambda v: v > queued, "it waits"
        )
        leaver.cancel()
        await until_metric(
            server, session, 'extproc_flow_requests_total{outcome="cancelled"', lambda v: v == 1, "it left"
        )
        shed = await ask(session, url, tokens=40, tenant="scavenger", objective="scavenger")
        assert (shed.status, shed.code, shed.retry_after) == (429, "sheddable", "20")
        light = await ask(session, url, tokens=40, tenant="light")
        assert light.status == 200
        done = await asyncio.gather(*heavy)
        assert all(a.status == 200 for a in done)
        after_light = sum(1 for a in done if a.done_at > light.done_at)
        assert after_light >= 5, f"only {after_light} of the heavy backlog finished after the light request"
