"""KV-event subscribers against the simulator's real publisher (and raw ZMQ sockets) on loopback.

PUB drops what a SUB was not connected for, so no test asserts on "the first message": tests
publish until a condition holds (``pump``) and rely on the subscriber's replay-from-0 to fill in.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import zmq
import zmq.asyncio
from waiting import eventually

from extproc.kvindex.events import Source
from extproc.kvindex.subscriber import (
    END_SEQ,
    KVEventSink,
    KVEventSubscriber,
    SubscriberOptions,
)
from extproc.kvindex.subscriptions import KVSubscriptions, SubscriptionTarget, rank_targets
from extproc.sim.kv_events import BlockStored, KVEvent
from extproc.sim.kv_publisher import KVEventPublisher
from extproc.sim.kv_wire import encode_batch
from extproc.sim.settings import KVEventSettings, PublisherFaults
from extproc.types import EndpointAddress

SOURCE = Source(EndpointAddress("10.0.0.5:8000"), 0)
FAST = SubscriberOptions(
    reconnect_interval=0.01, reconnect_interval_max=0.05, replay_timeout=0.5, replay_limit=1.5
)
MakePublisher = Callable[..., Awaitable[KVEventPublisher]]
MakeSubscriber = Callable[..., KVEventSubscriber]


class RecordingSink:
    """Every sink call, in order, for every source."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def on_batch(self, source: Source, seq: int, payload: bytes) -> None:
        self.calls.append(("batch", source, seq, payload))

    def on_reset(self, source: Source, reason: str) -> None:
        self.calls.append(("reset", source, reason))

    def on_completeness(self, source: Source, complete: bool, reason: str) -> None:
        self.calls.append(("complete", source, complete, reason))

    def of(self, kind: str, source: Source = SOURCE, *, since_reset: bool = False) -> list[tuple[Any, ...]]:
        """The arguments of ``kind`` calls for ``source`` (after its last reset if asked)."""
        calls = [c for c in self.calls if c[1] == source]
        if since_reset:
            resets = [i for i, c in enumerate(calls) if c[0] == "reset"]
            calls = calls[resets[-1] + 1 :] if resets else calls
        return [c[2:] for c in calls if c[0] == kind]

    def seqs(self, source: Source = SOURCE, *, since_reset: bool = False) -> list[int]:
        return [seq for seq, _ in self.of("batch", source, since_reset=since_reset)]


class Feed:
    """Publishes distinct one-block steps and remembers each seq's exact payload."""

    def __init__(self, pub: KVEventPublisher) -> None:
        self.pub = pub
        self.sent: dict[int, bytes] = {}
        self._steps = itertools.count()

    def publish(self) -> int:
        i = next(self._steps)  # never reused, so a restarted publisher's seq N has other bytes
        events: list[KVEvent] = [
            BlockStored((hashlib.sha256(b"%d" % i).digest(),), None, (i, i, i, i), 4, None, None)
        ]
        seq = self.pub.publish(events, ts=float(i))
        assert seq is not None
        self.sent[seq] = encode_batch(events, ts=float(i), dp_rank=0, encoding="maps", hash_format="int")
        return seq

    def burst(self, count: int) -> int:
        """Publish ``count`` steps without yielding to the loop; returns the last seq."""
        return [self.publish() for _ in range(count)][-1]


@pytest.fixture
async def make_publisher() -> AsyncIterator[MakePublisher]:
    """Started simulator publishers on free loopback ports (replay on unless told); closed at teardown."""
    started: list[KVEventPublisher] = []

    async def make(**settings: Any) -> KVEventPublisher:
        settings.setdefault("port", 0)
        settings.setdefault("replay_port", 0)
        started.append(KVEventPublisher(KVEventSettings(**settings)))
        await started[-1].start()
        return started[-1]

    yield make
    for pub in started:
        await pub.close()


