"""Folding what endpoints list at /v1/models into the declared catalog."""

from __future__ import annotations

from typing import Any

import pytest

from extproc.catalog.build import AWAITING_DISCOVERY
from extproc.catalog.discovered import DiscoveredModel, EndpointModels, apply_discovery
from extproc.catalog.model import Catalog, NameConflict
from extproc.types import EndpointAddress, ModelName, WorkerSetKey

from .test_build import addresses, build, eps, iws, svc

LLAMA = WorkerSetKey("default/llama")


def discovering(
    name: str,
    models: list[dict[str, Any]] | None = None,
    *,
    mode: str = "Endpoint",
    created: str | None = None,
) -> dict[str, Any]:
    obj = iws(name, models=[] if models is None else models, created=created)
    obj["spec"]["modelDiscovery"] = {"mode": mode, "interval": "10s"}
    return obj


def declared(*sets: dict[str, Any], pods: int = 3) -> Catalog:
    """Each set with its own Service and ``pods`` pods; set i's pods are 10.0.i.1..pods."""
    objects: list[dict[str, Any]] = []
    for index, obj in enumerate(sets):
        name = obj["metadata"]["name"]
        ips = [f"10.0.{index}.{pod}" for pod in range(1, pods + 1)]
        objects += [obj, svc(name), eps(name, name, ips)]
    return build(*objects)


def base(*names: str, window: int = 4096) -> list[DiscoveredModel]:
    return [DiscoveredModel(ModelName(n), None, window, "/models/llama") for n in names]


def lora(name: str, parent: str) -> DiscoveredModel:
    return DiscoveredModel(ModelName(name), ModelName(parent), None, f"/adapters/{name}")


def answer(*models: DiscoveredModel | list[DiscoveredModel]) -> EndpointModels:
    flat: list[DiscoveredModel] = []
    for m in models:
        flat.extend(m if isinstance(m, list) else [m])
    return EndpointModels(tuple(flat))


def ep(set_index: int, pod: int) -> EndpointAddress:
    return EndpointAddress(f"10.0.{set_index}.{pod}:8000")


def test_routes_come_from_discovered_names_with_spec_aliases() -> None:
    """Every served name routes; a spec.models entry of the same name lends it its aliases."""
    catalog = declared(discovering("llama", [{"name": "llama-3", "aliases": ["chat"]}]))
    learned = {ep(0, p): answer(base("llama-3", "llama"), lora("sql", "llama-3")) for p in (1, 2, 3)}
    result = apply_discovery(catalog, learned)
    all_pods = [ep(0, p) for p in (1, 2, 3)]
    assert sorted(result.routes) == ["chat", "llama", "llama-3", "sql"]
    for name in ("chat", "llama", "llama-3", "sql"):
        assert addresses(result, name) == all_pods
    chat = result.resolve("chat")
    assert chat is not None and chat.upstream_model == "llama-3" and chat.is_alias
    ws = result.worker_sets[LLAMA]
    assert [(m.name, m.aliases) for m in ws.models] == [("llama", ()), ("llama-3", ("chat",)), ("sql", ())]
    assert ws.served == {a: ("llama", "llama-3", "sql") for a in all_pods}
    assert ws.problems == ()


def test_an_adapter_on_some_pods_routes_only_to_them() -> None:
    """A LoRA loaded on two of three pods must not be sent to the third, which would 404 it."""
    catalog = declared(discovering("llama"))
    learned = {
        ep(0, 1): answer(base("llama-3"), lora("sql", "llama-3")),
        ep(0, 2): answer(base("llama-3"), lora("sql", "llama-3")),
        ep(0, 3): answer(base("llama-3")),
    }
    result = apply_discovery(catalog, learned)
    assert addresses(result, "sql") == [ep(0, 1), ep(0, 2)]
    assert addresses(result, "llama-3") == [ep(0, 1), ep(0, 2), ep(0, 3)]
    # The declared problem "waiting for discovery" is gone once endpoints answered.
    assert AWAITING_DISCOVERY in catalog.worker_sets[LLAMA].problems
    assert result.worker_sets[LLAMA].problems == ()


