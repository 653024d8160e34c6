"""Model discovery: parsing /v1/models, intervals, and the poller against real simulated engines."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from simulated import StartSim
from waiting import eventually

from extproc.catalog.discovered import apply_discovery
from extproc.catalog.model import Catalog
from extproc.demo.catalog import LocalWorkerSet
from extproc.engines.discovery import (
    MAX_NAME,
    DiscoveredModel,
    DiscoveryError,
    EndpointModels,
    ModelDiscovery,
    discovery_targets,
    parse_interval,
    parse_models,
)
from extproc.sim.server import SimServer
from extproc.sim.settings import LoraModule, SimSettings
from extproc.types import EndpointAddress, ModelName

from .test_parity import catalog_of

BASE = "meta-llama/Meta-Llama-3-8B-Instruct"
WINDOW = 512

# -- parsing --------------------------------------------------------------------------------------


def card(name: Any, parent: Any = None, window: Any = 4096, root: Any = "/models/llama") -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "owned_by": "vllm",
        "root": root,
        "parent": parent,
        "max_model_len": window,
    }


def body(*cards: Any) -> bytes:
    return json.dumps({"object": "list", "data": list(cards)}).encode()


def test_vllm_base_models_and_adapters() -> None:
    """Several served names of one base, plus a LoRA whose parent is the first name (vLLM's shape)."""
    parsed = parse_models(
        body(card("llama-3"), card("llama"), card("sql", parent="llama-3", window=None, root="/adapters/sql"))
    )
    assert parsed == EndpointModels(
        (
            DiscoveredModel(ModelName("llama-3"), None, 4096, "/models/llama"),
            DiscoveredModel(ModelName("llama"), None, 4096, "/models/llama"),
            DiscoveredModel(ModelName("sql"), ModelName("llama-3"), None, "/adapters/sql"),
        )
    )
    assert parsed.names() == ("llama-3", "llama", "sql")
    assert parsed.context_windows() == {"llama-3": 4096, "llama": 4096, "sql": 4096}


def test_minimal_openai_cards_are_enough() -> None:
    """OpenAI-compatible servers other than vLLM may give only ids."""
    parsed = parse_models(b'{"data": [{"id": "a"}, {"id": "b", "object": "model"}]}')
    assert parsed == EndpointModels((DiscoveredModel(ModelName("a")), DiscoveredModel(ModelName("b"))))


@pytest.mark.parametrize(
    "bad",
    [
        "not a card",
        {"object": "model"},
        card(""),
        card(7),
        card("x" * (MAX_NAME + 1)),
        card("a", parent=3),
        card("a", parent=""),
        card("a", window="4096"),
        card("a", window=True),
        card("a", window=0),
        card("good"),  # a repeat of the good card below
    ],
    ids=[
        "string",
        "no-id",
        "empty-id",
        "numeric-id",
        "long-id",
        "numeric-parent",
        "empty-parent",
        "string-window",
        "bool-window",
        "zero-window",
        "duplicate",
    ],
)
def test_malformed_cards_are_skipped_not_fatal(bad: Any) -> None:
    parsed = parse_models(body(card("good"), bad))
    assert parsed.names() == ("good",) and parsed.skipped == 1


def test_non_string_root_is_dropped_but_the_card_kept() -> None:
    assert parse_models(body(card("a", root=5))).models == (DiscoveredModel(ModelName("a"), None, 4096),)


def test_cards_beyond_the_limit_are_skipped() -> None:
    parsed = parse_models(body(*(card(f"m{i}") for i in range(5))), max_models=3)
    assert parsed.names() == ("m0", "m1", "m2") and parsed.skipped == 2


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"<html>404</html>", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[]", 'JSON object with a "data" list, got list'),
        (b'{"object": "error", "message": "no"}', '"object": "list", got \'error\''),
        (b'{"object": "list"}', '"data" list of models, got NoneType'),
        (b'{"data": {"id": "a"}}', '"data" list of models, got dict'),
    ],
    ids=["html", "binary", "array", "error-object", "no-data", "data-object"],
)
def test_a_body_that_is_not_a_model_list_is_an_error(raw: bytes, fragment: str) -> None:
    with pytest.raises(DiscoveryError, match=re.escape(fragment)):
        parse_models(raw)


def test_an_oversized_body_is_refused_before_parsing() -> None:
    with pytest.raises(DiscoveryError, match="exceeds 10"):
        parse_models(body(card("a")), max_bytes=10)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30s", 30.0), ("1m30s", 90.0), ("500ms", 0.5), ("1h", 3600.0), ("2m", 120.0), ("1h2m3s4ms", 3723.004)],
)
def test_intervals(text: str, seconds: float) -> None:
    assert parse_interval(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "30", "s", "1.5s", "-1s", "1d", "123456s", "1s1s1s1s1s", "1 s"])