@pytest.fixture
async def make_subscriber() -> AsyncIterator[MakeSubscriber]:
    """Started subscribers (``SOURCE``, fast reconnects unless told); closed at teardown."""
    started: list[KVEventSubscriber] = []

    def make(pub_address: str, sink: KVEventSink, **kwargs: Any) -> KVEventSubscriber:
        kwargs.setdefault("source", SOURCE)
        kwargs.setdefault("options", FAST)
        started.append(KVEventSubscriber(pub_address=pub_address, sink=sink, **kwargs))
        started[-1].start()
        return started[-1]

    yield make
    for sub in started:
        await sub.close()


@pytest.fixture
async def raw_socket() -> AsyncIterator[Callable[[int], tuple[zmq.asyncio.Socket, str]]]:
    """Raw sockets bound on a free loopback port, for what a well-behaved publisher never sends."""
    socks: list[zmq.asyncio.Socket] = []

    def make(kind: int) -> tuple[zmq.asyncio.Socket, str]:
        sock = zmq.asyncio.Context.instance().socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        socks.append(sock)
        sock.bind("tcp://127.0.0.1:0")
        return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)

    yield make
    for sock in socks:
        sock.close(linger=0)


@pytest.mark.parametrize(("pub_topic", "sub_topic"), [("", b""), ("kv@10.0.0.5@llama", b"kv@10.0.0.5@")])
async def test_delivers_every_batch_in_order_from_seq_0(
    make_publisher: MakePublisher, make_subscriber: MakeSubscriber, pub_topic: str, sub_topic: bytes
) -> None:
    """A fresh subscriber hands on seqs 0, 1, 2, ... once each, with the exact payloads, and is complete."""
    pub, sink = await make_publisher(topic=pub_topic), RecordingSink()
    feed = Feed(pub)
    sub = make_subscriber(
        pub.endpoint, sink, replay_address=pub.replay_endpoint, topic=sub_topic, clock=lambda: 42.0
    )
    await eventually(lambda: len(sink.seqs()) >= 5, tick=feed.publish)
    assert sink.seqs() == list(range(len(sink.seqs())))
    assert [payload for _, payload in sink.of("batch")] == [feed.sent[s] for s in sink.seqs()]
    assert sink.of("complete") == [(True, "in sync from seq 0")] and sink.of("reset") == []
    stats = sub.stats()
    assert (stats.complete, stats.running, stats.last_seq) == (True, True, sink.seqs()[-1])
    assert (stats.connected, stats.counters.connections, stats.last_message_at) == (True, 1, 42.0)
    assert stats.counters.lost == 0


async def test_late_join_with_replay_gets_history_from_0(
    make_publisher: MakePublisher, make_subscriber: MakeSubscriber
) -> None:
    """Batches published before the subscriber existed come from the replay socket, in order."""
    pub, sink = await make_publisher(), RecordingSink()
    feed = Feed(pub)
    feed.burst(5)
    sub = make_subscriber(pub.endpoint, sink, replay_address=pub.replay_endpoint)
    await eventually(lambda: len(sink.seqs()) >= 8, tick=feed.publish)
    assert sink.seqs() == list(range(len(sink.seqs())))
    assert sink.of("complete") == [(True, "in sync from seq 0")]
    assert sub.stats().counters.replays_ok >= 1


async def test_late_join_without_replay_reports_incomplete(
    make_publisher: MakePublisher, make_subscriber: MakeSubscriber
) -> None:
    """Without replay, a subscriber that joins at seq N delivers from N and says history is missing."""
    pub, sink = await make_publisher(replay_port=None), RecordingSink()
    feed = Feed(pub)
    feed.burst(3)
    sub = make_subscriber(pub.endpoint, sink)
    await eventually(lambda: len(sink.seqs()) >= 2, tick=feed.publish)
    first = sink.seqs()[0]
    assert first >= 3 and sink.seqs() == list(range(first, first + len(sink.seqs())))
    assert sink.of("complete") == [(False, f"joined at seq {first} without replay")]
    assert (sub.stats().complete, sub.stats().counters.lost) == (False, first)


