"""The simulator's KV-event publisher over real ZMQ sockets on loopback, read by an independent subscriber."""

from __future__ import annotations

import asyncio
import hashlib
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
import zmq
import zmq.asyncio

from extproc.errors import ConfigError
from extproc.sim.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from extproc.sim.kv_publisher import END_SEQ, KVEventPublisher
from extproc.sim.kv_wire import encode_batch
from extproc.sim.settings import KVEventSettings, PublisherFaults

from .kv_subscriber import KVSubscriber, ReconstructedCache, hash_to_int

MakePublisher = Callable[..., Awaitable[KVEventPublisher]]
MakeSubscriber = Callable[[], KVSubscriber]
TOPIC = "kv@10.0.0.5@llama"
PROBE = [BlockRemoved((b"\x00" * 32,))]


def digest(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def step(i: int) -> list[KVEvent]:
    """A distinct one-block store per step, so payloads differ."""
    return [BlockStored((digest(f"step-{i}"),), None, tuple(range(i, i + 4)), 4, None, None)]


@pytest.fixture
async def make_publisher() -> AsyncIterator[MakePublisher]:
    """Factory for started publishers on free loopback ports (replay on unless told); closed at teardown."""
    started: list[KVEventPublisher] = []

    async def make(*, dp_rank: int = 0, seed: int | None = None, **settings: Any) -> KVEventPublisher:
        settings.setdefault("port", 0)
        settings.setdefault("replay_port", 0)
        pub = KVEventPublisher(KVEventSettings(**settings), dp_rank=dp_rank, seed=seed)
        started.append(pub)
        await pub.start()
        return pub

    yield make
    for pub in started:
        await pub.close()


@pytest.fixture
def make_subscriber() -> Iterator[MakeSubscriber]:
    """Factory for independent subscribers; closed at teardown."""
    subs: list[KVSubscriber] = []

    def make() -> KVSubscriber:
        subs.append(KVSubscriber())
        return subs[-1]

    yield make
    for sub in subs:
        sub.close()


async def join(pub: KVEventPublisher, sub: KVSubscriber, topic: str = "") -> int:
    """Connect and publish probes until one arrives; returns the last probe's seq."""
    sub.connect(pub.endpoint, topic)
    return await sub.await_joined(lambda: pub.publish(PROBE, ts=0.0))


def payload_of(pub_kwargs: dict[str, Any], events: list[KVEvent], ts: float) -> bytes:
    return encode_batch(
        events,
        ts=ts,
        dp_rank=pub_kwargs.get("dp_rank", 0),
        encoding=pub_kwargs.get("encoding", "maps"),
        hash_format=pub_kwargs.get("hash_format", "int"),
    )


async def test_messages_are_topic_seq_payload_from_zero(
    make_publisher: MakePublisher, make_subscriber: MakeSubscriber
) -> None:
    """Each step is one [topic, seq8, payload] message; seqs count batches from 0 without gaps."""
    pub = await make_publisher(topic=TOPIC, dp_rank=2)
    assert pub.endpoint.startswith("tcp://127.0.0.1:") and not pub.endpoint.endswith(":0")
    sub = make_subscriber()
    last = await join(pub, sub, "kv@")
    seqs = [pub.publish(step(i), ts=10.0 + i) for i in range(3)]
    assert seqs == [last + 1, last + 2, last + 3] and pub.next_seq == last + 4
    for i in range(3):
        message = await sub.recv_batch()
        assert (message.topic, message.seq) == (TOPIC.encode(), last + 1 + i)
        assert message.payload == payload_of({"dp_rank": 2}, step(i), 10.0 + i)
    assert [seq for seq, _ in await sub.replay(pub.replay_endpoint or "", 0)] == list(range(last + 4))
    assert pub.publish([], ts=20.0) is None and pub.next_seq == last + 4


async def test_topic_prefix_filters_messages(
    make_publisher: MakePublisher, make_subscriber: MakeSubscriber
) -> None:
    """A SUB only gets publishers whose topic starts with its prefix (``kv@10.0.0.50@`` is not ``.5``)."""
    wanted = await make_publisher(topic="kv@10.0.0.50@llama")
    other = await make_publisher(topic=TOPIC)
    sub = make_subscriber()
    sub.connect(other.endpoint, "kv@10.0.0.50@")
    last = await join(wanted, sub, "kv@10.0.0.50@")
    other.publish(step(0), ts=1.0)
    marker = wanted.publish(step(1), ts=1.0)
    message = await sub.recv_batch()
    assert (message.topic, message.seq) == (b"kv@10.0.0.50@llama", marker) and marker == last + 1
    with pytest.raises(TimeoutError):
        await sub.recv_batch(timeout=0.1)


@pytest.mark.parametrize("topic_frame", [False, True], ids=["vllm<=0.25-no-topic", "vllm>=0.26-topic"])
async def test_replay_returns_the_range_then_the_end_marker(
    make_publisher: MakePublisher, make_subscriber: MakeSubscriber, topic_frame: bool
) -> None:
    """Replay resends buffered batches with seq >= start, in order, then ff*8 with an empty payload."""
    pub = await make_publisher(topic=TOPIC, replay_topic_frame=topic_frame)
    for i in range(5):
        pub.publish(step(i), ts=float(i))
    sub = make_subscriber()
    batches = await sub.replay(pub.replay_endpoint or "", 2)
    assert batches == [(i, payload_of({}, step(i), float(i))) for i in (2, 3, 4)]
    head = [b"", TOPIC.encode()] if topic_frame else [b""]
    end_head = [b"", b""] if topic_frame else [b""]
    assert sub.last_replay_frames == [
        *([*head, i.to_bytes(8, "big"), payload] for i, payload in batches),
        [*end_head, END_SEQ, b""],
    ]
    assert await sub.replay(pub.replay_endpoint or "", 99) == []
    assert pub.replays_served == 2


async def test_replay_from_before_the_buffer_starts_at_the_oldest_kept(
    make_publisher: MakePublisher, make_subscriber: MakeSubscriber
) -> None:
    """With buffer_steps=3 only the last 3 batches can be replayed; the first seq shows history is lost."""
    pub = await make_publisher(buffer_steps=3)
    for i in range(6):
        pub.publish(step(i), ts=0.0)
    assert [seq for seq, _ in await make_subscriber().replay(pub.replay_endpoint or "", 0)] == [3, 4, 5]


@pytest.mark.parametrize(
    "request_frames",
    [[b"\x00" * 8], [b"", b"\x00" * 4], [b"", b"\x00" * 8, b"extra"], [b"x", b"\x00" * 8]],
    ids=["two-frames", "short-seq", "four-frames", "non-empty-delimiter"],
)
async def test_malformed_replay_requests_are_ignored(
    make_publisher: MakePublisher, request_frames: list[bytes]
) -> None:
    """A bad request gets no answer and is counted; the same client's next good request is served."""
    pub = await make_publisher()
    pub.publish(step(0), ts=0.0)
    dealer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(pub.replay_endpoint or "")
        await dealer.send_multipart(request_frames)
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replies = [await asyncio.wait_for(dealer.recv_multipart(), 2.0) for _ in range(2)]
    finally:
        dealer.close(linger=0)
    assert [frames[-2] for frames in replies] == [(0).to_bytes(8, "big"), END_SEQ]
    assert (pub.malformed_replay_requests, pub.replays_served) == (1, 1)


async def test_drop_next_leaves_a_gap_that_replay_fills(
    make_publisher: MakePublisher, make_subscriber: MakeSubscriber
) -> None:
    """Dropped batches consume seqs and stay replayable with byte-identical payloads."""
    pub = await make_publisher()
    sub = make_subscriber()
    last = await join(pub, sub)
    pub.set_faults(PublisherFaults(drop_next=2))
    sent = {pub.publish(step(i), ts=float(i)): payload_of({}, step(i), float(i)) for i in range(4)}
    live = [await sub.recv_batch(), await sub.recv_batch()]
    assert [m.seq for m in live] == [last + 3, last + 4]
    assert sub.missing_seqs() == [last + 1, last + 2]
    assert (pub.dropped, pub.faults.drop_next) == (2, 0)
    replayed = dict(await sub.replay(pub.replay_endpoint or "", last + 1))
    assert replayed == sent
    assert all(replayed[m.seq] == m.payload for m in live)


async def dropped_offsets(make_publisher: MakePublisher, sub: KVSubscriber, seed: int) -> list[int]:
    """Which of 32 batches a seeded publisher drops at p=0.5, as the subscriber sees it."""
    pub = await make_publisher(seed=seed)
    last = await join(pub, sub)
    pub.set_faults(PublisherFaults(drop_probability=0.5))
    for i in range(32):
        pub.publish(step(i), ts=0.0)
    pub.set_faults(PublisherFaults())
    marker = pub.publish(step(99), ts=0.0)
    received = set()
    while (seq := (await sub.recv_batch()).seq) != marker:
        received.add(seq - last - 1)
    return sorted(set(range(32)) - received)


async def test_drop_probability_is_reproducible_per_seed(
    make_publisher: MakePublisher, make_subscriber: MakeSubscriber
) -> None:
    """The same seed drops the same batches; another seed drops others."""
    runs = [await dropped_offsets(make_publisher, make_subscriber(), seed) for seed in (7, 7, 8)]
    assert runs[0] == runs[1] != runs[2]
    assert 4 <= len(runs[0]) <= 28


async def test_delay_holds_batches_in_order_without_blocking(
    make_publisher: MakePublisher, make_subscriber: MakeSubscriber
) -> None:
    """Delayed batches arrive after the delay, in order, even those published once the delay is off."""
    pub = await make_publisher()
    sub = make_subscriber()
    last = await join(pub, sub)
    loop = asyncio.get_running_loop()
    pub.set_faults(PublisherFaults(delay_seconds=0.05))
    started = loop.time()
    for i in range(3):
        pub.publish(step(i), ts=0.0)
    pub.set_faults(PublisherFaults())
    pub.publish(step(3), ts=0.0)
    assert pub.pending == 4
    first = await sub.recv_batch()
    assert loop.time() - started >= 0.045
    rest = [await sub.recv_batch() for _ in range(3)]
    assert [m.seq for m in [first, *rest]] == [last + 1, last + 2, last + 3, last + 4]
    assert pub.pending == 0


async def test_restart_resets_seq_and_buffer_and_subscribers_reconnect(
    make_publisher: MakePublisher, make_subscriber: MakeSubscriber
) -> None:
    """After a restart: same endpoint, seq from 0, empty replay buffer; a connected SUB keeps receiving."""
    pub = await make_publisher()
    sub = make_subscriber()
    await join(pub, sub)
    endpoint = pub.endpoint
    pub.restart()
    assert (pub.endpoint, pub.next_seq) == (endpoint, 0)
    assert await sub.replay(pub.replay_endpoint or "", 0) == []
    after = await sub.await_joined(lambda: pub.publish(PROBE, ts=0.0))
    seq = pub.publish(step(0), ts=0.0)
    assert (await sub.recv_batch()).seq == seq == after + 1
    assert [s for s, _ in await sub.replay(pub.replay_endpoint or "", 0)] == list(range(seq + 1))


async def test_restart_discards_delayed_batches(
    make_publisher: MakePublisher, make_subscriber: MakeSubscriber
) -> None:
    """Batches still held by a delay die with the old engine and do not hold up the new one's."""
    pub = await make_publisher()
    pub.set_faults(PublisherFaults(delay_seconds=30.0))
    for i in range(2):
        pub.publish(step(i), ts=0.0)
    assert pub.pending == 2
    pub.restart()
    pub.set_faults(PublisherFaults())
    assert pub.pending == 0
    sub = make_subscriber()
    last = await join(pub, sub)
    assert [s for s, _ in await sub.replay(pub.replay_endpoint or "", 0)] == list(range(last + 1))


SEQUENCE: list[list[KVEvent]] = [
    [BlockStored((digest("A"), digest("B")), None, tuple(range(8)), 4, None, None)],
    [BlockStored((digest("C"),), digest("B"), (8, 9, 10, 11), 4, 1, "sql-lora")],
    [BlockStored((digest("A"),), None, tuple(range(4)), 4, None, None), BlockRemoved((digest("A"),))],
    [BlockRemoved((digest("B"),))],
]
AFTER_CLEAR: list[list[KVEvent]] = [
    [AllBlocksCleared(), BlockStored((digest("D"),), None, (7,) * 4, 4, None, None)],
]


@pytest.mark.parametrize("encoding", ["arrays", "maps"])
@pytest.mark.parametrize("hash_format", ["int", "bytes"])
async def test_subscriber_reconstructs_what_was_published(
    make_publisher: MakePublisher, make_subscriber: MakeSubscriber, encoding: str, hash_format: str
) -> None:
    """Stores, a double store removed once, a removal and a clear rebuild the expected multiset."""
    pub = await make_publisher(encoding=encoding, hash_format=hash_format, dp_rank=1)
    sub = make_subscriber()
    await join(pub, sub)
    cache = ReconstructedCache()
    for events in SEQUENCE:
        pub.publish(events, ts=1.0)
        assert cache.apply_batch((await sub.recv_batch()).payload).dp_rank == 1
    a, c = (hash_to_int(digest(n)[-8:]) for n in "AC")
    assert cache.blocks == Counter({a: 1, c: 1})
    assert cache.tokens_of(c) == (8, 9, 10, 11)
    assert cache.info[c].parent == hash_to_int(digest("B")) and cache.info[c].lora_name == "sql-lora"
    assert cache.unknown_removals == 0
    for events in AFTER_CLEAR:
        pub.publish(events, ts=2.0)
        cache.apply_batch((await sub.recv_batch()).payload)
    assert cache.blocks == Counter({hash_to_int(digest("D")): 1})


@pytest.mark.parametrize(
    "kwargs",
    [{"drop_probability": 1.5}, {"drop_probability": -0.1}, {"drop_next": -1}, {"delay_seconds": -1.0}],
    ids=["probability-above-1", "negative-probability", "negative-drop-next", "negative-delay"],
)
def test_invalid_faults_are_rejected(kwargs: dict[str, Any]) -> None:
    """Fault settings outside their range are configuration errors naming the setting."""
    with pytest.raises(ConfigError, match="must be"):
        PublisherFaults(**kwargs)


async def test_context_manager_closes_and_publish_then_fails() -> None:
    """``async with`` binds on entry and closes on exit; publishing afterwards is an error."""
    async with KVEventPublisher(KVEventSettings(port=0, replay_port=0)) as pub:
        assert pub.replay_endpoint is not None and pub.bound
    with pytest.raises(RuntimeError, match="not running"):
        pub.publish(step(0), ts=0.0)
