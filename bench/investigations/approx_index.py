"""The approximate prefix index on the event loop: what recording and matching a prompt's chunks cost.

Every request routed approximately (no tokenizer or no KV events for its model) looks its prompt's
chunks up and records them against the endpoint picked; a long prompt has the most, 512. Measured
in this process, on a full index (the default bound, 200,000 chunks), side by side:

- ``generations``: the index as shipped (``extproc.kvindex.approx``: two generations of plain dicts);
- ``ordered_lru``: the exact LRU it replaced (one ordered dict, reordered on every record and one
  eviction per new chunk), kept here as the reference.

Cases, per prompt of 512 chunks: recording new chunks (a one-off prompt), recording them again to
the same endpoint (a conversation's next turn) and to another one, and matching a prompt the index
holds whole. Best of 5 runs of 400 prompts each (this VM's speed drifts). Writes
``bench/results/approx_index.{json,md}``.

    python bench/investigations/approx_index.py
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the bench harness

from machine import machine, provenance, record

from extproc.kvindex.approx import ApproxPrefixIndex
from extproc.types import EndpointAddress

HERE = Path(__file__).resolve().parents[1]  # bench/: results/ and the harness are there
BOUND = 200_000
CHUNKS = 512
PROMPTS = 400
RUNS = 5
ENDPOINTS = [EndpointAddress(f"127.0.0.{i}:8000") for i in range(1, 9)]


class OrderedLru(ApproxPrefixIndex):
    """The exact-LRU index the generations replaced: one ordered dict, reordered on every record and
    trimmed by one eviction per new chunk (its record as it was; match is the shipped one, reading
    that dict: the old generation stays empty)."""

    def __init__(self, max_entries: int) -> None:
        super().__init__(max_entries=max_entries)
        self._holders: OrderedDict[int, frozenset[EndpointAddress]] = OrderedDict()
        self._young = self._holders

    def record(self, keys: Sequence[int], endpoint: EndpointAddress) -> None:
        holders = self._holders
        alone = self._share(frozenset((endpoint,)))
        for key in keys:
            current = holders.get(key)
            if current is None:
                holders[key] = alone
            else:
                if endpoint not in current:
                    holders[key] = self._share(current | alone)
                holders.move_to_end(key)
        while len(holders) > self.max_entries:
            holders.popitem(last=False)


def prompts(rng: random.Random, count: int) -> list[list[int]]:
    return [[rng.getrandbits(60) for _ in range(CHUNKS)] for _ in range(count)]


def per_prompt_ms(action: Callable[[list[int]], object], batch: list[list[int]]) -> float:
    started = time.perf_counter()
    for keys in batch:
        action(keys)
    return (time.perf_counter() - started) / len(batch) * 1e3


def one_run(index: ApproxPrefixIndex, rng: random.Random) -> dict[str, float]:
    for i, keys in enumerate(prompts(rng, 2 * BOUND // CHUNKS)):  # full, and turned over once
        index.record(keys, ENDPOINTS[i % len(ENDPOINTS)])
    batch = prompts(rng, PROMPTS)
    first, second = ENDPOINTS[0], ENDPOINTS[1]
    return {
        "record_new_ms": per_prompt_ms(lambda keys: index.record(keys, first), batch),
        "record_again_same_ms": per_prompt_ms(lambda keys: index.record(keys, first), batch),
        "record_again_other_ms": per_prompt_ms(lambda keys: index.record(keys, second), batch),
        "match_whole_ms": per_prompt_ms(lambda keys: index.match(keys, ENDPOINTS), batch),
    }


def measure(make: Callable[[], ApproxPrefixIndex]) -> dict[str, float]:
    best: dict[str, float] = {}
    for run in range(RUNS):
        for case, ms in one_run(make(), random.Random(run)).items():
            best[case] = min(best.get(case, ms), ms)
    return best


def report(results: dict[str, Any]) -> str:
    m = results["machine"]
    variants = results["variants"]
    names = list(variants)
    lines = [
        "# Approximate prefix index: recording and matching a 512-chunk prompt on the event loop",
        "",
        f"{provenance(m)}. One thread; a full index of {BOUND:,} chunks; best of {RUNS} runs of "
        f"{PROMPTS} prompts; ms per prompt.",
        "",
        "| case | " + " | ".join(names) + " | ratio |",
        "|---|" + "--:|" * (len(names) + 1),
    ]
    for case in variants[names[0]]:
        cells = [variants[n][case] for n in names]
        lines.append(
            f"| {case.removesuffix('_ms').replace('_', ' ')} | "
            + " | ".join(f"{c:.3f}" for c in cells)
            + f" | {cells[0] / cells[1]:.2f} |"
        )
    lines += ["", f"ratio: {names[0]} / {names[1]}.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "results" / "approx_index.json")
    args = parser.parse_args()
    results = {
        "machine": machine(),
        "variants": {
            "generations": measure(lambda: ApproxPrefixIndex(max_entries=BOUND)),
            "ordered_lru": measure(lambda: OrderedLru(BOUND)),
        },
    }
    record(args.out, results, report)


if __name__ == "__main__":
    main()