async def test_late_join_after_history_left_the_buffer_reports_what_is_lost(
    make_publisher: MakePublisher, make_subscriber: MakeSubscriber
) -> None:
    """Replay from 0 that starts at seq F delivers from F and reports "history before seq F lost"."""
    pub, sink = await make_publisher(buffer_steps=3), RecordingSink()
    feed = Feed(pub)
    feed.burst(6)
    sub = make_subscriber(pub.endpoint, sink, replay_address=pub.replay_endpoint)
    await eventually(lambda: len(sink.seqs()) >= 4, tick=feed.publish)
    first = sink.seqs()[0]
    assert first >= 3 and sink.seqs() == list(range(first, first + len(sink.seqs())))
    assert sink.of("complete") == [(False, f"history before seq {first} lost")]
    assert sub.stats().counters.replays_partial == 1


@pytest.mark.parametrize("topic_frame", [False, True], ids=["vllm<=0.25-no-topic", "vllm>=0.26-topic"])
async def test_gap_is_filled_by_replay_each_seq_once_in_order(
    make_publisher: MakePublisher, make_subscriber: MakeSubscriber, topic_frame: bool
) -> None:
    """Dropped batches come from replay; live copies the replay got ahead of are dropped as duplicates."""
    pub = await make_publisher(replay_topic_frame=topic_frame, topic="kv@x@m")
    sink, feed = RecordingSink(), Feed(pub)
    sub = make_subscriber(pub.endpoint, sink, replay_address=pub.replay_endpoint)
    await eventually(lambda: len(sink.seqs()) >= 2, tick=feed.publish)
    pub.set_faults(PublisherFaults(drop_next=3))
    last = feed.burst(20)  # 3 dropped, then 17 queued for the SUB while the replay serves them all
    await eventually(lambda: len(sink.seqs()) >= last + 10, tick=feed.publish)  # live keeps coming
    assert sink.seqs() == list(range(len(sink.seqs())))
    assert [payload for _, payload in sink.of("batch")] == [feed.sent[s] for s in sink.seqs()]
    counters = sub.stats().counters
    assert (counters.gaps, counters.lost, counters.replays_partial, counters.replays_failed) == (1, 0, 0, 0)
    assert counters.duplicates >= 16
    assert sink.of("complete") == [(True, "in sync from seq 0")]


async def test_gap_replay_cannot_cover_reports_incomplete(
    make_publisher: MakePublisher, make_subscriber: MakeSubscriber
) -> None:
    """Dropped batches that already left the replay buffer are reported lost; the rest is delivered."""
    pub, sink = await make_publisher(buffer_steps=3), RecordingSink()
    feed = Feed(pub)
    sub = make_subscriber(pub.endpoint, sink, replay_address=pub.replay_endpoint)
    await eventually(lambda: len(sink.seqs()) >= 2, tick=feed.publish)
    before = sub.stats().counters
    pub.set_faults(PublisherFaults(drop_next=5))
    last = feed.burst(6)  # seqs last-5 .. last-1 dropped; the buffer keeps last-2 .. last
    await eventually(lambda: sink.seqs()[-1:] == [last])
    assert sink.seqs()[-4:] == [last - 6, last - 2, last - 1, last]
    assert sink.of("complete")[-1] == (
        False,
        f"batches {last - 5}-{last - 3} lost (no longer in the replay buffer)",
    )
    after = sub.stats().counters
    assert (after.lost - before.lost, after.replays_partial - before.replays_partial) == (3, 1)
    assert sub.stats().complete is False


async def test_replay_timeout_reports_incomplete(
    make_publisher: MakePublisher,
    make_subscriber: MakeSubscriber,
    raw_socket: Callable[[int], tuple[zmq.asyncio.Socket, str]],
) -> None:
    """A replay socket that never answers costs one replay timeout; delivery goes on, marked incomplete."""
    pub, sink = await make_publisher(replay_port=None), RecordingSink()
    _, silent = raw_socket(zmq.ROUTER)
    feed = Feed(pub)
    feed.burst(3)
    options = SubscriberOptions(reconnect_interval=0.01, replay_timeout=0.1, replay_limit=0.5)
    sub = make_subscriber(pub.endpoint, sink, replay_address=silent, options=options)
    await eventually(lambda: len(sink.seqs()) >= 2, tick=feed.publish)
    first = sink.seqs()[0]
    assert sink.of("complete") == [(False, f"history before seq {first} lost (replay timed out)")]
    assert sub.stats().counters.replays_failed == 1


