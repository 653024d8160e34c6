"""Request control: a request's route resolved once, decided, leased, handed over and released."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Coroutine, Sequence
from dataclasses import replace

import pytest
from protocol.test_stream import _catalog, _endpoint

from extproc.catalog.model import Catalog, Endpoint, Objective, Route
from extproc.control.flow import RequestClass
from extproc.control.load import LoadView
from extproc.control.requests import RequestControl, RoutedRequest
from extproc.errors import ModelNotFound, Overloaded
from extproc.openai import InferenceRequest, read_request
from extproc.scheduling.cache_then_load import CacheThenLoad
from extproc.scheduling.predictor import PredictedTTFT
from extproc.scheduling.prefix import NO_MATCH, PrefixMatch, Tokenized
from extproc.scheduling.profiles import DEFAULT
from extproc.scheduling.scheduler import Decision, Scheduler
from extproc.settings import FlowSettings
from extproc.types import EndpointAddress, WorkerSetKey

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

    def __init__(
        self, *, prefix: object = None, policy: object = None, flow: FlowSettings | None = None
    ) -> None:
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
        self.control = RequestControl(
            catalog=lambda: self.catalog, scheduler=self.scheduler, load=self.load, flow=flow
        )


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


def one_seat_each() -> PredictedTTFT:
    return PredictedTTFT(lambda _e: replace(DEFAULT, queue_limit=0, max_num_seqs=1))


def with_objectives(catalog: Catalog, **priorities: int) -> Catalog:
    pool = WorkerSetKey("default/llama")
    return replace(
        catalog, objectives={name: (Objective("default", name, p, pool),) for name, p in priorities.items()}
    )


async def test_a_saturated_pool_holds_requests_until_a_lease_ends_then_by_priority() -> None:
    """With flow control on, the third request waits instead of getting 429; when a request ends,
    the waiting one of the highest priority (its objective's) is decided and leased."""
    world = World(policy=one_seat_each(), flow=FlowSettings(max_queue=4, queue_timeout=30))
    world.catalog = with_objectives(world.catalog, interactive=10, batch=0)
    first = routed_now(world.control.route(chat()))
    routed_now(world.control.route(chat()))
    batch = asyncio.ensure_future(world.control.route(chat(), None, RequestClass("batch", "t1")))  # type: ignore[arg-type]
    interactive = asyncio.ensure_future(
        world.control.route(chat(), None, RequestClass("interactive", "t2"))  # type: ignore[arg-type]
    )
    await asyncio.sleep(0.01)
    assert not batch.done() and not interactive.done()
    assert world.load.total == 2, "a waiting request holds no lease"
    first.stream_ended()  # its seat frees
    routed = await asyncio.wait_for(interactive, 1)
    assert routed.decision.pick.address == first.decision.pick.address
    assert routed.waited > 0
    assert not batch.done()
    routed.stream_ended()
    assert (await asyncio.wait_for(batch, 1)).lease.endpoint == first.decision.pick.address


async def test_a_negative_priority_is_refused_at_once_while_saturated() -> None:
    """Sheddable: 429 with Retry-After, never queued; an unknown objective counts as priority 0."""
    world = World(policy=one_seat_each(), flow=FlowSettings(max_queue=4, queue_timeout=3))
    world.catalog = with_objectives(world.catalog, scavenger=-1)
    routed_now(world.control.route(chat()))
    routed_now(world.control.route(chat()))
    with pytest.raises(Overloaded) as refused:
        world.control.route(chat(), None, RequestClass("scavenger"))
    assert refused.value.code == "sheddable" and refused.value.retry_after == 3
    unknown = world.control.route(chat(), None, RequestClass("no-such-objective"))
    assert isinstance(unknown, Coroutine), "priority 0: it waits"
    unknown.close()


def test_without_flow_control_a_saturated_pool_answers_429_at_once() -> None:
    world = World(policy=one_seat_each())
    routed_now(world.control.route(chat()))
    routed_now(world.control.route(chat()))
    with pytest.raises(Overloaded) as refused:
        world.control.route(chat(), None, RequestClass("anything"))
    assert refused.value.code == "saturated" and refused.value.retry_after == 1


async def test_a_newcomer_queues_behind_waiting_requests_even_when_a_seat_just_freed() -> None:
    """A seat that frees goes to the request that waited, not to one that arrives before the queue's
    dispatch runs."""
    world = World(policy=one_seat_each(), flow=FlowSettings(max_queue=4, queue_timeout=30))
    first = routed_now(world.control.route(chat()))
    routed_now(world.control.route(chat()))
    waiting = asyncio.ensure_future(world.control.route(chat(), None, RequestClass(None, "early")))  # type: ignore[arg-type]
    await asyncio.sleep(0)
    first.stream_ended()  # a seat frees; the queue's dispatch is scheduled, not run yet
    newcomer = world.control.route(chat(), None, RequestClass(None, "late"))
    assert isinstance(newcomer, Coroutine), "the newcomer waits too"
    late = asyncio.ensure_future(newcomer)
    early = await asyncio.wait_for(waiting, 1)
    assert early.lease.endpoint == first.lease.endpoint
    assert not late.done()
    early.stream_ended()
    assert (await asyncio.wait_for(late, 1)).lease.endpoint == first.lease.endpoint
