"""The Mooncake trace, pure: load a slice, expand hash ids to token ids, and its cache upper bound.

Kept free of I/O beyond reading the file so the numbers the benchmark compares against (the upper
bound) and the prompts it sends (the expansion) are unit-tested and identical in every run.

* Each ``hash_ids`` entry stands for one 512-token block of a prompt; equal leading runs are shared
  prefixes (the ids are chained prefix hashes remapped to integers). A block expands to 512 fixed
  pseudo-random token ids in ``[0, vocab_size)``, a function of the id alone, so the same id is the same
  tokens in every request and every run; the last block is truncated so a prompt is exactly
  ``input_length`` tokens.
* The upper bound is the prefix-cache hit rate of one unbounded cache that saw every earlier request
  of the slice (no eviction, no load limits): what no router over bounded engines can beat.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy

from bench.replay.rows import TRACE_BLOCK, trace_rows


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One trace row, with arrival in seconds since the first request of the slice."""

    index: int
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load(path: Path, *, requests: int | None = None, start: int = 0) -> list[TraceRequest]:
    """A contiguous slice of the trace (``requests`` rows from row ``start``), arrivals rebased to 0;
    a Mooncake ``.jsonl`` or an Azure ``.csv`` (see :mod:`bench.replay.rows`)."""
    rows: list[TraceRequest] = []
    for index, row in enumerate(trace_rows(path)):
        if index < start:
            continue
        if requests is not None and len(rows) >= requests:
            break
        rows.append(
            TraceRequest(
                index=index,
                arrival_s=row["timestamp"] / 1000.0,
                input_length=int(row["input_length"]),
                output_length=int(row["output_length"]),
                hash_ids=tuple(int(h) for h in row["hash_ids"]),
            )
        )
    if rows:
        t0 = rows[0].arrival_s
        rows = [
            TraceRequest(r.index, r.arrival_s - t0, r.input_length, r.output_length, r.hash_ids) for r in rows
        ]
    return rows


def block_tokens(hash_id: int, vocab_size: int, *, salt: int = 0) -> tuple[int, ...]:
    """The 512 token ids one hash id stands for: a pure function of (id, vocab, salt)."""
    tokens: list[int] = _tokens([hash_id], vocab_size, salt)[0].tolist()
    return tuple(tokens)


_GOLDEN = numpy.uint64(0x9E3779B97F4A7C15)
_MIX = (numpy.uint64(0xBF58476D1CE4E5B9), numpy.uint64(0x94D049BB133111EB))
_SALT = numpy.uint64(0xD1B54A32D192ED03)
_POSITIONS = numpy.arange(1, TRACE_BLOCK + 1, dtype=numpy.uint64) * _GOLDEN


def _finalise(z: numpy.ndarray) -> numpy.ndarray:
    """splitmix64's output function: every input bit reaches every output bit (in place)."""
    z ^= z >> numpy.uint64(30)
    z *= _MIX[0]
    z ^= z >> numpy.uint64(27)
    z *= _MIX[1]
    z ^= z >> numpy.uint64(31)
    return z


def _tokens(hash_ids: Sequence[int], vocab_size: int, salt: int) -> numpy.ndarray:
    """The ids' blocks of tokens, one row per id: splitmix64 of the (id, salt)-seeded stream at each
    position, modulo the vocabulary (the bias is < vocab / 2**64).

    All ids of a prompt in a handful of numpy operations, rather than a seeded generator per id:
    the full trace has 183k distinct ids, and drawing them one by one took ~12% of an offline run.
    """
    ids = numpy.asarray(hash_ids, dtype=numpy.int64).view(numpy.uint64)
    seeds = _finalise(ids ^ (numpy.uint64(salt) * _SALT))
    return _finalise(seeds[:, None] + _POSITIONS[None, :]) % numpy.uint64(vocab_size)


