"""What the prefix index reports: per-batch apply counts and its state for metrics and /debug."""

from __future__ import annotations

from dataclasses import dataclass, field

from extproc.kvindex.events import Source


@dataclass(slots=True)
class ApplyResult:
    """Counts from applying one batch (and, summed, from every batch: :attr:`IndexStats.totals`).

    "Blocks" are the index's own blocks (``kvBlockSize`` tokens): an engine block re-chunked k ways
    counts k.
    """

    #: Blocks that became held (new engine hashes).
    stored: int = 0
    #: Engine hashes stored again while already held: another physical copy, ref-counted.
    duplicates: int = 0
    #: Blocks released because their last copy was removed.
    removed: int = 0
    #: Removals that only dropped one of several copies (the block stays held).
    removed_copies: int = 0
    #: BlockRemoved for hashes this source does not hold (missed history, or already evicted by us).
    unknown_removals: int = 0
    #: Engine blocks skipped because their parent (or, without tokens, their own hash) is unknown.
    unresolved: int = 0
    #: Engine blocks skipped because their block size is not a multiple of the source's.
    mismatched: int = 0
    #: Engine blocks skipped as inconsistent (no hashes, tokens not ``blocks * block_size``).
    invalid: int = 0
    #: AllBlocksCleared events applied.
    cleared: int = 0
    #: Blocks dropped to respect the memory bounds.
    evicted: int = 0
    #: Events the decoder left out of the batch (malformed or unknown type).
    skipped: int = 0
    #: Events the decoder left out as belonging to a secondary KV-cache group (hybrid models).
    ignored: int = 0
    #: Seconds spent settling recent blocks into the packed layer after this batch (0: no round).
    settle_seconds: float = 0.0

    def add(self, other: ApplyResult) -> None:
        """Add ``other``'s counts to these."""
        # Spelled out: this runs once per batch, and a loop over fields() costs ~2 µs.
        self.stored += other.stored
        self.duplicates += other.duplicates
        self.removed += other.removed
        self.removed_copies += other.removed_copies
        self.unknown_removals += other.unknown_removals
        self.unresolved += other.unresolved
        self.mismatched += other.mismatched
        self.invalid += other.invalid
        self.cleared += other.cleared
        self.evicted += other.evicted
        self.skipped += other.skipped
        self.ignored += other.ignored
        self.settle_seconds += other.settle_seconds


@dataclass(frozen=True, slots=True)
class SourceStats:
    """One source's share of the index."""

    namespace: str
    #: The worker set's ``kvBlockSize``: tokens per index block.
    block_size: int
    #: Index blocks held on the GPU tier and on lower tiers (CPU, storage, ...).
    gpu_blocks: int
    lower_blocks: int
    #: Engine hashes tracked (an engine block re-chunked k ways is one hash, k blocks).
    engine_hashes: int
    #: False once the subscriber reported history it could not replay.
    complete: bool
    #: The last event block size that was not a multiple of ``block_size`` (a misconfiguration).
    mismatched_block_size: int | None


@dataclass(frozen=True, slots=True)
class IndexStats:
    """The whole index: sizes, bounds, cumulative counts, per source."""

    #: Keys with at least one holder on the GPU tier / on lower tiers (a key held in both layers,
    #: recent and settled, counts twice until the next settling).
    gpu_keys: int
    lower_keys: int
    #: Index blocks held, all sources and tiers: what ``max_entries`` bounds.
    blocks: int
    max_entries: int
    max_entries_per_source: int
    totals: ApplyResult
    sources: dict[Source, SourceStats] = field(default_factory=dict)
    #: Blocks in the settled layer (flat arrays), and the bytes of those arrays.
    settled_blocks: int = 0
    settled_bytes: int = 0
    #: Settling rounds so far, and the longest one (seconds the event loop was busy with it).
    settle_rounds: int = 0
    settle_seconds_max: float = 0.0
