"""Incremental encoding: a prompt cut at its added tokens, each piece's ids remembered.

A Hugging Face tokenizer first splits its input at the added tokens (``<|eot_id|>``,
``<|im_start|>``...), then normalizes, pre-tokenizes and runs BPE on each piece between them on
its own. Encoding the pieces one by one and joining them with the added tokens' ids therefore gives
the very ids of the whole text, when the added tokens match literally: none strips whitespace
around it (``lstrip``/``rstrip``), matches whole words only, or is matched after normalization.
:func:`splitter_for` checks that, for each tokenizer, once; otherwise there is no splitter and the
whole text is encoded as before.

A chat template writes each message between added tokens, so a conversation's next turn repeats
every earlier piece: :class:`SegmentCache` keeps the pieces' ids, least recently used out past a
byte budget, and only the new pieces are encoded (together, in one ``encode_batch`` call, which
uses every core and releases the GIL). Safe from several threads.
"""

from __future__ import annotations

import re
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import tokenizers

#: Pieces shorter than this are encoded each time (cheaper than remembering them).
MIN_CACHED_CHARS = 32
#: What one cached piece costs besides its text and ids objects (its dict slot and order link).
_ENTRY_OVERHEAD = 150


@dataclass(frozen=True, slots=True)
class Splitter:
    """Cuts text at added tokens: ``pattern`` matches any of them, ``ids`` maps each to its id."""

    pattern: re.Pattern[str]
    ids: dict[str, int]

    def pieces(self, text: str) -> list[str | int]:
        """The text between added tokens (str, never empty) and the added tokens' ids (int), in order."""
        out: list[str | int] = []
        position = 0
        for match in self.pattern.finditer(text):
            if match.start() > position:
                out.append(text[position : match.start()])
            out.append(self.ids[match.group()])
            position = match.end()
        if position < len(text):
            out.append(text[position:])
        return out


def splitter_for(backend: tokenizers.Tokenizer) -> Splitter | None:
    """A splitter when cutting at added tokens provably gives the whole text's ids, else None."""
    added = backend.get_added_tokens_decoder()
    if not added:
        return None
    for token in added.values():
        if token.lstrip or token.rstrip or token.single_word or token.normalized:
            return None
    ids = {token.content: token_id for token_id, token in added.items()}
    # Longest first: at one position the longest added token wins, as the library's matcher does.
    alternatives = sorted(ids, key=len, reverse=True)
    return Splitter(re.compile("|".join(re.escape(a) for a in alternatives)), ids)


@dataclass(slots=True)
class CacheStats:
    """Lookups of pieces long enough to remember (shorter ones are simply encoded)."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0

    def add(self, other: CacheStats) -> None:
        """Count ``other``'s lookups too (several caches reported as one)."""
        self.hits += other.hits
        self.misses += other.misses
        self.evictions += other.evictions


class SegmentCache:
    """Piece text -> its ids, least recently used out past ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be at least 1, got {max_bytes}")
        self.max_bytes = max_bytes
        self.bytes = 0
        self.stats = CacheStats()
        self._entries: OrderedDict[str, array[int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def encode(
        self, splitter: Splitter, text: str, encode_batch: Callable[[list[str]], Sequence[Sequence[int]]]
    ) -> list[int]:
        """The ids of ``text`` (no special tokens added), encoding only pieces not remembered."""
        pieces = splitter.pieces(text)
        found: dict[str, array[int]] = {}
        missing: list[str] = []
        with self._lock:
            for piece in pieces:
                if isinstance(piece, int) or piece in found or piece in missing:
                    continue
                entry = self._entries.get(piece) if len(piece) >= MIN_CACHED_CHARS else None
                if entry is not None:
                    self._entries.move_to_end(piece)
                    found[piece] = entry
                    self.stats.hits += 1
                else:
                    missing.append(piece)
                    if len(piece) >= MIN_CACHED_CHARS:
                        self.stats.misses += 1
        if missing:
            for piece, ids in zip(missing, encode_batch(missing), strict=True):
                found[piece] = array("I", ids)
            self._remember({p: found[p] for p in missing if len(p) >= MIN_CACHED_CHARS})
        out: list[int] = []
        for piece in pieces:
            if isinstance(piece, int):
                out.append(piece)
            else:
                out.extend(found[piece])
        return out

    def _remember(self, new: dict[str, array[int]]) -> None:
        with self._lock:
            for piece, ids in new.items():
                if piece in self._entries:
                    continue
                cost = _cost(piece, ids)
                if cost > self.max_bytes:
                    continue
                self._entries[piece] = ids
                self.bytes += cost
            while self.bytes > self.max_bytes:
                piece, ids = self._entries.popitem(last=False)
                self.bytes -= _cost(piece, ids)
                self.stats.evictions += 1


def _cost(piece: str, ids: array[int]) -> int:
    return sys.getsizeof(piece) + sys.getsizeof(ids) + _ENTRY_OVERHEAD