@pytest.mark.parametrize("early", [0, 5], ids=["first-seen-seq-is-low", "new-engine-reaches-expected-seq"])
async def test_restart_resets_then_delivers_from_seq_0(
    make_publisher: MakePublisher, make_subscriber: MakeSubscriber, early: int
) -> None:
    """A restarted publisher (seq back to 0) resets the source once; delivery resumes from 0, complete."""
    pub, sink = await make_publisher(), RecordingSink()
    feed = Feed(pub)
    sub = make_subscriber(pub.endpoint, sink, replay_address=pub.replay_endpoint)
    await eventually(lambda: len(sink.seqs()) >= 5, tick=feed.publish)
    before = sink.seqs()[-1]
    pub.restart()
    feed.sent.clear()
    if early:
        feed.burst(early)  # sent before the SUB is back: it may next see exactly the seq it expects
    await eventually(
        lambda: len(sink.seqs(since_reset=True)) >= early + 3 and bool(sink.of("reset")), tick=feed.publish
    )
    (reason,) = sink.of("reset")
    assert reason[0].startswith("publisher restarted") and sink.seqs()[: before + 1] == list(
        range(before + 1)
    )
    after = sink.seqs(since_reset=True)
    assert after == list(range(len(after)))
    assert [payload for _, payload in sink.of("batch", since_reset=True)] == [feed.sent[s] for s in after]
    assert sink.of("complete", since_reset=True) == [(True, "in sync from seq 0")]
    stats = sub.stats()
    assert (stats.complete, stats.counters.restarts) == (True, 1) and stats.counters.disconnects >= 1


async def test_an_idle_restarted_engine_is_noticed_on_reconnect(
    make_publisher: MakePublisher, make_subscriber: MakeSubscriber
) -> None:
    """A restarted engine that publishes nothing yet resets the source at once (its replay is empty)."""
    pub, sink = await make_publisher(), RecordingSink()
    feed = Feed(pub)
    sub = make_subscriber(pub.endpoint, sink, replay_address=pub.replay_endpoint)
    await eventually(lambda: len(sink.seqs()) >= 3, tick=feed.publish)
    pub.restart()  # and nothing published after it
    await eventually(lambda: bool(sink.of("reset")), what="the reset without a new batch")
    (reason,) = sink.of("reset")
    assert "no longer holds seq" in reason[0]
    assert sub.stats().counters.restarts == 1
    feed.sent.clear()
    await eventually(lambda: len(sink.seqs(since_reset=True)) >= 2, tick=feed.publish)
    assert sink.seqs(since_reset=True)[:2] == [0, 1]


@pytest.mark.parametrize(
    "resync", [False, True], ids=["restart-found-on-reconnect", "resync-asked-while-down"]
)
async def test_batches_a_restarted_engine_sent_before_we_reconnected_come_from_its_replay(
    make_publisher: MakePublisher, make_subscriber: MakeSubscriber, resync: bool
) -> None:
    """PUB drops what it sends while nobody is connected: those batches are read back on reconnect,
    without waiting for the engine to publish again (it may stay idle for long)."""
    pub, sink = await make_publisher(), RecordingSink()
    feed = Feed(pub)
    sub = make_subscriber(pub.endpoint, sink, replay_address=pub.replay_endpoint)
    await eventually(lambda: len(sink.seqs()) >= 3, tick=feed.publish)
    if resync:  # what serve does when the engine stops answering (Subscriptions.resync)
        sink.on_reset(SOURCE, "engine unreachable")
        sub.request_resync("engine unreachable")
    pub.restart()
    feed.sent.clear()
    last = feed.burst(3)  # before the SUB is back; nothing is published after this
    await eventually(
        lambda: bool(sink.of("reset")) and sink.seqs(since_reset=True) == list(range(last + 1)),
        what="the replayed batches",
    )
    assert [payload for _, payload in sink.of("batch", since_reset=True)] == [
        feed.sent[s] for s in range(last + 1)
    ]
    assert sub.stats().complete is True
    more = feed.burst(2)  # and the live stream goes on from there, with no second reset
    await eventually(lambda: sink.seqs()[-1] == more, what="the next live batches")
    assert sink.seqs(since_reset=True) == list(range(more + 1))
    assert sub.stats().counters.restarts == (0 if resync else 1)