def prompt_tokens(request: TraceRequest, vocab_size: int, *, salt: int = 0) -> list[int]:
    """The request's prompt: its blocks' tokens in order, cut to ``input_length``.

    A trace row whose ids cover fewer tokens than ``input_length`` (not seen in the Mooncake traces,
    but cheap to guard) is padded with tokens of a block id unique to the row, so lengths always hold.
    """
    blocks = -(-request.input_length // TRACE_BLOCK)
    ids = list(request.hash_ids[:blocks])
    ids += [-1 - request.index] * (blocks - len(ids))
    tokens: list[int] = _tokens(ids, vocab_size, salt).ravel()[: request.input_length].tolist()
    return tokens


def block_lengths(request: TraceRequest) -> list[int]:
    """Tokens each hash id contributes to the prompt (512, except a shorter last block)."""
    lengths: list[int] = []
    left = request.input_length
    for _ in request.hash_ids:
        if left <= 0:
            break
        lengths.append(min(TRACE_BLOCK, left))
        left -= TRACE_BLOCK
    return lengths


@dataclass(frozen=True, slots=True)
class UpperBound:
    """Prompt tokens an unbounded cache would have served, two ways (see :func:`upper_bound`)."""

    prompt_tokens: int
    #: Token-exact: the longest previously seen prefix, at any token.
    hit_tokens: int
    #: As the simulated engines count it: whole ``engine_block`` blocks, at least one token recomputed.
    engine_hit_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def engine_hit_rate(self) -> float:
        return self.engine_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def upper_bound(requests: Iterable[TraceRequest], *, engine_block: int = 16) -> UpperBound:
    """The hit rate of one unbounded cache fed the requests in order.

    A request's cached prefix is its longest leading run already seen: block ``i`` hits when the chain
    ``hash_ids[: i + 1]`` was seen before, for as many of its tokens as the longest earlier request
    carried of that block (a partial last block seen as 300 tokens serves at most 300 tokens of a
    later full block, and a block seen only partially ends the run). ``engine_hit_tokens`` then applies
    what the engines do on top: whole ``engine_block``-token blocks only, and at least one prompt token
    recomputed (vLLM caps a hit at ``prompt - 1`` tokens, in whole blocks).
    """
    return pooled_lru(requests, capacity_tokens=sys.maxsize, engine_block=engine_block)


def pooled_lru(
    requests: Iterable[TraceRequest], *, capacity_tokens: int, engine_block: int = 16
) -> UpperBound:
    """The hit rate of ONE LRU cache holding the whole fleet's capacity, fed the requests in order.

    A reference for what capacity allows, not a strict bound: a router that never placed a block on
    two engines and whose engines pooled their memory would see about this (LRU is not optimal
    eviction). Counted like :func:`upper_bound`, with trace blocks (512 tokens) as the unit of
    eviction: a request's blocks are touched (hits) or inserted (misses), then the least recently
    used blocks are evicted until the cache fits ``capacity_tokens``.
    """
    cache: OrderedDict[int, int] = OrderedDict()  # chain id -> tokens held of that block
    chain_ids: dict[tuple[int, int], int] = {}
    used = total = hits = engine_hits = 0
    for request in requests:
        total += request.input_length
        matched = 0
        broken = False
        parent = -1
        for hash_id, length in zip(request.hash_ids, block_lengths(request), strict=False):
            chain = chain_ids.setdefault((parent, hash_id), len(chain_ids))
            held = cache.get(chain, 0)
            if not broken:
                got = min(held, length)
                matched += got
                broken = got < length
            if length > held:
                used += length - held
                cache[chain] = length
            cache.move_to_end(chain)
            parent = chain
        while used > capacity_tokens and cache:
            _, evicted = cache.popitem(last=False)
            used -= evicted
        hits += matched
        engine_hits += max(min(matched, request.input_length - 1), 0) // engine_block * engine_block
    return UpperBound(total, hits, engine_hits)


def summary(requests: Sequence[TraceRequest]) -> dict[str, float]:
    """Slice statistics for the report."""
    if not requests:
        return {"requests": 0}
    duration = requests[-1].arrival_s - requests[0].arrival_s
    return {
        "requests": len(requests),
        "first_row": requests[0].index,
        "duration_s": round(duration, 3),
        "mean_rps": round(len(requests) / duration, 3) if duration > 0 else 0.0,
        "mean_input_tokens": round(sum(r.input_length for r in requests) / len(requests), 1),
        "mean_output_tokens": round(sum(r.output_length for r in requests) / len(requests), 1),
        "max_input_tokens": max(r.input_length for r in requests),
    }


def spread_arrivals(requests: list[TraceRequest]) -> list[TraceRequest]:
    """The rows that share a timestamp spread evenly over the time to the next timestamp.

    Mooncake's timestamps come in 3-second steps with up to ~17 rows on one: replayed as written,
    they arrive at one instant. One router takes them one by one and sees each pick; several
    routers that share their leases over the network could not, whatever the sync's speed, so a
    comparison of one router against several would measure the trace's rounding. Spread, they
    arrive as they did within those seconds, as far as the trace can tell.
    """
    out: list[TraceRequest] = []
    i = 0
    while i < len(requests):
        j = i
        while j < len(requests) and requests[j].arrival_s == requests[i].arrival_s:
            j += 1
        t0 = requests[i].arrival_s
        gap = (requests[j].arrival_s - t0) if j < len(requests) else 0.0
        for k in range(i, j):
            r = requests[k]
            out.append(
                TraceRequest(
                    r.index, t0 + gap * (k - i) / (j - i), r.input_length, r.output_length, r.hash_ids
                )
            )
        i = j
    return out
