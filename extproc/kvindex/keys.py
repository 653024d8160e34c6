"""Our own block keys: a chained hash over each full block of token ids, per key namespace.

We never trust or recompute engine hashes (DESIGN "Prefix index keys"): the index hashes the
``token_ids`` that events carry, and a request hashes its prompt's token ids, with this one
function, so both sides agree by construction.

    key[0] = H(seed, tokens[0:B]),   key[i] = H(key[i-1], tokens[i*B:(i+1)*B]),   H = 60-bit hash

``seed`` comes from the namespace: the base model's name, or the LoRA adapter's name for events and
requests that use one (``model`` in an OpenAI request names either, so the two share one space),
plus the request's ``cache_salt`` when it has one. Both engines make a salted prompt's blocks
unreachable from any other salt: vLLM puts the salt in the first block's extra keys (so every later
block's chained hash differs), SGLang seeds the whole page chain with it. A salted seed does the same
to our keys, so a salted request matches only blocks stored under its own salt, and an unsalted one
never matches salted blocks. An empty salt is no salt (SGLang reads ``""`` as none; vLLM refuses it).
A partial tail (fewer than B tokens) has no key: engines never cache it either.

H is CPython's tuple hash of ``(parent, tokens_tuple)`` folded to 60 bits. Measured per 16-token
block on the bench machine: ~0.37 µs, the same as SipHash over the block's bytes and 2.5x faster
than ``blake2b(digest_size=8)`` (bench/kvindex.py, "key function"). 60 bits, not 64, because a
Python int below 2**60 is a 32-byte object and one up to 2**64 is 48 bytes (pymalloc rounds 36 to
48), and the index stores one per block.

Keys are only meaningful inside one router process: the namespace seed mixes in CPython's
per-process string hash salt (``PYTHONHASHSEED``), so keys are neither stable across restarts nor
shared between router replicas (each replica builds its own index), and outsiders cannot predict
them. Never persist them or compute them in another process.

Collisions: for keys behaving like uniform 60-bit values, a lookup of L keys against an index of N
distinct keys has a false match with probability about L*N / 2**60: with L = 2048 (32k tokens) and
N = 10**7, about 2e-8 per request. A false match can only misroute a request (a pod is credited
with a prefix it lacks); it never affects what a request returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

#: Keys are folded to 60 bits (see the module docstring for why 60).
KEY_MASK: Final = (1 << 60) - 1
_SEED_SALT: Final = "extproc.kvindex.keys/v1"


def namespace_seed(model_or_lora: str, cache_salt: str | None = None) -> int:
    """The chain seed of a key namespace: a base model or LoRA adapter name, and a cache salt."""
    if not cache_salt:
        return hash((_SEED_SALT, model_or_lora)) & KEY_MASK
    return hash((_SEED_SALT, model_or_lora, cache_salt)) & KEY_MASK


def block_keys(token_ids: Sequence[int], block_size: int, seed: int, parent: int | None = None) -> list[int]:
    """Keys of the full blocks of ``token_ids``, chained from ``parent`` (or from ``seed`` at token 0).

    ``block_keys(a + b, B, s)`` equals ``ka + block_keys(b, B, s, parent=ka[-1])`` with
    ``ka = block_keys(a, B, s)`` whenever ``len(a)`` is a multiple of B: an event that continues a
    sequence chains from its parent block's key and lands on the keys a whole prompt would get.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    tokens = token_ids if type(token_ids) is tuple else tuple(token_ids)
    key = seed if parent is None else parent
    keys: list[int] = []
    append = keys.append
    for start in range(0, len(tokens) - block_size + 1, block_size):
        key = hash((key, tokens[start : start + block_size])) & KEY_MASK
        append(key)
    return keys
