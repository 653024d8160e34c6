"""Following the catalog: which sources it names (pure), and live subscriptions to simulator publishers.

Catalogs come from the real catalog builder (InferenceWorkerSet + Service + EndpointSlice objects).
PUB drops what a SUB was not connected for, so live tests publish a harmless filler batch while they
wait (``tick``): the subscriber sees a seq past 0 and replays the history it missed from seq 0.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from catalog.test_build import build, eps, iws, svc
from waiting import eventually

from extproc.catalog.model import Catalog
from extproc.catalog.store import CatalogStore
from extproc.kvindex.events import Source
from extproc.kvindex.follow import KVEventsFollower, SourcePlan, plan_sources
from extproc.kvindex.index import PrefixIndex
from extproc.kvindex.ingest import IndexIngest
from extproc.kvindex.keys import block_keys, namespace_seed
from extproc.kvindex.subscriber import SubscriberOptions
from extproc.kvindex.subscriptions import KVSubscriptions, SubscriptionTarget
from extproc.sim.kv_events import BlockRemoved, BlockStored
from extproc.sim.kv_publisher import KVEventPublisher
from extproc.sim.settings import KVEventSettings
from extproc.types import EndpointAddress

MODEL = "llama"
BLOCK = 16
FAST = SubscriberOptions(
    reconnect_interval=0.01, reconnect_interval_max=0.05, replay_timeout=0.5, replay_limit=1.5
)
_RNG = random.Random(11)
DOC = tuple(_RNG.randrange(5000) for _ in range(BLOCK * 4))
KEYS = block_keys(DOC, BLOCK, namespace_seed(MODEL))
DIGESTS = [hashlib.sha256(b"doc-%d" % i).digest() for i in range(4)]
MakePublisher = Callable[..., Awaitable[KVEventPublisher]]


def kv_set(
    name: str,
    ips: list[str],
    *,
    kv_events: dict[str, Any] | None,
    block_size: int = BLOCK,
    models: list[dict[str, Any]] | None = None,
    http_port: int = 8000,
    extra_ports: list[dict[str, Any]] | None = None,
    address_type: str = "IPv4",
    service: str | None = None,
) -> list[dict[str, Any]]:
    """A worker set, its Service and one slice of ready pods at ``ips``; ``kv_events`` is spec.kvEvents."""
    ws = iws(name, models=models, service=service)
    ws["spec"]["kvBlockSize"] = block_size
    if kv_events is not None:
        ws["spec"]["kvEvents"] = kv_events
    ports = [{"name": "http", "port": http_port}, *(extra_ports or [])]
    backing = service or name
    return [ws, svc(backing), eps(f"{backing}-1", backing, ips, ports=ports, address_type=address_type)]


def plan(pub: str, replay: str | None, namespace: str = MODEL, block_size: int = BLOCK) -> SourcePlan:
    return SourcePlan(SubscriptionTarget(pub, replay), namespace, block_size)


def src(address: str) -> Source:
    return Source(EndpointAddress(address), 0)


LLAMA = [{"name": MODEL}]

PLAN_CASES: list[tuple[list[dict[str, Any]], dict[Source, SourcePlan]]] = [
    (
        kv_set("llama", ["10.0.0.1"], kv_events={"port": 5557, "replayPort": 5558}, models=LLAMA),
        {src("10.0.0.1:8000"): plan("tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558")},
    ),
    (
        kv_set(
            "llama",
            ["10.0.0.1"],
            kv_events={"port": "kv", "replayPort": "kv-r"},
            models=LLAMA,
            extra_ports=[{"name": "kv", "port": 6000}, {"name": "kv-r", "port": 6001}],
        ),
        {src("10.0.0.1:8000"): plan("tcp://10.0.0.1:6000", "tcp://10.0.0.1:6001")},
    ),
    (
        kv_set(
            "llama",
            ["10.0.0.1"],
            kv_events={"port": 5557},
            models=LLAMA,
            extra_ports=[{"name": "kv-replay", "port": 5600}],
        ),
        {src("10.0.0.1:8000"): plan("tcp://10.0.0.1:5557", "tcp://10.0.0.1:5600")},
    ),
    (
        kv_set("llama", ["10.0.0.1"], kv_events={"port": 5557}, models=LLAMA),
        {src("10.0.0.1:8000"): plan("tcp://10.0.0.1:5557", None)},
    ),
    (
        kv_set("llama", ["10.0.0.1"], kv_events={"port": 5557, "replayPort": "nope"}, models=LLAMA),
        {src("10.0.0.1:8000"): plan("tcp://10.0.0.1:5557", None)},
    ),
    (kv_set("llama", ["10.0.0.1"], kv_events=None, models=LLAMA), {}),
    (kv_set("llama", ["10.0.0.1"], kv_events={"port": "nope"}, models=LLAMA), {}),
    (
        kv_set(
            "llama",
            ["fd00::1", "fd00::2"],
            kv_events={"port": 5557, "replayPort": 5558},
            models=LLAMA,
            address_type="IPv6",
        ),
        {
            src("[fd00::1]:8000"): plan("tcp://[fd00::1]:5557", "tcp://[fd00::1]:5558"),
            src("[fd00::2]:8000"): plan("tcp://[fd00::2]:5557", "tcp://[fd00::2]:5558"),
        },
    ),
    (
        kv_set(
            "llama",
            ["10.0.0.2", "10.0.0.1"],
            kv_events={"port": 5557},
            block_size=32,
            models=[{"name": "base", "aliases": ["b"]}, {"name": "other"}],
        ),
        {
            src("10.0.0.1:8000"): plan("tcp://10.0.0.1:5557", None, "base", 32),
            src("10.0.0.2:8000"): plan("tcp://10.0.0.2:5557", None, "base", 32),
        },
    ),
    (kv_set("llama", ["10.0.0.1"], kv_events={"port": 5557}, models=[]), {}),
    (
        [
            *kv_set("a", ["10.0.0.1"], kv_events={"port": 5557}, models=[{"name": "a"}], service="shared"),
            *kv_set("b", ["10.0.0.1"], kv_events={"port": 5557}, models=[{"name": "b"}], service="shared")[
                :1
            ],
        ],
        {src("10.0.0.1:8000"): plan("tcp://10.0.0.1:5557", None, "a")},
    ),
    (
        [
            *kv_set("kv", ["10.0.0.1"], kv_events={"port": 5557}, models=LLAMA),
            *kv_set("plain", ["10.0.1.1"], kv_events=None, models=LLAMA),
        ],
        {src("10.0.0.1:8000"): plan("tcp://10.0.0.1:5557", None)},
    ),
]
PLAN_IDS = [
    "replay-port-number",
    "ports-by-name",
    "replay-from-kv-replay-port-name",
    "no-replay",
    "replay-name-unresolved",
    "no-kv-events",
    "kv-port-name-unresolved",
    "ipv6-bracketed",
    "first-model-namespace-and-block-size",
    "set-without-models-skipped",
    "pod-in-two-sets-kept-once",
    "only-sets-with-kv-events",
]


@pytest.mark.parametrize(("objects", "expected"), PLAN_CASES, ids=PLAN_IDS)
def test_plan_sources(objects: list[dict[str, Any]], expected: dict[Source, SourcePlan]) -> None:
    """Every ready endpoint of a set with kvEvents and models is one source, dialled at its pod IP."""
    assert plan_sources(build(*objects)) == expected


# --- live: a real CatalogStore, KVSubscriptions and simulator publishers -------------------------


def port_of(endpoint: str | None) -> int:
    assert endpoint is not None
    return int(endpoint.rsplit(":", 1)[1])


def live_catalog(**pubs: tuple[KVEventPublisher, int]) -> Catalog:
    """One set per publisher (name -> (publisher, HTTP port)), all on 127.0.0.1, serving MODEL."""
    objects: list[dict[str, Any]] = []
    for name, (pub, http_port) in pubs.items():
        kv = {"port": port_of(pub.endpoint), "replayPort": port_of(pub.replay_endpoint)}
        objects += kv_set(name, ["127.0.0.1"], kv_events=kv, models=LLAMA, http_port=http_port)
    return build(*objects)


def stored(first: int, count: int) -> BlockStored:
    return BlockStored(
        tuple(DIGESTS[first : first + count]),
        DIGESTS[first - 1] if first else None,
        DOC[first * BLOCK : (first + count) * BLOCK],
        BLOCK,
        None,
        None,
    )


def filler(pub: KVEventPublisher) -> Callable[[], object]:
    """Publishes a harmless batch (removal of a block nobody stored): keeps seqs moving."""
    counter = itertools.count()
    return lambda: pub.publish([BlockRemoved((hashlib.sha256(b"%d" % next(counter)).digest(),))], ts=0.0)


@pytest.fixture
async def make_publisher() -> AsyncIterator[MakePublisher]:
    """Started simulator publishers with replay, on free loopback ports; closed at teardown."""
    started: list[KVEventPublisher] = []

    async def make() -> KVEventPublisher:
        started.append(KVEventPublisher(KVEventSettings(port=0, replay_port=0)))
        await started[-1].start()
        return started[-1]

    yield make
    for pub in started:
        await pub.close()


class Follower:
    """A started KVEventsFollower with its store, index, ingest and subscriptions."""

    def __init__(self) -> None:
        self.store = CatalogStore()
        self.index = PrefixIndex(max_entries=10_000, max_entries_per_source=10_000)
        self.ingest = IndexIngest(self.index)
        self.subscriptions = KVSubscriptions(self.ingest, options=FAST)
        self.follower = KVEventsFollower(self.store, self.index, self.ingest, self.subscriptions)
        self.follower.start()


@pytest.fixture
async def follower() -> AsyncIterator[Follower]:
    f = Follower()
    yield f
    await f.follower.close()


async def test_follower_subscribes_to_what_the_catalog_names_and_drops_what_leaves(
    make_publisher: MakePublisher, follower: Follower
) -> None:
    """A catalog starts subscriptions (history replayed, new events indexed); leavers lose blocks."""
    pub_a, pub_b = await make_publisher(), await make_publisher()
    a, b = src("127.0.0.1:8001"), src("127.0.0.1:8002")
    index = follower.index
    pub_a.publish([stored(0, 2)], ts=1.0)  # before anyone subscribed: only replay can deliver it
    follower.store.publish(live_catalog(a=(pub_a, 8001), b=(pub_b, 8002)))
    await eventually(lambda: set(follower.subscriptions.targets()) == {a, b})
    assert set(index.sources()) == {a, b}
    assert follower.follower.plans[a].target.pub_address == pub_a.endpoint
    await eventually(lambda: index.match(KEYS, [a]) == {a: 2}, tick=filler(pub_a))

    pub_b.publish([stored(0, 3)], ts=2.0)
    await eventually(lambda: index.match(KEYS, [b]) == {b: 3}, tick=filler(pub_b))
    assert index.match(KEYS) == {a: 2, b: 3}
    await eventually(lambda: all(follower.ingest.health.get(s) is not None for s in (a, b)))
    assert follower.ingest.health[a].complete and follower.ingest.health[b].complete
    assert index.incomplete_sources() == frozenset()

    follower.store.publish(live_catalog(a=(pub_a, 8001)))
    await eventually(lambda: b not in index.sources())
    assert index.match(KEYS, [a, b]) == {a: 2, b: 0}
    assert set(follower.subscriptions.targets()) == {a}
    assert set(follower.follower.plans) == {a}
    assert b not in follower.ingest.health
    assert follower.ingest.counters.unknown_source == 0

    pub_a.publish([stored(2, 1)], ts=3.0)  # the remaining source keeps following
    await eventually(lambda: index.match(KEYS, [a]) == {a: 3}, tick=filler(pub_a))


async def test_follower_resubscribes_when_a_pods_kv_port_changes(
    make_publisher: MakePublisher, follower: Follower
) -> None:
    """A pod whose publisher moved loses the old publisher's blocks and follows the new one."""
    old, new = await make_publisher(), await make_publisher()
    a = src("127.0.0.1:8001")
    old.publish([stored(0, 3)], ts=1.0)
    new.publish([stored(0, 1)], ts=1.0)
    follower.store.publish(live_catalog(a=(old, 8001)))
    await eventually(lambda: follower.index.match(KEYS) == {a: 3}, tick=filler(old))
    follower.store.publish(live_catalog(a=(new, 8001)))
    await eventually(lambda: follower.index.match(KEYS) == {a: 1}, tick=filler(new))
    assert follower.subscriptions.targets()[a].pub_address == new.endpoint
    assert follower.ingest.health[a].last_reset.startswith("subscription target changed")


async def test_close_stops_everything(make_publisher: MakePublisher) -> None:
    """After close no subscription runs and later catalogs are not followed."""
    pub = await make_publisher()
    f = Follower()
    a = src("127.0.0.1:8001")
    f.store.publish(live_catalog(a=(pub, 8001)))
    await eventually(lambda: set(f.subscriptions.targets()) == {a})
    await f.follower.close()
    assert f.subscriptions.targets() == {}
    other = await make_publisher()
    f.store.publish(live_catalog(a=(pub, 8001), b=(other, 8002)))
    for _ in range(20):
        await asyncio.sleep(0)
    assert f.index.sources() == [a]
    with pytest.raises(RuntimeError, match="closed"):
        await f.subscriptions.sync({})
    await f.follower.close()  # idempotent
