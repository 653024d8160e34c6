"""Everything prefix-aware routing runs in ``serve``: index, ingest, subscriptions, follower, matcher.

Built from :class:`~extproc.settings.PrefixSettings` (tokenizers load here, so a bad path fails
at startup); :meth:`start` follows the catalog store, :meth:`close` stops every subscription.
Metrics are computed at scrape time from the live objects (:class:`PrefixCollector`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from extproc.catalog.model import Catalog
from extproc.catalog.store import CatalogStore
from extproc.engines.parity import ParityChecker
from extproc.kvindex.approx import ApproxPrefixIndex
from extproc.kvindex.follow import KVEventsFollower
from extproc.kvindex.index import PrefixIndex, blocks_within
from extproc.kvindex.ingest import IndexIngest
from extproc.kvindex.subscriptions import KVSubscriptions
from extproc.scheduling.prefix import LOOP_HOLD_BUCKETS, LoopHold, PrefixMatcher
from extproc.settings import PrefixSettings
from extproc.tokenize.pool import TokenizePool
from extproc.tokenize.registry import TokenizerRegistry
from extproc.tokenize.segments import CacheStats
from extproc.tokenize.workers import ProcessWorkers, ThreadWorkers, WorkerSetup
from extproc.types import EndpointAddress


class PrefixRouting:
    """The prefix-cache side of ``serve``."""

    def __init__(
        self, settings: PrefixSettings, store: CatalogStore, *, rounds_in_thread: bool = True
    ) -> None:
        """``rounds_in_thread``: the KV index's settling rounds run beside the event loop
        (:mod:`extproc.kvindex.rounds`); off, they run inline (a caller that never yields to its
        loop, like the offline replay, would otherwise hold every event until a round's end)."""
        self.tokenizers = TokenizerRegistry.load(
            settings.tokenizers, hf_cache=settings.hf_cache, segment_cache_bytes=settings.tokenize_cache_bytes
        )
        self.index = PrefixIndex(
            max_entries=settings.index_max_blocks or blocks_within(settings.index_memory_mib * 2**20),
            max_entries_per_source=settings.index_max_blocks_per_endpoint,
            rounds_elsewhere=rounds_in_thread,
        )
        self.approx = ApproxPrefixIndex(max_entries=settings.approx_max_blocks)
        self.ingest = IndexIngest(self.index)
        self.subscriptions = KVSubscriptions(self.ingest)
        self.follower = KVEventsFollower(store, self.index, self.ingest, self.subscriptions)
        self.parity = ParityChecker(store, self.tokenizers)
        #: None without tokenizers, or with --tokenize-threads 0 (prompts tokenized on the loop).
        self.tokenize_pool = (
            TokenizePool(
                max_pending=settings.tokenize_queue,
                budget=settings.tokenize_budget,
                workers=_workers(settings),
            )
            if self.tokenizers.models() and settings.tokenize_threads != 0
            else None
        )
        self.matcher = PrefixMatcher(
            index=self.index,
            tokenizers=self.tokenizers,
            approx=self.approx,
            blocked=self.parity.blocked_models,
            pool=self.tokenize_pool,
        )

        self._endpoints: frozenset[EndpointAddress] = frozenset()
        self._unsubscribe = store.subscribe(self._forget_departed)

    def _forget_departed(self, catalog: Catalog) -> None:
        """Approximate affinity must not credit a pod that left (or a new pod reusing its address)."""
        endpoints = frozenset(e.address for ws in catalog.worker_sets.values() for e in ws.endpoints)
        if self._endpoints - endpoints:
            self.approx.forget(endpoints)
        self._endpoints = endpoints

    def endpoint_gone(self, address: EndpointAddress) -> None:
        """The engine at ``address`` stopped listening: what it cached must stop attracting traffic.

        Its KV-event sources are reset now (their blocks leave the index; a new incarnation is read
        from seq 0), and our approximate memory of what we sent it is dropped.
        """
        self.subscriptions.resync(address, "engine unreachable (connections to it are refused)")
        self.approx.forget(self._endpoints - {address})

    def start(self) -> None:
        self.follower.start()
        self.parity.start()
        if self.tokenize_pool is not None:
            self.tokenize_pool.workers.start()

    async def close(self) -> None:
        self._unsubscribe()
        await self.parity.close()
        await self.follower.close()
        self.ingest.close()
        if self.tokenize_pool is not None:
            self.tokenize_pool.close()

    def collector(self) -> Collector:
        return PrefixCollector(self)

    def debug_state(self) -> dict[str, Any]:
        """The ``prefix`` section of ``/debug/state``: tokenizers, parity, every KV source's state."""
        index_stats = self.index.stats().sources
        sources: dict[str, Any] = {}
        for source, sub in sorted(self.subscriptions.stats().items()):
            held = index_stats.get(source)
            plan = self.follower.plans.get(source)
            sources[str(source)] = {
                "publisher": plan.target.pub_address if plan else None,
                "replay": plan.target.replay_address if plan else None,
                "namespace": plan.namespace if plan else None,
                "blockSize": plan.block_size if plan else None,
                # Set when the engine's events came in blocks this size does not divide (skipped).
                "engineBlockSize": held.mismatched_block_size if held else None,
                "connected": sub.connected,
                "lastSeq": sub.last_seq,
                "complete": sub.complete,
                "reason": sub.reason,
                "gpuBlocks": held.gpu_blocks if held else 0,
                "lowerTierBlocks": held.lower_blocks if held else 0,
            }
        return {
            "tokenizers": self.tokenizers.models(),
            "tokenizerParity": self.parity.debug_state(),
            "sources": sources,
            "approximateBlocks": len(self.approx),
            "ingest": {
                "batches": self.ingest.counters.batches,
                "decodeErrors": self.ingest.counters.decode_errors,
                "resets": self.ingest.counters.resets,
            },
        }


def _hold_histogram(name: str, documentation: str, hold: LoopHold) -> HistogramMetricFamily:
    cumulative, buckets = 0, []
    for bound, count in zip((*LOOP_HOLD_BUCKETS, float("inf")), hold.counts, strict=True):
        cumulative += count
        buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
    return HistogramMetricFamily(name, documentation, buckets=buckets, sum_value=hold.total)


def _workers(settings: PrefixSettings) -> ThreadWorkers | ProcessWorkers:
    if settings.tokenize_processes:
        setup = WorkerSetup(settings.tokenizers, settings.hf_cache, settings.tokenize_cache_bytes)
        return ProcessWorkers(settings.tokenize_processes, setup)
    return ThreadWorkers(settings.tokenize_threads)


class PrefixCollector(Collector):
    """Prefix-routing metrics, read from the live objects at scrape time."""

    def __init__(self, routing: PrefixRouting) -> None:
        self._routing = routing

    def collect(self) -> Iterable[Metric]:
        r = self._routing
        yield from MatcherCollector(r.matcher).collect()
        pool = r.tokenize_pool
        if pool is not None:
            fallbacks = CounterMetricFamily(
                "extproc_tokenize_fallbacks",
                "Prompts routed without their tokens (approximately): queue_full (--tokenize-queue "
                "prompts already tokenizing or waiting), budget (not ready, or too big to be ready by the "
                "workers' measured speed, within --tokenize-budget-ms), "
                "worker_lost (its --tokenize-processes worker died; replaced on the next prompt).",
                labels=["reason"],
            )
            for reason, count in pool.fallbacks.items():
                fallbacks.add_metric([reason], count)
            if pool.in_processes:
                fallbacks.add_metric(["worker_lost"], pool.workers.lost)
            yield fallbacks
            yield GaugeMetricFamily(
                "extproc_tokenize_pending",
                "Prompts being tokenized or waiting for a worker, late ones (their request already "
                "routed without them) included.",
                value=pool.pending,
            )
            yield CounterMetricFamily(
                "extproc_tokenize_late_dropped",
                "Late prompts (their request already routed without them) dropped unrun to make room "
                "for new ones in --tokenize-queue; run, they would only have taught the segment tree.",
                value=pool.dropped,
            )
            yield CounterMetricFamily(
                "extproc_tokenize_late_skipped",
                "Late prompts not run because their opening (their body's first few kB) did not recur: "
                "no prompt seen before began the same way, so tokenizing them would teach the segment "
                "tree nothing a later prompt reuses (a conversation's next turn repeats its history).",
                value=pool.skipped,
            )
        lookups_cached = CounterMetricFamily(
            "extproc_tokenize_cache_lookups",
            "Prompt pieces (text between added tokens) looked up in a model's cache of their ids: a "
            "hit is a piece not encoded again (--tokenize-cache-mb).",
            labels=["model", "result"],
        )
        held = GaugeMetricFamily(
            "extproc_tokenize_cache_bytes", "Bytes a model's prompt-piece cache holds.", labels=["model"]
        )
        for model in r.tokenizers.models():
            entry = r.tokenizers.get(model)
            cache = None if entry is None else entry.tokenizer.segment_cache
            if cache is not None:
                stats, held_bytes = CacheStats(), cache.bytes
                stats.add(cache.stats)
                # With worker processes, long prompts' pieces are cached there.
                in_workers = None if pool is None else pool.workers.cache_totals(model)
                if in_workers is not None:
                    stats.add(in_workers[0])
                    held_bytes += in_workers[1]
                lookups_cached.add_metric([model, "hit"], stats.hits)
                lookups_cached.add_metric([model, "miss"], stats.misses)
                held.add_metric([model], held_bytes)
        yield lookups_cached
        yield held
        batches = CounterMetricFamily(
            "extproc_kv_event_batches", "KV-event batches received, by outcome.", labels=["outcome"]
        )
        batches.add_metric(["applied"], r.ingest.counters.batches)
        batches.add_metric(["decode_error"], r.ingest.counters.decode_errors)
        batches.add_metric(["unknown_source"], r.ingest.counters.unknown_source)
        yield batches
        parity = GaugeMetricFamily(
            "extproc_tokenizer_parity",
            "1 per (model, worker set) under its latest tokenizer-parity verdict: match, mismatch (routed "
            "approximately) or unknown (the engine could not be asked).",
            labels=["model", "worker_set", "verdict"],
        )
        for (model, ws), result in sorted(r.parity.results.items()):
            parity.add_metric([model, ws, result.verdict], 1)
        yield parity
        yield from self._index_metrics()
        yield from self._subscription_metrics()

    def _index_metrics(self) -> Iterable[Metric]:
        stats = self._routing.index.stats()
        blocks = GaugeMetricFamily(
            "extproc_kv_index_blocks",
            "Blocks the KV-event index holds, per endpoint.",
            labels=["endpoint", "dp_rank"],
        )
        mismatch = GaugeMetricFamily(
            "extproc_kv_block_size_mismatch",
            "1 per KV-event source whose engine stores blocks of a size the worker set's kvBlockSize "
            "does not divide: its events are skipped, so its cache never steers routing.",
            labels=["endpoint", "dp_rank", "kv_block_size", "engine_block_size"],
        )
        for source, held in stats.sources.items():
            blocks.add_metric([source.endpoint, str(source.dp_rank)], held.gpu_blocks + held.lower_blocks)
            if held.mismatched_block_size is not None:
                labels = [source.endpoint, str(source.dp_rank), str(held.block_size)]
                mismatch.add_metric([*labels, str(held.mismatched_block_size)], 1)
        yield blocks
        yield mismatch
        yield GaugeMetricFamily(
            "extproc_kv_index_max_blocks",
            "The KV-event index's bound in blocks, all endpoints (from --kv-index-memory-mib).",
            value=stats.max_entries,
        )
        yield CounterMetricFamily(
            "extproc_kv_index_settle_seconds",
            "Seconds the KV-event index spent settling recent blocks into its packed layer.",
            value=stats.totals.settle_seconds,
        )
        yield GaugeMetricFamily(
            "extproc_kv_index_settle_seconds_max",
            "The longest settling round of the KV-event index so far (recent blocks packed into "
            "arrays): ~40-60 ms per million blocks held; the event loop waits for rounds below a "
            "million blocks, larger ones run in a thread.",
            value=stats.settle_seconds_max,
        )
        rounds = CounterMetricFamily(
            "extproc_kv_index_settle_rounds",
            "Settling rounds of the KV-event index by where they ran: in a thread beside the event "
            "loop, or waited for by the loop because too many events queued meanwhile.",
            labels=["where"],
        )
        rounds.add_metric(["thread"], self._routing.ingest.rounds.in_thread)
        rounds.add_metric(["waited"], self._routing.ingest.rounds.waited)
        yield rounds
        yield GaugeMetricFamily(
            "extproc_kv_index_settled_bytes",
            "Bytes of the KV-event index's settled layer (flat arrays, most of its blocks).",
            value=stats.settled_bytes,
        )
        totals = stats.totals
        applied = CounterMetricFamily(
            "extproc_kv_index_events",
            "Blocks the index applied from KV events, by effect.",
            labels=["effect"],
        )
        for effect in (
            "stored",
            "removed",
            "unknown_removals",
            "unresolved",
            "mismatched",
            "invalid",
            "evicted",
        ):
            applied.add_metric([effect], getattr(totals, effect))
        yield applied

    def _subscription_metrics(self) -> Iterable[Metric]:
        stats = self._routing.subscriptions.stats()
        state = GaugeMetricFamily(
            "extproc_kv_sources",
            "KV-event sources by state: complete (in sync), incomplete (history lost), syncing, "
            "disconnected.",
            labels=["state"],
        )
        counts = {"complete": 0, "incomplete": 0, "syncing": 0, "disconnected": 0}
        for sub in stats.values():
            if not sub.connected:
                counts["disconnected"] += 1
            elif sub.complete is None:
                counts["syncing"] += 1
            else:
                counts["complete" if sub.complete else "incomplete"] += 1
        for name, count in counts.items():
            state.add_metric([name], count)
        yield state
        replays = CounterMetricFamily(
            "extproc_kv_replays", "Replay requests, by outcome.", labels=["outcome"]
        )
        for outcome in ("ok", "partial", "failed"):
            replays.add_metric(
                [outcome], sum(getattr(s.counters, f"replays_{outcome}") for s in stats.values())
            )
        yield replays
        malformed = CounterMetricFamily(
            "extproc_kv_messages_rejected",
            "KV-event messages skipped: malformed frames or oversized.",
            labels=["reason"],
        )
        malformed.add_metric(["malformed"], sum(s.counters.malformed for s in stats.values()))
        malformed.add_metric(["oversized"], sum(s.counters.oversized for s in stats.values()))
        yield malformed


class MatcherCollector(Collector):
    """The prefix matcher's metrics: lookups by mode, tokenizing's holds on the loop, tokenize errors."""

    def __init__(self, matcher: PrefixMatcher) -> None:
        self._matcher = matcher

    def collect(self) -> Iterable[Metric]:
        lookups = CounterMetricFamily(
            "extproc_prefix_lookups",
            "Requests by how their prompt was matched against caches: precise (tokenized, KV events), "
            "approximate (our own routing history), none.",
            labels=["mode"],
        )
        for mode, count in self._matcher.counters.lookups.items():
            lookups.add_metric([mode], count)
        yield lookups
        counters = self._matcher.counters
        yield _hold_histogram(
            "extproc_tokenize_loop_seconds",
            "How long each prompt's tokenization held the event loop (rendering, finding its "
            "known prefix, encoding a short new part; with --tokenize-threads 0, all of it; the "
            "rest runs in the pool). Every decision in flight waits that long.",
            counters.loop_hold,
        )
        yield _hold_histogram(
            "extproc_tokenize_loop_cpu_seconds",
            "The same holds in the loop thread's CPU time. Wall time above it is the thread "
            "waiting: for a core, for the GIL, or (with --tokenize-threads 0) for the tokenizer "
            "library's own threads.",
            counters.loop_hold_cpu,
        )
        yield CounterMetricFamily(
            "extproc_prefix_tokenize_errors",
            "Prompts the model's tokenizer or chat template could not process (routed approximately).",
            value=self._matcher.counters.tokenize_errors,
        )
