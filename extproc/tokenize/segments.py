"""Incremental encoding: a prompt cut at its added tokens, each prefix's ids remembered in a tree.

A Hugging Face tokenizer first splits its input at the added tokens (``<|eot_id|>``,
``<|im_start|>``...), then normalizes, pre-tokenizes and runs BPE on each piece between them on
its own. Encoding the pieces one by one and joining them with the added tokens' ids therefore gives
the very ids of the whole text, when the added tokens match literally: none strips whitespace
around it (``lstrip``/``rstrip``), matches whole words only, or is matched after normalization.
:func:`splitter_for` checks that, for each tokenizer, once; otherwise there is no splitter and the
whole text is encoded as before.

Here a prompt is cut into *segments*: some text, then the run of added tokens that ends it. A chat
template writes each message between added tokens, so a conversation's next turn repeats every
earlier segment, in the same order. :class:`SegmentCache` keeps them as a tree (a segment is known
under the segments before it), so a prompt's known prefix is found segment by segment, only the
new segments are encoded (together, in one ``encode_batch`` call, which releases the GIL), and what
is derived from a prefix's ids (its block keys) can be remembered with its last segment
(:meth:`SegmentCache.remember`). Least recently used segments go out past a byte budget. Safe from
several threads.

Encoding runs in two steps, so the new segments can be encoded elsewhere (a worker thread) while
the walk and the bookkeeping stay cheap: :meth:`SegmentCache.plan` finds the known prefix and what
is missing, :meth:`EncodePlan.finish` adds the new segments once encoded.
"""

from __future__ import annotations

import re
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import count
from typing import Any, Final, overload

import tokenizers

#: Segments shorter than this join the next one: a chat template's role names ("user") would
#: otherwise be segments of their own, and every segment costs a step of the walk.
MIN_SEGMENT_CHARS = 32
#: What one remembered segment costs besides its text and ids: its tuple, key, ints and order link
#: (measured with tracemalloc, 10,000 segments: 380 bytes; the budget is then the real memory).
_ENTRY_OVERHEAD = 380
#: What one derived value costs besides the sizes its producer reports (its tuples, dict slot and
#: ints; measured the same way).
_DERIVED_OVERHEAD = 270

EncodeBatch = Callable[[list[str]], Sequence[Sequence[int]]]


@dataclass(frozen=True, slots=True)
class Splitter:
    """Cuts text at added tokens: ``capture`` matches any of them as a group (for ``re.split``),
    ``ids`` maps each to its id."""

    capture: re.Pattern[str]
    ids: dict[str, int]

    def segments(self, text: str) -> list[str]:
        """``text`` cut after runs of added tokens, each part holding at least MIN_SEGMENT_CHARS
        (but the last): joined, the text."""
        parts = self.capture.split(text)  # text, token, text, token, ..., text (in C: no loop here)
        out: list[str] = []
        current = ""
        for i in range(0, len(parts) - 1, 2):
            piece = parts[i]
            if piece and len(current) >= MIN_SEGMENT_CHARS:
                out.append(current)
                current = piece + parts[i + 1]
            else:
                current += piece + parts[i + 1]
        if parts[-1] and len(current) >= MIN_SEGMENT_CHARS:
            out.append(current)
            current = ""
        current += parts[-1]
        if current:
            out.append(current)
        return out

    def pieces(self, text: str) -> list[str | int]:
        """The text between added tokens (str, never empty) and the added tokens' ids (int), in order."""
        out: list[str | int] = []
        for i, part in enumerate(self.capture.split(text)):
            if i % 2:
                out.append(self.ids[part])
            elif part:
                out.append(part)
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
    return Splitter(re.compile(f"({trie_pattern(ids)})"), ids)


def trie_pattern(words: Iterable[str]) -> str:
    """A regex matching any of ``words``, the longest one where several match at one position (as
    the library's matcher does), written as their trie.

    A flat alternation ``a|b|...`` tries every word in turn at each candidate position: with Llama
    3's 256 ``<|reserved_special_token_N|>`` that made cutting a 200-message prompt cost 0.4 ms, the
    trie 20 times less.
    """
    trie: dict[str, Any] = {}
    for word in words:
        node = trie
        for char in word:
            node = node.setdefault(char, {})
        node[""] = {}  # a word ends here

    def emit(node: dict[str, Any]) -> str:
        branches = [re.escape(char) + emit(child) for char, child in sorted(node.items()) if char]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        # Where a word ends and longer ones go on, the optional part is greedy: longest first.
        return f"(?:{body})?" if "" in node else body

    return emit(trie)


