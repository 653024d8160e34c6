"""Our block keys: chained per full block, per namespace, the same for events and requests."""

from __future__ import annotations

import random

import pytest

from extproc.kvindex.keys import KEY_MASK, block_keys, namespace_seed

RNG = random.Random(11)
TOKENS = [RNG.randrange(128_000) for _ in range(16 * 9 + 5)]
SEED = namespace_seed("llama-3-8b")


def test_same_tokens_give_same_keys_whatever_the_sequence_type() -> None:
    """Lists, tuples and repeated calls agree: keys are a pure function of (tokens, size, seed)."""
    assert block_keys(TOKENS, 16, SEED) == block_keys(tuple(TOKENS), 16, SEED) == block_keys(TOKENS, 16, SEED)


@pytest.mark.parametrize(
    ("other_namespace"),
    ["llama-3-8b-sql-lora", "llama-3-8B", ""],
    ids=["lora", "case", "empty"],
)
def test_different_namespace_gives_different_keys(other_namespace: str) -> None:
    """Another model or LoRA adapter gets disjoint keys for the same tokens."""
    ours = block_keys(TOKENS, 16, SEED)
    theirs = block_keys(TOKENS, 16, namespace_seed(other_namespace))
    assert not set(ours) & set(theirs)


@pytest.mark.parametrize(
    ("length", "block_size", "expected"),
    [(0, 16, 0), (15, 16, 0), (16, 16, 1), (31, 16, 1), (149, 16, 9), (149, 64, 2), (5, 1, 5)],
    ids=["empty", "under-one-block", "one-block", "tail-ignored", "nine-and-tail", "coarse", "size-1"],
)
def test_only_full_blocks_get_keys(length: int, block_size: int, expected: int) -> None:
    """A partial tail has no key, and adding tokens to it does not change earlier keys."""
    keys = block_keys(TOKENS[:length], block_size, SEED)
    assert len(keys) == expected
    assert keys == block_keys(TOKENS, block_size, SEED)[:expected]


@pytest.mark.parametrize("split_blocks", [1, 3, 8], ids=["after-1", "after-3", "after-8"])
def test_chaining_from_a_parent_equals_the_whole_sequence(split_blocks: int) -> None:
    """Keys of a continuation chained from its parent's key equal the whole prompt's keys."""
    whole = block_keys(TOKENS, 16, SEED)
    head = block_keys(TOKENS[: 16 * split_blocks], 16, SEED)
    tail = block_keys(TOKENS[16 * split_blocks :], 16, SEED, parent=head[-1])
    assert head + tail == whole


def test_keys_depend_on_every_earlier_block() -> None:
    """Changing one token of block 0 changes every key after it (a prefix key, not a block key)."""
    changed = [TOKENS[0] + 1, *TOKENS[1:]]
    assert all(
        a != b for a, b in zip(block_keys(TOKENS, 16, SEED), block_keys(changed, 16, SEED), strict=True)
    )


def test_keys_fit_in_60_bits_and_seeds_are_stable_in_process() -> None:
    """Keys and seeds are non-negative 60-bit ints; a seed is the same on every call."""
    assert all(0 <= key <= KEY_MASK for key in block_keys(TOKENS, 16, SEED))
    assert namespace_seed("llama-3-8b") == SEED and 0 <= SEED <= KEY_MASK


@pytest.mark.parametrize("block_size", [0, -16], ids=["zero", "negative"])
def test_block_size_must_be_positive(block_size: int) -> None:
    """A block size below 1 is a programming error, not an empty key list."""
    with pytest.raises(ValueError, match="block_size"):
        block_keys(TOKENS, block_size, SEED)
