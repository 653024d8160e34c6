"""The simulator's KV events as the router's decoder returns them, for the offline replay (no wire)."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

from extproc.kvindex.events import U64_MASK, AllBlocksCleared, BlockRemoved, BlockStored, DecodedBatch
from extproc.kvindex.events import KVEvent as RouterEvent
from extproc.sim import kv_events as sim


def _engine_hashes(digests: Sequence[bytes]) -> tuple[int, ...]:
    """Each digest's last 8 bytes read big-endian, as the wire's uint64s carry them.

    Digests of one size that is a multiple of 8 (the simulator's: 32 bytes, 16 with xxhash) are
    read in one array pass: ~6% of an offline run went to ``int.from_bytes`` one hash at a time.
    """
    sizes = set(map(len, digests))
    size = sizes.pop() if len(sizes) == 1 else 0
    if not size or size % 8:
        return tuple(int.from_bytes(h, "big") & U64_MASK for h in digests)
    words = array("Q")
    words.frombytes(b"".join(digests))
    if sys.byteorder == "little":
        words.byteswap()
    return tuple(words[size // 8 - 1 :: size // 8].tolist())


def router_batch(events: list[sim.KVEvent], ts: float) -> DecodedBatch:
    """A step's events as the router's decoder returns them from vLLM's wire form, without the wire.

    What :func:`~extproc.sim.kv_wire.encode_batch` (tagged maps, uint64 hashes) and then
    :func:`~extproc.kvindex.decode.decode_batch` make of them: a digest becomes its last 8 bytes
    read big-endian, a chain's salt rides on its first event only, and a malformed stored event is
    skipped. One liberty: consecutive removals from one medium become one event (the engine makes
    one per evicted block), which the index applies in the same order, hash by hash. The replay's
    tests hold both paths to the same index.
    """
    out: list[RouterEvent] = []
    skipped = 0
    removed: list[bytes] = []  # digests, read in one pass when the run of removals ends
    removed_medium: str | None = None
    from_bytes = int.from_bytes
    for event in events:
        if type(event) is sim.BlockRemoved:
            if removed and event.medium != removed_medium:
                out.append(BlockRemoved(_engine_hashes(removed), removed_medium))
                removed = []
            removed_medium = event.medium
            removed += event.block_hashes
            continue
        if removed:
            out.append(BlockRemoved(_engine_hashes(removed), removed_medium))
            removed = []
        if type(event) is sim.BlockStored:
            hashes = _engine_hashes(event.block_hashes)
            tokens = event.token_ids
            if not hashes or (tokens and len(tokens) != len(hashes) * event.block_size):
                skipped += 1
                continue
            parent = event.parent_block_hash
            out.append(
                BlockStored(
                    hashes,
                    None if parent is None else from_bytes(parent, "big") & U64_MASK,
                    tokens,
                    event.block_size,
                    event.lora_name,
                    event.medium,
                    (event.cache_salt or None) if parent is None else None,
                )
            )
        else:
            out.append(AllBlocksCleared())
    if removed:
        out.append(BlockRemoved(_engine_hashes(removed), removed_medium))
    return DecodedBatch(ts=ts, events=out, dp_rank=0, skipped=skipped)