@dataclass(slots=True)
class CacheStats:
    """Segments looked up: a hit is one found under the same prefix, not encoded again."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0

    def add(self, other: CacheStats) -> None:
        """Count ``other``'s lookups too (several caches reported as one)."""
        self.hits += other.hits
        self.misses += other.misses
        self.evictions += other.evictions


#: One remembered segment under its prefix: (serial, its prefix's serial, its text, its ids as the
#: bytes of an ``array('I')``, the prompt's length in tokens up to its end). A plain tuple, not a
#: class: every full collection of the cyclic garbage collector walks each tracked object and stops
#: the whole process meanwhile, and it stops tracking a tuple holding only ints, str and bytes (a
#: tree of 17,000 segments as objects made those pauses 15 ms).
Segment = tuple[int, int, str, bytes, int]
SERIAL: Final = 0
PARENT: Final = 1
TEXT: Final = 2
IDS: Final = 3
END: Final = 4


def segment_ids(segment: Segment) -> memoryview:
    """A segment's ids as a sequence of ints (a view of its bytes, nothing copied)."""
    return memoryview(segment[IDS]).cast("I")


#: The serial of the empty prefix, the tree's root.
ROOT = 0


class SegmentPath(Sequence[int]):
    """A prompt as the segments of the tree it walks, in order; as a sequence, the prompt's ids
    (their length known without joining them; joined on first use)."""

    __slots__ = ("_ids", "cache", "segments")

    def __init__(self, cache: SegmentCache, segments: tuple[Segment, ...]) -> None:
        self.cache = cache
        self.segments = segments
        self._ids: array[int] | None = None

    def ids(self) -> array[int]:
        """The prompt's ids, joined once."""
        if self._ids is None:
            out: array[int] = array("I")
            for segment in self.segments:
                out.frombytes(segment[IDS])
            self._ids = out
        return self._ids

    def __len__(self) -> int:
        return self.segments[-1][END] if self.segments else 0

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[int]: ...
    def __getitem__(self, index: int | slice) -> int | Sequence[int]:
        return self.ids()[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids())


@dataclass(slots=True)
class EncodePlan:
    """A prompt's known prefix in the tree, and the segments after it still to encode."""

    cache: SegmentCache
    #: Encodes a list of texts: with every core (from a worker), or in the calling thread.
    encode_batch: EncodeBatch
    encode_here: EncodeBatch
    known: list[Segment]
    new: list[str]
    #: The new segments' pieces: text (to encode) and added tokens' ids.
    pieces: list[list[str | int]]
    #: The new segments' text pieces, in order: what :meth:`encode` encodes.
    texts: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self.texts = [p for pieces in self.pieces for p in pieces if isinstance(p, str)]

    @property
    def new_chars(self) -> int:
        """Characters left to encode: what the encoding step costs, roughly."""
        return sum(len(t) for t in self.texts)

    def encode(self, *, here: bool = False) -> list[Sequence[int]]:
        """The ids of :attr:`texts` (the costly step: may run in another thread).

        ``here``: in the calling thread only. For a few short texts on the event loop: handing
        them to the library's thread pool and waiting for it costs more than encoding them, and the
        wait blocks the loop while the machine's cores are busy elsewhere.
        """
        texts = self.texts
        if not texts:
            return []
        return list((self.encode_here if here else self.encode_batch)(texts))

    def finish(self, encoded: Sequence[Sequence[int]]) -> SegmentPath:
        """The whole prompt's path, the new segments (``encoded``: :meth:`encode`'s) remembered."""
        return self.cache.grow(self, encoded)


