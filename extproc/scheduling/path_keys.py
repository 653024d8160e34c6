"""Block keys of a prompt that walked the segment tree: only its new segments' blocks are hashed.

The keys of a prompt's blocks chain from its first token (:mod:`extproc.kvindex.keys`), so the keys
up to the end of a segment depend on that segment's whole prefix: exactly what a segment of the
tree (:mod:`extproc.tokenize.segments`) stands for. Each segment therefore remembers, per key
namespace and block size, the keys of the blocks that end inside it, the key of the last full block
and the tokens left over after it. A conversation's next turn finds all of that on its known
segments and hashes only the tokens its new segments add.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

from extproc.kvindex.keys import block_keys
from extproc.tokenize.segments import SegmentPath, segment_ids

#: What a segment remembers per (seed, block size): the keys of the blocks that end in it, the key
#: of the prefix's last full block (the seed when none) and the prefix's tokens after that block.
#: Keys and tokens as the bytes of arrays: untracked by the garbage collector, and a token as 4
#: bytes instead of a 28-byte int object.
_State = tuple[bytes, int, bytes]
#: One (seed, block size) tuple per pair, shared by every segment that remembers keys under it.
_MEMOS: dict[tuple[int, int], tuple[int, int]] = {}
_MAX_MEMOS = 1024


def path_block_keys(path: SegmentPath, block_size: int, seed: int) -> array[int]:
    """The block keys of ``path``'s ids: ``block_keys(path.ids(), block_size, seed)``, remembered."""
    memo = _memo(seed, block_size)
    parts: list[bytes] = []
    last: int = seed
    tail = b""
    derived = path.cache.derived
    for segment in path.segments:  # hot: one step per segment of every prompt
        state: _State | None = derived(segment, memo)  # type: ignore[assignment]
        if state is None:
            state = _extend(last, tail, segment_ids(segment), block_size, seed)
            path.cache.remember(segment, memo, state, sys.getsizeof(state[0]) + sys.getsizeof(state[2]))
        parts.append(state[0])
        last, tail = state[1], state[2]
    keys: array[int] = array("q")
    keys.frombytes(b"".join(parts))
    return keys


def _memo(seed: int, block_size: int) -> tuple[int, int]:
    pair = (seed, block_size)
    memo = _MEMOS.get(pair)
    if memo is None:
        if len(_MEMOS) >= _MAX_MEMOS:  # one per cache_salt in use: bounded whatever clients send
            _MEMOS.clear()
        memo = _MEMOS[pair] = pair
    return memo


def _extend(last: int, tail: bytes, ids: Sequence[int], block_size: int, seed: int) -> _State:
    tokens = tuple(memoryview(tail).cast("I")) + tuple(ids)
    full = len(tokens) - len(tokens) % block_size
    if not full:
        return b"", last, array("I", tokens).tobytes()
    added = block_keys(tokens[:full], block_size, seed, parent=last)
    return array("q", added).tobytes(), added[-1], array("I", tokens[full:]).tobytes()
