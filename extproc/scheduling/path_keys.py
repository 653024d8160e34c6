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

#: What a segment remembers per (seed, block size): the keys of the blocks that end in it (the
#: bytes of an ``array('q')``: untracked by the garbage collector), the key of the prefix's last
#: full block (the seed when none) and the prefix's tokens after that block.
_State = tuple[bytes, int, tuple[int, ...]]


def path_block_keys(path: SegmentPath, block_size: int, seed: int) -> array[int]:
    """The block keys of ``path``'s ids: ``block_keys(path.ids(), block_size, seed)``, remembered."""
    memo = (seed, block_size)
    parts: list[bytes] = []
    last: int = seed
    tail: tuple[int, ...] = ()
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


def _extend(last: int, tail: tuple[int, ...], ids: Sequence[int], block_size: int, seed: int) -> _State:
    tokens = tail + tuple(ids)
    full = len(tokens) - len(tokens) % block_size
    if not full:
        return b"", last, tokens
    added = block_keys(tokens[:full], block_size, seed, parent=last)
    return array("q", added).tobytes(), added[-1], tokens[full:]