async def test_a_reconnect_to_the_same_engine_resets_nothing(
    make_publisher: MakePublisher, make_subscriber: MakeSubscriber
) -> None:
    """A connection that drops and comes back to the same engine is checked, found the same, kept."""
    pub, sink = await make_publisher(), RecordingSink()
    feed = Feed(pub)
    sub = make_subscriber(pub.endpoint, sink, replay_address=pub.replay_endpoint)
    await eventually(lambda: len(sink.seqs()) >= 3, tick=feed.publish)
    connections = sub.stats().counters.connections
    pub.drop_connections()
    await eventually(lambda: sub.stats().counters.reconnect_checks == 1, what="the reconnect checked")
    assert sub.stats().counters.connections > connections
    last = feed.burst(3)
    await eventually(lambda: sink.seqs()[-1] == last, what="the next batches")
    assert not sink.of("reset") and sink.seqs() == list(range(last + 1))


async def test_malformed_and_oversized_messages_are_counted_and_skipped(
    make_subscriber: MakeSubscriber, raw_socket: Callable[[int], tuple[zmq.asyncio.Socket, str]]
) -> None:
    """Bad frames are counted malformed, a big payload is skipped (and lost); the stream goes on."""
    pub, endpoint = raw_socket(zmq.PUB)
    sink, seqs = RecordingSink(), itertools.count()
    options = SubscriberOptions(max_payload_bytes=1024, reconnect_interval=0.01, reconnect_interval_max=0.05)
    sub = make_subscriber(endpoint, sink, options=options)

    def send(seq: int, payload: bytes = b"ok") -> None:
        pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    await eventually(lambda: bool(sink.seqs()), tick=lambda: send(next(seqs)))
    before = sub.stats().counters
    big = next(seqs)
    for frames in (
        [b"", b"\x00" * 8],
        [b"", b"\x00" * 7, b"x"],
        [b"", END_SEQ, b""],
        [b"", big.to_bytes(8, "big"), b"y" * 1025],
    ):
        pub.send_multipart(frames)
    send(big + 1)
    await eventually(lambda: sink.seqs()[-1] == big + 1)
    assert sink.seqs()[-2:] == [big - 1, big + 1]
    after = sub.stats().counters
    assert (after.malformed, after.oversized, after.lost - before.lost) == (3, 1, 1)
    assert sink.of("complete")[-1] == (False, f"batch {big} skipped: 1025 bytes > max_payload_bytes 1024")


async def test_frame_over_the_hard_limit_drops_the_connection_not_the_stream(
    make_subscriber: MakeSubscriber, raw_socket: Callable[[int], tuple[zmq.asyncio.Socket, str]]
) -> None:
    """libzmq refuses a frame over 2x max_payload_bytes (ZMQ_MAXMSGSIZE); the SUB reconnects and goes on."""
    pub, endpoint = raw_socket(zmq.PUB)
    sink, seqs = RecordingSink(), itertools.count()
    sub = make_subscriber(
        endpoint,
        sink,
        options=SubscriberOptions(
            max_payload_bytes=1024, reconnect_interval=0.01, reconnect_interval_max=0.05
        ),
    )

    def send(payload: bytes = b"ok") -> None:
        pub.send_multipart([b"", next(seqs).to_bytes(8, "big"), payload])

    await eventually(lambda: bool(sink.seqs()), tick=send)
    send(b"z" * 4096)
    await eventually(lambda: sub.stats().counters.disconnects >= 1)
    count = len(sink.seqs())
    await eventually(lambda: len(sink.seqs()) > count, tick=send)
    counters = sub.stats().counters
    assert (counters.oversized, counters.redials) == (0, 1) and sink.seqs() == sorted(set(sink.seqs()))


