"""Several routers in the offline replay (``--routers N``): each its own index, leases and state.

Each router is what one ``serve`` replica holds: a prefix index fed with every engine's KV events
(every replica follows every engine), its own approximate-affinity memory, its own load view and
scheduler. Requests are spread round robin across them. With peer sync (``sync_delay_s`` not
None), a lease taken or released by one router reaches the others' load views that many model
seconds later, as :mod:`extproc.control.peers` deltas would; without it, each counts only its own.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.machine import provenance
from bench.replay.arms import Arm, Config
from extproc.catalog.store import CatalogStore
from extproc.control.load import LoadView
from extproc.control.requests import RequestControl
from extproc.kvindex.events import Source
from extproc.kvindex.follow import plan_sources
from extproc.scheduling.calibration import Calibration
from extproc.scheduling.engine_signals import EngineSignals
from extproc.scheduling.hooks import calibrate, remember_affinity
from extproc.scheduling.scheduler import DecisionHook, Scheduler
from extproc.serve.prefix_routing import PrefixRouting
from extproc.settings import PrefixSettings
from extproc.types import EndpointAddress


@dataclass(slots=True)
class Router:
    """One replica's decision path."""

    routing: PrefixRouting
    load: LoadView
    scheduler: Scheduler
    control: RequestControl
    sources: dict[str, Source]


def build_router(
    index: int,
    arm: Arm,
    cfg: Config,
    store: CatalogStore,
    settings: PrefixSettings,
    clock: Callable[[], float],
    calibration: Calibration | None,
) -> Router:
    """Router ``index``: the catalog in ``store``, every source planned and complete."""
    routing = PrefixRouting(settings, store, rounds_in_thread=False)  # virtual time: nothing runs beside
    sources: dict[str, Source] = {}
    for source, plan in plan_sources(store.current).items():
        routing.index.add_source(source, namespace=plan.namespace, block_size=plan.block_size)
        routing.index.set_complete(source, True)
        sources[source.endpoint] = source
    hooks: list[DecisionHook] = [remember_affinity(routing.matcher)]
    if calibration is not None and index == 0:  # one fit, as one replica's would be
        hooks.append(calibrate(calibration))
    load = LoadView(clock=clock)
    scheduler = replica_scheduler(index, arm, cfg, load, routing, hooks)
    control = RequestControl(catalog=lambda: store.current, scheduler=scheduler, load=load, clock=clock)
    return Router(routing, load, scheduler, control, sources)


def replica_scheduler(
    index: int,
    arm: Arm,
    cfg: Config,
    load: LoadView,
    routing: PrefixRouting,
    hooks: Sequence[DecisionHook],
    signals: Callable[[EndpointAddress], EngineSignals | None] | None = None,
) -> Scheduler:
    """Router ``index``'s scheduler, online or offline: the arm's policy, its own tie-break seed."""
    return Scheduler(
        load,
        arm.policy,
        max_fallbacks=0,
        rng=random.Random(cfg.seed + index),
        prefix=routing.matcher,
        signals=signals,
        hooks=hooks,
        candidates=arm.candidates,
    )


def summed(counters: Iterable[Mapping[str, int]]) -> dict[str, int]:
    """The routers' counters added up, key by key."""
    total: dict[str, int] = {}
    for counter in counters:
        for key, value in counter.items():
            total[key] = total.get(key, 0) + value
    return total


def report(runs: list[dict[str, Any]]) -> str:
    """Several seeds' ``--routers`` runs side by side: each arm's mean over the seeds, and its ratio to
    the one-router arm of the same policy."""
    arms: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        for arm in run["arms"]:
            arms.setdefault(arm["raw"]["name"], []).append(arm["summary"])
    keys = ("hit_rate", "ttft_mean_s", "ttft_p99_s")
    means = {name: {k: statistics.fmean(s[k] for s in rows) for k in keys} for name, rows in arms.items()}
    first = runs[0]
    seeds_used = ", ".join(str(r["config"]["seed"]) for r in runs)
    delays = {a["raw"].get("sync_delay_s") for r in runs for a in r["arms"]} - {None}
    # Runs from before the delay was recorded used the default, --sync-delay-ms 5.
    delay = ", ".join(f"{d * 1000:g} ms" for d in sorted(delays)) or "5 ms, the default"
    lines = [
        "# Several routers: peer sync against none (offline replay)",
        "",
        provenance(first["machine"]),
        "",
        f"`python -m bench.replay --offline --routers N`, {first['trace']['requests']} Mooncake rows, "
        f"{first['config']['engines']} engines, precise routing, seeds {seeds_used}. "
        "Requests go round robin to N routers, each with its own index (fed every engine's KV events), "
        "leases and state; synced, a lease change reaches the others after the modelled delay "
        f"({delay}; the response's start too). Rows sharing a timestamp are spread over the trace's "
        "3-second steps "
        "(`spread_arrivals`), in every arm.",
        "",
        "| arm | hit rate | x one router | TTFT mean | x | TTFT p99 | x | per seed (hit, mean, p99) |",
        "|---|--:|--:|--:|--:|--:|--:|---|",
    ]
    for name, m in means.items():
        base = means[name.split(" x", 1)[0]]
        seeds = "; ".join(
            f"{s['hit_rate']:.3f}, {s['ttft_mean_s']:.3f}, {s['ttft_p99_s']:.2f}" for s in arms[name]
        )
        lines.append(
            f"| {name} | {m['hit_rate']:.2%} | {m['hit_rate'] / base['hit_rate']:.3f} | "
            f"{m['ttft_mean_s']:.3f} s | {m['ttft_mean_s'] / base['ttft_mean_s']:.3f} | "
            f"{m['ttft_p99_s']:.2f} s | "
            f"{m['ttft_p99_s'] / base['ttft_p99_s']:.3f} | {seeds} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    """``python -m bench.replay.routers OUT.md RUN.json...``: the report of several seeds' runs."""
    out, *paths = sys.argv[1:]
    runs = [json.loads(Path(p).read_text()) for p in paths]
    Path(out).write_text(report(runs))
    print(Path(out).read_text())


if __name__ == "__main__":
    main()