def test_intervals_the_crd_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_interval(text)


def test_only_endpoint_mode_sets_are_polled_at_their_interval() -> None:
    """Static sets are left alone; an endpoint shared by two sets is asked at the shorter interval."""
    catalog = catalog_of(
        [
            LocalWorkerSet("static", BASE, ["127.0.0.1:7001"]),
            LocalWorkerSet("slow", BASE, ["127.0.0.1:7002", "127.0.0.1:7003"], discovery_mode="Endpoint"),
            LocalWorkerSet(
                "fast", BASE, ["127.0.0.1:7003"], discovery_mode="Endpoint", discovery_interval="1m5s"
            ),
        ]
    )
    targets = discovery_targets(catalog)
    assert {a: (t.url, t.interval) for a, t in targets.items()} == {
        "127.0.0.1:7002": ("http://127.0.0.1:7002/v1/models", 30.0),
        "127.0.0.1:7003": ("http://127.0.0.1:7003/v1/models", 30.0),
    }


# -- the poller against simulated engines ---------------------------------------------------------


@pytest.fixture
def sim(sim: StartSim) -> Callable[..., Awaitable[SimServer]]:
    """The shared factory: an engine of BASE serving ``names`` and the LoRA adapters ``loras``."""

    async def start(*names: str, loras: tuple[str, ...] = ()) -> SimServer:
        return await sim(
            model=BASE,
            served_model_names=names,
            lora_modules=tuple(LoraModule(n, f"/adapters/{n}") for n in loras),
            engine={"max_model_len": WINDOW, "max_num_batched_tokens": WINDOW},
            time_scale=1.0,
        )

    return start


class Harness:
    """A declared catalog that tests edit, a discovery following it, and the catalog it yields."""

    def __init__(self, interval: str = "100ms") -> None:
        self.interval = interval
        self.declared = Catalog()
        self.changes = 0
        self.discovery = ModelDiscovery(
            declared=lambda: self.declared, on_change=self._changed, timeout=1.0, follow_interval=0.05
        )

    def _changed(self) -> None:
        self.changes += 1

    def declare(self, *addresses: str, spec: dict[str, list[str]] | None = None) -> None:
        ws = LocalWorkerSet(
            "llama",
            BASE,
            list(addresses),
            discovery_mode="Endpoint",
            discovery_interval=self.interval,
            models={} if spec is None else spec,
        )
        self.declared = catalog_of([ws])
        self.discovery.refresh()

    @property
    def catalog(self) -> Catalog:
        return apply_discovery(self.declared, self.discovery.results())

    def endpoint(self, address: str) -> dict[str, Any]:
        found: dict[str, Any] = self.discovery.debug_state()["endpoints"][address]
        return found


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    made = Harness()
    made.discovery.start()
    yield made
    await made.discovery.close()


def routed(catalog: Catalog, name: str) -> list[str]:
    route = catalog.resolve(name)
    return [] if route is None else [e.address for e in route.endpoints]


async def test_discovery_learns_names_adapters_and_windows(sim: StartSim, harness: Harness) -> None:
    """Served names and an adapter loaded on one of two engines route where they are served."""
    one = await sim("llama-3", "llama", loras=("sql",))
    two = await sim("llama-3")
    harness.declare(one.address, two.address, spec={"llama-3": ["chat"]})
    await eventually(lambda: len(harness.discovery.results()) == 2)
    catalog = harness.catalog
    assert sorted(catalog.routes) == ["chat", "llama", "llama-3", "sql"]
    assert routed(catalog, "sql") == [one.address]
    assert routed(catalog, "llama") == [one.address]
    assert routed(catalog, "chat") == sorted([one.address, two.address])
    sql = harness.discovery.results()[EndpointAddress(one.address)].models[-1]
    assert sql == DiscoveredModel(ModelName("sql"), ModelName("llama-3"), None, "/adapters/sql")
    for address, model in [(one.address, "sql"), (one.address, "llama"), (two.address, "llama-3")]:
        assert catalog.context_window(EndpointAddress(address), ModelName(model)) == WINDOW
    state = harness.endpoint(one.address)
    assert state["error"] is None and state["url"] == f"http://{one.address}/v1/models"
    assert [m["name"] for m in state["models"]] == ["llama-3", "llama", "sql"]