class FailingSink(RecordingSink):
    """Raises on the first ``on_batch`` (after recording it)."""

    def on_batch(self, source: Source, seq: int, payload: bytes) -> None:
        super().on_batch(source, seq, payload)
        if len(self.seqs()) == 1:
            raise RuntimeError("index bug")


async def test_sink_exception_does_not_stop_the_subscriber(make_publisher: MakePublisher) -> None:
    """A sink that raises is counted and logged; the next batches still arrive."""
    pub, sink = await make_publisher(), FailingSink()
    feed = Feed(pub)
    async with KVEventSubscriber(
        source=SOURCE, pub_address=pub.endpoint, replay_address=pub.replay_endpoint, sink=sink, options=FAST
    ) as sub:
        await eventually(lambda: len(sink.seqs()) >= 3, tick=feed.publish)
        assert sink.seqs() == list(range(len(sink.seqs())))
        assert (sub.stats().counters.sink_errors, sub.stats().running) == (1, True)
    assert sub.stats().running is False


async def test_subscriptions_follow_added_removed_and_changed_sources(make_publisher: MakePublisher) -> None:
    """sync starts new sources, resets removed and moved ones after stopping them, restarts moved ones."""
    a, b, c = [await make_publisher() for _ in range(3)]
    source_a, source_b = SOURCE, Source(EndpointAddress("10.0.0.6:8000"), 1)
    target = {p: SubscriptionTarget(p.endpoint, p.replay_endpoint) for p in (a, b, c)}
    feeds = {p: Feed(p) for p in (a, b, c)}
    sink = RecordingSink()
    subs = KVSubscriptions(sink, options=FAST)
    try:
        await subs.sync({source_a: target[a], source_b: target[b]})
        await subs.sync({source_a: target[a], source_b: target[b]})  # unchanged: nothing restarts
        assert set(subs.stats()) == {source_a, source_b}

        def tick() -> None:
            for feed in feeds.values():
                feed.publish()

        await eventually(lambda: bool(sink.seqs(source_a)) and bool(sink.seqs(source_b)), tick=tick)
        await subs.sync({source_a: target[c]})
        assert sink.of("reset", source_b) == [("endpoint removed",)]
        assert sink.of("reset", source_a) == [(f"subscription target changed to {c.endpoint}",)]
        assert subs.targets() == {source_a: target[c]}
        await eventually(lambda: len(sink.seqs(source_a, since_reset=True)) >= 2, tick=tick)
        assert sink.seqs(source_a, since_reset=True)[:2] == [0, 1]
        assert [c for c in sink.calls if c[1] == source_b][-1] == ("reset", source_b, "endpoint removed")
    finally:
        await subs.close()
    assert subs.stats() == {}


async def test_resync_resets_the_endpoint_now_and_reads_it_again_from_seq_0(
    make_publisher: MakePublisher,
) -> None:
    """resync(endpoint): the sink forgets that endpoint's sources at once, others untouched; the next
    batch makes its subscriber start over from seq 0 (replayed), as for a new engine."""
    a, b = await make_publisher(), await make_publisher()
    other = Source(EndpointAddress("10.0.0.6:8000"), 0)
    feeds = {a: Feed(a), b: Feed(b)}
    sink = RecordingSink()
    subs = KVSubscriptions(sink, options=FAST)
    try:
        await subs.sync(
            {SOURCE: SubscriptionTarget(a.endpoint, a.replay_endpoint), other: SubscriptionTarget(b.endpoint)}
        )

        def tick() -> None:
            for feed in feeds.values():
                feed.publish()

        await eventually(lambda: len(sink.seqs(SOURCE)) >= 3 and bool(sink.seqs(other)), tick=tick)
        assert subs.resync(SOURCE.endpoint, "engine unreachable") == [SOURCE]
        assert sink.of("reset", SOURCE) == [("engine unreachable",)] and not sink.of("reset", other)
        last = feeds[a].publish()
        await eventually(lambda: sink.seqs(SOURCE, since_reset=True)[-1:] == [last], what="read again")
        assert sink.seqs(SOURCE, since_reset=True) == list(range(last + 1))
        assert sink.of("reset", SOURCE) == [("engine unreachable",)]  # reset once, not twice
    finally:
        await subs.close()