def test_endpoints_that_have_not_answered_route_nothing_once_others_have() -> None:
    """What an unanswered pod serves is unknown; its answered siblings carry the traffic."""
    catalog = declared(discovering("llama", [{"name": "llama-3"}]))
    result = apply_discovery(catalog, {ep(0, 2): answer(base("llama-3"))})
    assert addresses(result, "llama-3") == [ep(0, 2)]
    assert result.worker_sets[LLAMA].endpoints == catalog.worker_sets[LLAMA].endpoints


@pytest.mark.parametrize(
    ("models", "routes", "problem"),
    [([{"name": "llama-3", "aliases": ["chat"]}], ["chat", "llama-3"], None), ([], [], AWAITING_DISCOVERY)],
    ids=["spec-models", "no-spec-models"],
)
def test_a_set_whose_endpoints_have_not_answered_keeps_its_spec(
    models: list[dict[str, Any]], routes: list[str], problem: str | None
) -> None:
    """Before any answer (or while polls fail) the declared models route to every ready pod."""
    catalog = declared(discovering("llama", models))
    other = {EndpointAddress("10.9.9.9:8000"): answer(base("elsewhere"))}  # not one of this set's pods
    result = apply_discovery(catalog, other)
    assert sorted(result.routes) == routes
    for name in routes:
        assert addresses(result, name) == [ep(0, p) for p in (1, 2, 3)]
    ws = result.worker_sets[LLAMA]
    assert ws.served is None and (problem in ws.problems if problem else ws.problems == ())


def test_static_sets_are_untouched() -> None:
    """A Static set's models are its spec, whatever its endpoints say."""
    catalog = declared(discovering("llama", [{"name": "llama-3"}], mode="Static"))
    result = apply_discovery(catalog, {ep(0, 1): answer(base("other"))})
    assert result is catalog
    assert sorted(result.routes) == ["llama-3"] and result.context_windows == {}


def test_static_and_discovering_sets_mix() -> None:
    """Only Endpoint-mode sets change; a Static set keeps its routes next to them."""
    catalog = declared(
        discovering("llama", [{"name": "llama-3"}], mode="Static"),
        discovering("qwen"),
    )
    result = apply_discovery(catalog, {ep(0, 1): answer(base("ignored")), ep(1, 1): answer(base("qwen-2"))})
    assert sorted(result.routes) == ["llama-3", "qwen-2"]
    assert result.worker_sets[LLAMA] == catalog.worker_sets[LLAMA]
    assert addresses(result, "qwen-2") == [ep(1, 1)]


def test_the_oldest_set_keeps_a_discovered_name() -> None:
    """Two sets serving one name for different upstreams: the rules of build_catalog apply."""
    catalog = declared(
        discovering("new", [{"name": "qwen-2", "aliases": ["chat"]}], created="2025-02-01T00:00:00Z"),
        discovering("old", [{"name": "llama-3", "aliases": ["chat"]}], created="2025-01-01T00:00:00Z"),
    )
    result = apply_discovery(catalog, {ep(0, 1): answer(base("qwen-2")), ep(1, 1): answer(base("llama-3"))})
    chat = result.resolve("chat")
    assert chat is not None and chat.upstream_model == "llama-3" and addresses(result, "chat") == [ep(1, 1)]
    assert result.conflicts == (
        NameConflict(
            ModelName("chat"),
            WorkerSetKey("default/old"),
            ModelName("llama-3"),
            WorkerSetKey("default/new"),
            ModelName("qwen-2"),
        ),
    )


def test_sets_serving_the_same_name_share_the_route() -> None:
    """The same upstream name in two sets is one route over both sets' serving pods."""
    catalog = declared(discovering("a"), discovering("b"))
    result = apply_discovery(catalog, {ep(0, 1): answer(base("llama-3")), ep(1, 2): answer(base("llama-3"))})
    route = result.resolve("llama-3")
    assert route is not None and route.worker_sets == ("default/a", "default/b")
    assert addresses(result, "llama-3") == [ep(0, 1), ep(1, 2)]
    assert result.conflicts == ()