async def test_on_change_fires_once_per_change(sim: StartSim, harness: Harness) -> None:
    """Polls that learn nothing new do not make the catalog owner rebuild."""
    server = await sim("llama-3")
    harness.declare(server.address)
    await eventually(lambda: harness.changes == 1)
    rounds = harness.discovery.rounds
    polls = harness.endpoint(server.address)["polls"]
    await eventually(lambda: harness.endpoint(server.address)["polls"] >= polls + 3)
    assert harness.discovery.rounds > rounds and harness.changes == 1
    assert await harness.discovery.poll(everyone=True) is False and harness.changes == 1


async def test_a_new_endpoint_is_asked_at_once(sim: StartSim) -> None:
    """A pod joining a set with a long interval is learned right away, not an interval later."""
    made = Harness(interval="1h")
    made.discovery.start()
    try:
        first, second = await sim("llama-3"), await sim("llama-3", loras=("sql",))
        made.declare(first.address)
        await eventually(lambda: made.changes == 1)
        made.declare(first.address, second.address)
        await eventually(lambda: made.changes == 2)
        assert routed(made.catalog, "sql") == [second.address]
        assert made.endpoint(first.address)["polls"] == 1
    finally:
        await made.discovery.close()


async def test_an_endpoint_that_stops_answering_keeps_what_it_served(sim: StartSim, harness: Harness) -> None:
    """A failing poll records why but changes nothing: the engine may be busy or restarting."""
    server = await sim("llama-3", loras=("sql",))
    harness.declare(server.address)
    await eventually(lambda: harness.changes == 1)
    await server.stop()
    await eventually(lambda: harness.endpoint(server.address)["error"] is not None)
    state = harness.endpoint(server.address)
    assert "Connect" in state["error"] and state["failures"] >= 1
    assert [m["name"] for m in state["models"]] == ["llama-3", "sql"]
    assert harness.changes == 1 and routed(harness.catalog, "sql") == [server.address]


async def test_a_departed_endpoint_is_forgotten(sim: StartSim, harness: Harness) -> None:
    """An endpoint that leaves the declared catalog is dropped from the results, and that is a change."""
    stays, leaves = await sim("llama-3"), await sim("llama-3", loras=("sql",))
    harness.declare(stays.address, leaves.address)
    await eventually(lambda: len(harness.discovery.results()) == 2)
    changes = harness.changes
    harness.declare(stays.address)
    await eventually(lambda: EndpointAddress(leaves.address) not in harness.discovery.results())
    assert leaves.address not in harness.discovery.debug_state()["endpoints"]
    assert harness.changes == changes + 1
    assert "sql" not in harness.catalog.routes and routed(harness.catalog, "llama-3") == [stays.address]


async def test_a_changed_model_list_is_a_change(sim: StartSim, harness: Harness) -> None:
    """An engine restarted with another adapter on the same address is re-learned."""
    server = await sim("llama-3")
    harness.declare(server.address)
    await eventually(lambda: harness.changes == 1)
    address = server.address
    await server.stop()
    replacement = SimServer(
        SimSettings(
            listen=address,
            model=BASE,
            served_model_names=("llama-3",),
            lora_modules=(LoraModule("sql", "/a"),),
        )
    )
    await replacement.start()
    try:
        await eventually(lambda: harness.changes == 2)
        assert routed(harness.catalog, "sql") == [address] and harness.endpoint(address)["error"] is None
    finally:
        await replacement.stop()


# -- misbehaving servers ---------------------------------------------------------------------------


@pytest.fixture
async def odd_server() -> AsyncIterator[Callable[[web.Response], Awaitable[str]]]:
    runners: list[web.AppRunner] = []

    async def start(response: web.Response) -> str:
        async def models(_request: web.Request) -> web.Response:
            return response

        app = web.Application()
        app.router.add_get("/v1/models", models)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        return f"127.0.0.1:{runner.addresses[0][1]}"

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.mark.parametrize(
    ("response", "fragment"),
    [
        (web.Response(status=401, text="unauthorized"), "HTTP 401"),
        (web.Response(text="<html>hi</html>"), "not JSON"),
        (web.Response(body=b'{"data": [' + b'{"id": "a"},' * 100_000 + b'{"id": "b"}]}'), "exceeds"),
    ],
    ids=["status", "html", "huge"],
)
async def test_bad_answers_are_recorded_errors(
    odd_server: Callable[[web.Response], Awaitable[str]], response: web.Response, fragment: str
) -> None:
    address = await odd_server(response)
    made = Harness()
    made.declare(address)
    made.discovery.start()  # owns a session; the task's own rounds race ours harmlessly
    try:
        await made.discovery.poll(everyone=True)
        state = made.endpoint(address)
        assert fragment in state["error"] and state["models"] is None
        assert made.changes == 0 and made.discovery.results() == {}
    finally:
        await made.discovery.close()