async def test_subscriptions_follow_a_fleet_past_libzmqs_default_socket_cap() -> None:
    """A thousand sources (two or three sockets each) all subscribe: libzmq's default cap of
    1,023 sockets a context stopped ~400 endpoints short of that."""
    subs = KVSubscriptions(RecordingSink(), options=FAST)
    sources = {
        Source(EndpointAddress(f"127.0.{i // 250}.{i % 250 + 1}:8000"), 0): SubscriptionTarget(
            f"tcp://127.0.{i // 250}.{i % 250 + 1}:1"
        )
        for i in range(1000)
    }
    try:
        await subs.sync(sources)
        assert len(subs.stats()) == 1000
    finally:
        await subs.close()


async def test_subscriptions_skip_a_target_that_cannot_connect() -> None:
    """A malformed address is logged and left out (tried again on the next sync), not raised."""
    subs = KVSubscriptions(RecordingSink(), options=FAST)
    await subs.sync({SOURCE: SubscriptionTarget("tcp://127.0.0.1")})
    assert subs.stats() == {}
    await subs.close()


@pytest.mark.parametrize(
    ("endpoint", "replay_port", "dp_size", "expected"),
    [
        ("10.0.0.5:8000", 5657, 1, {0: ("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5657")}),
        (
            "10.0.0.5:8000",
            5657,
            3,
            {r: (f"tcp://10.0.0.5:{5557 + r}", f"tcp://10.0.0.5:{5657 + r}") for r in range(3)},
        ),
        ("10.0.0.5:8000", None, 2, {0: ("tcp://10.0.0.5:5557", None), 1: ("tcp://10.0.0.5:5558", None)}),
        ("[fd00::5]:8000", None, 1, {0: ("tcp://[fd00::5]:5557", None)}),
    ],
    ids=["one-rank", "three-ranks-offset", "no-replay", "ipv6"],
)
def test_rank_targets_offset_ports_by_rank(
    endpoint: str, replay_port: int | None, dp_size: int, expected: dict[int, tuple[str, str | None]]
) -> None:
    """Rank r follows pub_port + r and replay_port + r on the pod's host, keyed by (endpoint, rank)."""
    got = rank_targets(
        EndpointAddress(endpoint), pub_port=5557, replay_port=replay_port, dp_size=dp_size, topic=b"kv@"
    )
    assert got == {
        Source(EndpointAddress(endpoint), r): SubscriptionTarget(pub, replay, b"kv@")
        for r, (pub, replay) in expected.items()
    }


@pytest.mark.parametrize(
    ("endpoint", "pub_port", "dp_size"),
    [("10.0.0.5", 5557, 1), ("10.0.0.5:8000", 5557, 0), ("10.0.0.5:8000", 65535, 2), ("10.0.0.5:8000", 0, 1)],
    ids=["no-port", "no-ranks", "port-overflow", "port-0"],
)
def test_rank_targets_rejects_bad_input(endpoint: str, pub_port: int, dp_size: int) -> None:
    """Endpoints without a port, dp_size < 1 and ports outside 1-65535 are refused."""
    with pytest.raises(ValueError, match=r"must be|leaves"):
        rank_targets(EndpointAddress(endpoint), pub_port=pub_port, replay_port=None, dp_size=dp_size)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_payload_bytes": 0},
        {"reconnect_interval": 0.0},
        {"reconnect_interval": 6.0},
        {"replay_timeout": 0.0},
        {"replay_timeout": 40.0},
        {"receive_hwm": -1},
    ],
    ids=[
        "no-payload",
        "zero-reconnect",
        "reconnect-above-max",
        "zero-replay-timeout",
        "timeout-above-limit",
        "negative-hwm",
    ],
)
def test_invalid_options_are_rejected(kwargs: dict[str, Any]) -> None:
    """Options outside their range raise ValueError."""
    with pytest.raises(ValueError, match="must be"):
        SubscriberOptions(**kwargs)
