"""Request control: a request's route resolved once, decided, leased, handed over and released."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Coroutine, Sequence
from dataclasses import replace

import pytest
from protocol.test_stream import _catalog, _endpoint

from extproc.catalog.model import Catalog, Endpoint, Route
from extproc.control.load import LoadView
from extproc.control.requests import RequestControl, RoutedRequest
from extproc.errors import ModelNotFound, Overloaded
from extproc.openai import InferenceRequest, read_request
from extproc.scheduling.cache_then_load import CacheThenLoad
from extproc.scheduling.predictor import PredictedTTFT
from extproc.scheduling.prefix import NO_MATCH, PrefixMatch, Tokenized
from extproc.scheduling.profiles import DEFAULT
from extproc.scheduling.scheduler import Decision, Scheduler
from extproc.types import EndpointAddress

CHAT = "/v1/chat/completions"


def chat(model: str = "llama-3-8b") -> InferenceRequest:
    return read_request(CHAT, {"model": model, "messages": [{"role": "user", "content": "hi"}]})


class SlowTokenizer:
    """A prefix matcher that tokenizes every prompt off the loop first, and lets the test decide
    when the tokens are ready (what happens meanwhile is the point)."""

    def __init__(self) -> None:
        self.ready = asyncio.Event()
        self.routes: list[Route] = []

    def tokenizes_first(self, route: Route, request: InferenceRequest) -> bool:
        return True

    async def prompt_tokens(self, route: Route, request: InferenceRequest, catalog: Catalog) -> Tokenized:
        self.routes.append(route)
        await self.ready.wait()
        return Tokenized(route.upstream_model, None)

    def match(
        self,
        catalog: Catalog,
        route: Route,
        request: InferenceRequest,
        candidates: Sequence[Endpoint],
        tokenized: Tokenized | None = None,
    ) -> PrefixMatch:
        return NO_MATCH

    def record(self, match: PrefixMatch, endpoint: EndpointAddress) -> None:
        pass


class World:
    """Request control over a real scheduler, load view and catalog the test may swap."""

    def __init__(self, *, prefix: object = None, policy: object = None) -> None:
        self.catalog = _catalog()
        self.load = LoadView()
        self.decisions: list[Decision] = []
        self.scheduler = Scheduler(
            self.load,
            policy or CacheThenLoad(),  # type: ignore[arg-type]
            max_fallbacks=1,
            rng=random.Random(3),
            prefix=prefix,  # type: ignore[arg-type]
            hooks=(self.decisions.append,),
        )
        self.control = RequestControl(catalog=lambda: self.catalog, scheduler=self.scheduler, load=self.load)


def routed_now(outcome: RoutedRequest | Coroutine[object, object, RoutedRequest]) -> RoutedRequest:
    assert isinstance(outcome, RoutedRequest), "decided at once"
    return outcome


def test_a_routed_request_holds_one_lease_with_its_model_until_its_stream_ends() -> None:
    """Routing leases the pick (with the upstream model); without an accounting stream the routing
    stream's end releases it."""
    world = World()
    routed = routed_now(world.control.route(chat("chat")))
    assert routed.lease.endpoint == routed.decision.pick.address
    assert routed.lease.model == "llama-3-8b" and routed.lease.owner == world.control.owner
    assert world.load.snapshot() == {routed.lease.endpoint: 1}
    routed.stream_ended()
    assert world.load.snapshot() == {}


def test_every_decision_reaches_the_hooks_once_and_a_shed_one_never() -> None:
    """Hooks learn from each pick (affinity, calibration); a shed request is sent nowhere."""
    world = World(policy=PredictedTTFT(lambda _e: replace(DEFAULT, queue_limit=0, max_num_seqs=1)))
    first = routed_now(world.control.route(chat()))
    second = routed_now(world.control.route(chat()))
    assert world.decisions == [first.decision, second.decision]
    assert first.decision.prediction is not None
    with pytest.raises(Overloaded):
        world.control.route(chat())  # both endpoints hold their one seat
    assert len(world.decisions) == 2
    assert world.load.total == 2, "a shed request takes no lease"


def test_decide_answers_without_a_lease() -> None:
    """decide() is the same decision path, for callers that hold their own leases."""
    world = World()
    decision = world.control.decide(chat())
    assert decision.pick.address in {"127.0.0.1:8000", "127.0.0.2:8000"}
    assert world.load.total == 0 and world.decisions == [decision]


def test_an_unknown_model_is_refused_before_any_decision() -> None:
    """A model no route serves is a 404 the client sees; nothing is decided or leased."""
    world = World()
    with pytest.raises(ModelNotFound, match="nope"):
        world.control.route(chat("nope"))
    assert world.decisions == [] and world.load.total == 0


async def test_the_route_is_resolved_once_even_when_the_catalog_changes_while_tokenizing() -> None:
    """A prompt tokenized off the loop is decided against the catalog its route was resolved in,
    not one published meanwhile (where its endpoints may have changed)."""
    slow = SlowTokenizer()
    world = World(prefix=slow)
    outcome = world.control.route(chat())
    assert isinstance(outcome, Coroutine)
    task = asyncio.ensure_future(outcome)
    await asyncio.sleep(0)
    world.catalog = _catalog((_endpoint(9),))  # published while the prompt is tokenized
    slow.ready.set()
    routed = await task
    assert routed.decision.pick.address in {"127.0.0.1:8000", "127.0.0.2:8000"}
    assert len(slow.routes) == 1


def test_the_response_starting_ends_the_predicted_prefill_but_not_the_count() -> None:
    """The routed request's prefill is charged until its response begins, then it counts as decoding."""
    world = World(policy=PredictedTTFT(lambda _e: DEFAULT))
    routed = routed_now(world.control.route(chat()))
    pick = routed.lease.endpoint
    assert world.load.pending_prefill(pick)[1] == 1
    routed.response_started()
    assert world.load.pending_prefill(pick) == (0, 0) and world.load.count(pick) == 1


def test_the_accounting_stream_claims_the_routed_lease_so_it_counts_once() -> None:
    """The accounting stream holds the routing stream's own lease; the routing end leaves it alone."""
    world = World()
    routed = routed_now(world.control.route(chat()))
    held = world.control.accounting_lease(routed.decision.destination, token=routed.token)
    assert held == routed.lease
    routed.stream_ended()
    assert world.load.total == 1
    world.control.release(held)
    assert world.load.total == 0