class SegmentCache:
    """A tree of segments under their prefixes, least recently used out past ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be at least 1, got {max_bytes}")
        self.max_bytes = max_bytes
        self.bytes = 0
        self.stats = CacheStats()
        #: (serial of the segment before, or ROOT; segment text) -> the segment.
        self._entries: OrderedDict[tuple[int, str], Segment] = OrderedDict()
        #: serial -> the bytes its derived values cost, and (key, value) pairs (:meth:`remember`).
        self._derived: dict[int, tuple[int, tuple[tuple[Hashable, object], ...]]] = {}
        self._serials = count(ROOT + 1)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def plan(
        self, splitter: Splitter, text: str, encode_batch: EncodeBatch, encode_here: EncodeBatch | None = None
    ) -> EncodePlan:
        """``text``'s longest known prefix of segments, and what is left to encode after it."""
        segments = splitter.segments(text)
        known: list[Segment] = []
        parent = ROOT
        entries = self._entries
        with self._lock:
            for segment in segments:
                key = (parent, segment)
                node = entries.get(key)
                if node is None:
                    break
                entries.move_to_end(key)
                known.append(node)
                parent = node[SERIAL]
            self.stats.hits += len(known)
            self.stats.misses += len(segments) - len(known)
        new = segments[len(known) :]
        pieces = [splitter.pieces(s) for s in new]
        return EncodePlan(self, encode_batch, encode_here or encode_batch, known, new, pieces)

    def encode(self, splitter: Splitter, text: str, encode_batch: EncodeBatch) -> list[int]:
        """The ids of ``text`` (no special tokens added), encoding only segments not remembered."""
        plan = self.plan(splitter, text, encode_batch)
        return self.grow(plan, plan.encode()).ids().tolist()

    def grow(self, plan: EncodePlan, encoded: Sequence[Sequence[int]]) -> SegmentPath:
        """Remember ``plan``'s new segments after its known prefix; ``encoded``: the ids of its
        text pieces (:meth:`EncodePlan.encode`)."""
        texts = iter(encoded)
        new_ids: list[array[int]] = []
        for pieces in plan.pieces:
            ids: array[int] = array("I")
            for piece in pieces:
                if isinstance(piece, int):
                    ids.append(piece)
                else:
                    ids.extend(next(texts))
            new_ids.append(ids)
        if next(texts, None) is not None:
            raise ValueError("more encoded texts than the plan's text pieces")
        path = list(plan.known)
        parent = path[-1][SERIAL] if path else ROOT
        with self._lock:
            for text, ids in zip(plan.new, new_ids, strict=True):
                key = (parent, text)
                node = self._entries.get(key)  # another request may have added it meanwhile
                if node is None:
                    end = (path[-1][END] if path else 0) + len(ids)
                    node = (next(self._serials), parent, text, ids.tobytes(), end)
                    cost = _cost(node)
                    if cost <= self.max_bytes:
                        self._entries[key] = node
                        self.bytes += cost
                path.append(node)
                parent = node[SERIAL]
            self._evict()
        return SegmentPath(self, tuple(path))

    def derived(self, segment: Segment, key: Hashable) -> object | None:
        """What :meth:`remember` kept for ``segment`` under ``key``, if anything."""
        kept = self._derived.get(segment[SERIAL])
        if kept is not None:
            for known, value in kept[1]:  # usually one: a set's seed and block size
                if known == key:
                    return value
        return None

    def remember(self, segment: Segment, key: Hashable, value: object, nbytes: int) -> None:
        """Keep ``value``, derived from the prefix ending at ``segment``, under ``key`` while the
        segment is remembered; ``nbytes`` (what it holds) counts against the budget. Nothing is
        kept for a segment no longer (or never) remembered."""
        serial = segment[SERIAL]
        with self._lock:
            if self._entries.get((segment[PARENT], segment[TEXT])) is not segment:
                return
            cost, kept = self._derived.get(serial, (0, ()))
            if any(known == key for known, _ in kept):
                return
            added = nbytes + _DERIVED_OVERHEAD
            self._derived[serial] = (cost + added, (*kept, (key, value)))
            self.bytes += added
            self._evict()

    def _evict(self) -> None:
        while self.bytes > self.max_bytes and self._entries:
            _key, node = self._entries.popitem(last=False)
            self.bytes -= _cost(node)
            self.bytes -= self._derived.pop(node[SERIAL], (0, ()))[0]
            self.stats.evictions += 1


def _cost(segment: Segment) -> int:
    return sys.getsizeof(segment[TEXT]) + sys.getsizeof(segment[IDS]) + _ENTRY_OVERHEAD