def test_an_alias_never_shadows_a_served_name() -> None:
    """If an endpoint serves a name the spec uses as an alias, the served model keeps it."""
    catalog = declared(discovering("llama", [{"name": "llama-3", "aliases": ["llama"]}]))
    result = apply_discovery(catalog, {ep(0, 1): answer(base("llama-3", "llama"))})
    route = result.resolve("llama")
    assert route is not None and route.upstream_model == "llama" and result.conflicts == ()
    problems = result.worker_sets[LLAMA].problems
    assert len(problems) == 1 and "alias 'llama' of model 'llama-3'" in problems[0]


def test_declared_models_no_endpoint_serves_are_reported() -> None:
    """A spec.models entry nobody serves has nothing to route its aliases to; say so."""
    catalog = declared(discovering("llama", [{"name": "llama-3", "aliases": ["chat"]}]))
    result = apply_discovery(catalog, {ep(0, 1): answer(base("qwen-2"))})
    assert sorted(result.routes) == ["qwen-2"]
    (problem,) = result.worker_sets[LLAMA].problems
    assert "'llama-3'" in problem and "no endpoint that answered serves it" in problem


def test_endpoints_that_list_nothing_serve_nothing() -> None:
    catalog = declared(discovering("llama", [{"name": "llama-3"}]))
    result = apply_discovery(catalog, {ep(0, 1): answer()})
    assert result.routes == {}
    assert any("list no models" in p for p in result.worker_sets[LLAMA].problems)


def test_context_windows_per_endpoint_and_model() -> None:
    """Base models give their window; an adapter inherits its parent's on the same endpoint."""
    catalog = declared(discovering("llama"))
    learned = {
        ep(0, 1): answer(base("llama-3", window=8192), lora("sql", "llama-3")),
        ep(0, 2): answer(base("llama-3", window=2048)),
        ep(0, 3): answer(DiscoveredModel(ModelName("llama-3"))),  # no window given: unknown
    }
    result = apply_discovery(catalog, learned)
    assert result.context_window(ep(0, 1), ModelName("llama-3")) == 8192
    assert result.context_window(ep(0, 1), ModelName("sql")) == 8192
    assert result.context_window(ep(0, 2), ModelName("llama-3")) == 2048
    assert result.context_window(ep(0, 3), ModelName("llama-3")) is None
    assert result.context_window(ep(0, 2), ModelName("sql")) is None
    debug = result.to_debug()
    assert debug["routes"]["llama-3"]["contextWindows"] == {ep(0, 1): 8192, ep(0, 2): 2048}


@pytest.mark.parametrize(
    ("models", "expected"),
    [
        (answer(base("a", window=100), lora("x", "a")), {"a": 100, "x": 100}),
        # An adapter whose parent is listed under another name takes the engine's one window.
        (answer(base("a", window=100), lora("x", "elsewhere")), {"a": 100, "x": 100}),
        # Base models disagreeing (not vLLM): an orphan adapter stays unknown.
        (answer(base("a", window=100), base("b", window=200), lora("x", "c")), {"a": 100, "b": 200}),
        (answer(lora("x", "a")), {}),
    ],
    ids=["parent", "orphan-one-window", "orphan-two-windows", "adapter-only"],
)
def test_endpoint_context_windows(models: EndpointModels, expected: dict[str, int]) -> None:
    assert models.context_windows() == expected


def test_debug_shows_what_was_learned() -> None:
    catalog = declared(discovering("llama"), pods=1)
    before = catalog.to_debug()["workerSets"][LLAMA]["modelDiscovery"]
    assert before == {"mode": "Endpoint", "interval": "10s", "learned": None}
    after = apply_discovery(catalog, {ep(0, 1): answer(base("llama-3"), lora("sql", "llama-3"))})
    learned = after.to_debug()["workerSets"][LLAMA]["modelDiscovery"]["learned"]
    assert learned == {ep(0, 1): ["llama-3", "sql"]}


def test_equal_inputs_give_equal_catalogs() -> None:
    """Pure: the store may rebuild from the same source and answers at any time."""
    catalog = declared(discovering("llama"), discovering("qwen"))
    learned = {ep(0, 1): answer(base("llama-3")), ep(1, 3): answer(base("qwen-2"), lora("sql", "qwen-2"))}
    assert apply_discovery(catalog, learned) == apply_discovery(catalog, dict(reversed(learned.items())))
