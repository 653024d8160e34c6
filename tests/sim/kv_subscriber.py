"""An independent vLLM KV-event subscriber for tests: only ``msgpack`` and ``pyzmq``, no extproc.

It is the yardstick the simulator is checked against, so it reads the wire the way a third-party
consumer does (vllm-kv-events.md §1.2-§1.7) and shares no code with what it checks:

- messages are ``[topic, seq8, payload]``; a batch is ``[ts, events, dp_rank?]``;
- an event is a tagged array ``[tag, fields...]`` (vLLM <= 0.23) or a map with ``"type"`` (>= 0.24);
  unknown tags, keys and trailing elements are ignored;
- a hash is an int (uint64, or int64 taken mod 2**64) or bin (its last 8 bytes, big-endian).

    cache = ReconstructedCache()
    sub = KVSubscriber()
    sub.connect(pub.endpoint, topic="kv@")
    await sub.await_joined(lambda: pub.publish([probe_event], ts=0.0))  # beat the slow joiner
    cache.apply_batch((await sub.recv_batch()).payload)
    missed = await sub.replay(pub.replay_endpoint, start_seq=0)
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq
import zmq.asyncio

END_SEQ = b"\xff" * 8
_U64 = (1 << 64) - 1
#: Positional field names of the array form (vLLM 0.22 order); maps carry their own names.
_FIELDS = {
    "BlockStored": (
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
        "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}  # fmt: skip


def hash_to_int(value: int | bytes) -> int:
    """A wire hash as the uint64 vLLM's int mode would send (bin: last 8 bytes big-endian)."""
    if isinstance(value, bytes):
        return int.from_bytes(value[-8:], "big")
    return value & _U64


@dataclass(frozen=True)
class Batch:
    ts: float
    #: Every event as a dict with ``"type"`` and its named fields, whichever form it came in.
    events: list[dict[str, Any]]
    dp_rank: int | None


def decode_event(raw: Any) -> dict[str, Any]:
    if isinstance(raw, dict):
        return dict(raw)
    tag, *values = raw
    return {"type": tag, **dict(zip(_FIELDS.get(tag, ()), values, strict=False))}


def decode_batch(payload: bytes) -> Batch:
    raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    return Batch(raw[0], [decode_event(e) for e in raw[1]], raw[2] if len(raw) > 2 else None)


@dataclass(frozen=True)
class StoredBlock:
    token_ids: tuple[int, ...]
    parent: int | None
    block_size: int
    lora_name: str | None


#: Media vLLM uses for the GPU pool (nil before 0.10.2).
GPU_MEDIA = (None, "GPU")


class ReconstructedCache:
    """What a subscriber believes the engine caches: a multiset of hashes (vLLM may store one twice).

    ``blocks`` is the GPU tier; every other medium (offload tiers: "CPU", ...) has its own multiset
    in ``lower``. Offload stores may carry no tokens: their hashes are all they say.
    """

    def __init__(self) -> None:
        self.blocks: Counter[int] = Counter()
        self.info: dict[int, StoredBlock] = {}
        self.lower: dict[str, Counter[int]] = {}
        #: BlockRemoved for hashes not held (a gap, or a bug in the publisher).
        self.unknown_removals = 0

    def apply_batch(self, payload: bytes) -> Batch:
        batch = decode_batch(payload)
        for event in batch.events:
            self.apply_event(event)
        return batch

    def apply_event(self, event: dict[str, Any]) -> None:
        kind, medium = event["type"], event.get("medium")
        if kind in ("BlockStored", "BlockRemoved") and medium not in GPU_MEDIA:
            self._apply_lower(kind, medium, event["block_hashes"])
        elif kind == "BlockStored":
            size, tokens = event["block_size"], event["token_ids"]
            parent = event.get("parent_block_hash")
            parent = None if parent is None else hash_to_int(parent)
            for i, raw_hash in enumerate(event["block_hashes"]):
                h = hash_to_int(raw_hash)
                block_tokens = tuple(tokens[i * size : (i + 1) * size])
                self.blocks[h] += 1
                self.info[h] = StoredBlock(block_tokens, parent, size, event.get("lora_name"))
                parent = h
        elif kind == "BlockRemoved":
            for raw_hash in event["block_hashes"]:
                h = hash_to_int(raw_hash)
                if self.blocks[h] <= 0:
                    self.unknown_removals += 1
                    continue
                self.blocks[h] -= 1
                if not self.blocks[h]:
                    del self.blocks[h], self.info[h]
        elif kind == "AllBlocksCleared":  # every tier, as routers read it
            self.blocks.clear()
            self.info.clear()
            self.lower.clear()

    def _apply_lower(self, kind: str, medium: str, raw_hashes: list[Any]) -> None:
        tier = self.lower.setdefault(medium, Counter())
        for raw_hash in raw_hashes:
            h = hash_to_int(raw_hash)
            if kind == "BlockStored":
                tier[h] += 1
            elif tier[h] <= 0:
                self.unknown_removals += 1
            else:
                tier[h] -= 1
                if not tier[h]:
                    del tier[h]

    def tokens_of(self, block_hash: int) -> tuple[int, ...]:
        return self.info[block_hash].token_ids


@dataclass(frozen=True)
class Message:
    topic: bytes
    seq: int
    payload: bytes


class KVSubscriber:
    """A SUB socket (any number of endpoints) plus a DEALER per replay request."""

    def __init__(self, context: zmq.asyncio.Context | None = None) -> None:
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RECONNECT_IVL, 10)  # reconnect fast after a publisher restart
        #: Every seq received live, in arrival order.
        self.seqs: list[int] = []
        #: The raw frames of the last replay (identity already stripped by the DEALER).
        self.last_replay_frames: list[list[bytes]] = []

    def connect(self, endpoint: str, topic: str | bytes = b"") -> None:
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode() if isinstance(topic, str) else topic)
        self._sub.connect(endpoint)

    # Helpers take a default timeout so a missing message fails in seconds, not at pytest's limit.
    async def recv_batch(self, timeout: float = 2.0) -> Message:  # noqa: ASYNC109
        """The next live message; raises TimeoutError."""
        frames = await asyncio.wait_for(self._sub.recv_multipart(), timeout)
        assert len(frames) == 3 and len(frames[1]) == 8, f"bad message {frames!r}"
        message = Message(frames[0], int.from_bytes(frames[1], "big"), frames[2])
        self.seqs.append(message.seq)
        return message

    def missing_seqs(self) -> list[int]:
        """Seqs skipped between consecutive live messages (a drop in seq is a restart, not a gap)."""
        pairs = zip(self.seqs, self.seqs[1:], strict=False)
        return [s for a, b in pairs if b > a + 1 for s in range(a + 1, b)]

    async def await_joined(self, probe: Callable[[], int | None], timeout: float = 5.0) -> int:  # noqa: ASYNC109
        """Call ``probe`` (publishes a batch, returns its seq) until one arrives; returns the last seq.

        PUB drops everything sent before the SUB has joined (the slow joiner), so a test cannot
        assert on its first message before this. Every probe up to the returned seq is consumed.
        """
        deadline = asyncio.get_running_loop().time() + timeout
        last: int | None = None
        while True:
            seq = probe()
            last = seq if seq is not None else last
            try:
                message = await self.recv_batch(timeout=0.02)
                break
            except TimeoutError:
                if asyncio.get_running_loop().time() > deadline:
                    raise TimeoutError(f"no probe arrived within {timeout}s") from None
        while last is not None and message.seq != last:
            message = await self.recv_batch(timeout=timeout)
        return message.seq

    async def replay(
        self,
        replay_endpoint: str,
        start_seq: int,
        timeout: float = 2.0,  # noqa: ASYNC109
    ) -> list[tuple[int, bytes]]:
        """Ask for every buffered batch from ``start_seq`` on; accepts replies with or without topic."""
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(replay_endpoint)
        self.last_replay_frames = []
        batches: list[tuple[int, bytes]] = []
        try:
            async with asyncio.timeout(timeout):
                await dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
                while True:
                    frames = await dealer.recv_multipart()
                    self.last_replay_frames.append(frames)
                    assert len(frames) in (3, 4) and frames[0] == b"", f"bad replay frames {frames!r}"
                    seq, payload = frames[-2], frames[-1]
                    if seq == END_SEQ:
                        return batches
                    batches.append((int.from_bytes(seq, "big"), payload))
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        self._sub.close(linger=0)
