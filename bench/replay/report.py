"""The replay benchmark's markdown table and plots, from its JSON result (re-renderable offline).

``python -m bench.replay.report bench/results/raw/replay.json`` rewrites ``bench/results/replay.md``
and its PNGs.
Plots need matplotlib (a dev extra); without it the markdown is still written.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

#: An arm is invalid (the machine could not keep up, so it measured another trace or another engine)
#: when its client sent requests later than this against the scaled trace clock (p99, wall ms) ...
MAX_DISPATCH_LAG_MS = 50.0
#: ... or when its engines together fell behind their model by more than this share of the arm's wall
#: time (the engine loops drop the debt: model time jumps, steps look faster than modelled), beyond a
#: one-off hiccup of :data:`ENGINE_LAG_ALLOWANCE_S` (a collection, a process starting).
MAX_ENGINE_LAG_SHARE = 0.01
ENGINE_LAG_ALLOWANCE_S = 0.5


def validity(summary: dict[str, Any]) -> str | None:
    """Why an arm's numbers cannot be trusted (its own lag measures), or None when they can."""
    problems = []
    if summary["dispatch_lag_ms_p99"] > MAX_DISPATCH_LAG_MS:
        problems.append(f"dispatch lag p99 {summary['dispatch_lag_ms_p99']:.0f} ms > {MAX_DISPATCH_LAG_MS:g}")
    dropped, wall = summary.get("engine_lag_dropped_s", 0.0), summary["wall_s"]
    if dropped > max(ENGINE_LAG_ALLOWANCE_S, MAX_ENGINE_LAG_SHARE * wall):
        problems.append(f"engines fell {dropped:.1f} s behind their model in {wall:.0f} s")
    return "; ".join(problems) or None


def _trace_title(path: str) -> str:
    name = Path(path).name
    if name.startswith("azure_llm_2023_"):
        return f"Azure LLM inference 2023 {Path(name).stem.rsplit('_', 1)[-1]} trace"
    return "Mooncake conversation trace" if name == "mooncake_conversation_trace.jsonl" else f"`{name}`"


def _pooled(ub: dict[str, Any]) -> list[str]:
    """The capacity reference line, when the run computed it."""
    if "pooled_hit_rate_engine_blocks" not in ub:
        return []
    rate, bound = ub["pooled_hit_rate_engine_blocks"], ub["hit_rate_engine_blocks"]
    if not bound:
        return [
            "",
            "**No prompt shares a prefix with an earlier one** (a trace without prefix information): "
            "every router's hit rate is 0, and what tells them apart is how they balance the load.",
        ]
    return [
        "",
        f"**Capacity reference** (one LRU cache holding the whole fleet's "
        f"{ub['pooled_capacity_tokens']:,} tokens, as if the engines pooled their memory and no block "
        f"were ever held twice): {rate:.1%}, {rate / bound:.0%} of the upper bound. Past this, hit rate "
        "is limited by cache capacity, not by routing.",
    ]


def _hashing(ep: dict[str, Any]) -> str:
    algo = ep.get("prefix_caching_hash_algo")
    return "" if algo is None else f", blocks hashed with {algo} (routers key them by their tokens)"


def _offload(ep: dict[str, Any]) -> str:
    blocks = ep.get("cpu_offload_blocks", 0)
    if not blocks:
        return " No CPU offload tier."
    return (
        f" CPU offload tier: {blocks} blocks (= {blocks * ep['block_size']:,} tokens) per engine, "
        f"write-through, loaded back at {ep['cpu_load_tokens_per_s']:.0f} tok/s."
    )


def _f(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(result: dict[str, Any]) -> str:
    """The results page: setup, upper bound, one row per policy, caveats."""
    m, t, c, ub = result["machine"], result["trace"], result["config"], result["upper_bound"]
    ep = c["engine_params"]
    offline = c.get("mode", "").startswith("offline")
    pacing = (
        "played offline in virtual time (one process, deterministic for its seed)"
        if offline
        else f"time scale {c['time_scale']} (wall s per simulated s)"
    )
    lines = [
        f"# Routing quality: {_trace_title(t['path'])} replay" + (" (offline)" if offline else ""),
        "",
        f"Machine: {m['cpu_model']}, {m['cores']} cores, Python {m['python']}, "
        f"commit {m['git_commit'][:10]}{' (dirty)' if m['git_dirty'] else ''}, "
        f"{m['date']}. Whole run: {result['total_wall_s']:.0f} s wall.",
        "",
        f"Trace: `{Path(t['path']).name}` rows {t['first_row']}-{t['first_row'] + t['requests'] - 1} "
        f"({t['requests']} requests over {t['duration_s']:.0f} s of trace time, {t['mean_rps']} req/s, "
        f"mean input {t['mean_input_tokens']:.0f} / output {t['mean_output_tokens']:.0f} tokens, "
        f"max input {t['max_input_tokens']}).",
        "",
        f"Setup: {c['engines']} simulated engines (fresh, empty caches for every policy), {pacing}, "
        f"max_tokens = min(output_length, {c['output_cap']}). "
        f"Engine params: {ep['num_gpu_blocks']} KV blocks x {ep['block_size']} tokens "
        f"(= {ep['num_gpu_blocks'] * ep['block_size']:,} tokens) per engine, max_model_len "
        f"{ep['max_model_len']}, max_num_seqs {ep['max_num_seqs']}, max_num_batched_tokens "
        f"{ep['max_num_batched_tokens']}, prefill {ep['prefill_tokens_per_s']:.0f} tok/s, decode "
        f"{ep['decode_base_s'] * 1000:g} ms + {ep['decode_per_seq_s'] * 1000:g} ms/seq per step"
        + _hashing(ep)
        + "."
        + _offload(ep),
        f"Transport: {c['transport']}. Engine signals: {c['engine_signals']}. "
        f"Engines show {c.get('engine_kind', 'vllm')}'s surface (metric names, KV-event encoding).",
        "",
        f"**Upper bound** (one unbounded cache that saw every earlier request): "
        f"{ub['hit_rate_tokens']:.1%} of prompt tokens (token-exact), "
        f"{ub['hit_rate_engine_blocks']:.1%} counted as the engines count (whole 16-token blocks, "
        "at least one token recomputed).",
        *_pooled(ub),
        "",
        "| policy | prefix input | hit rate | GPU hit rate | TTFT mean s | TTFT p50 s | TTFT p99 s "
        "| e2e p50 s | e2e p99 s "
        "| req/engine max/mean | req/engine CV | preemptions | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for arm in result["arms"]:
        s = arm["summary"]
        lines.append(
            f"| {s['policy']} | {s['prefix_mode']} | {s['hit_rate']:.1%} "
            f"| {s.get('gpu_hit_rate', s['hit_rate']):.1%} | {_f(s['ttft_mean_s'])} "
            f"| {_f(s['ttft_p50_s'])} | {_f(s['ttft_p99_s'])} | {_f(s['e2e_p50_s'], 2)} "
            f"| {_f(s['e2e_p99_s'], 2)} "
            f"| {_f(s['imbalance_max_over_mean'], 2)} | {_f(s['imbalance_cv'], 2)} | {s['preemptions']} "
            f"| {s['errors']} |"
        )
    lines += [
        "",
        "Client view and run health (client TTFT = wall time to the first streamed chunk / time scale, "
        "so it includes routing, HTTP and event-loop delays; dispatch lag = how late the client sent "
        "requests against the scaled trace clock; CPU in CPU-seconds):",
        "",
        "| policy | client TTFT p50 s | client TTFT p99 s | client e2e p99 s | decide ms p50 "
        "| dispatch lag p99 ms | engine lag dropped s | wall s | router+client CPU s | engines CPU s "
        "| valid |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    invalid = []
    for arm in result["arms"]:
        s = arm["summary"]
        why = validity(s)
        if why is not None:
            invalid.append(f"{s['policy']} ({why})")
        lines.append(
            f"| {s['policy']} | {_f(s['client_ttft_p50_s'])} | {_f(s['client_ttft_p99_s'])} "
            f"| {_f(s['client_e2e_p99_s'], 2)} | {_f(s['decide_ms_p50'], 2)} "
            f"| {_f(s['dispatch_lag_ms_p99'], 1)} | {_f(s.get('engine_lag_dropped_s'), 1)} "
            f"| {s['wall_s']:.0f} | {s['router_client_cpu_s']:.0f} | {s['engine_cpu_s']:.0f} "
            f"| {'yes' if why is None else '**NO**'} |"
        )
    if invalid:
        lines += [
            "",
            "**INVALID arms: the machine could not keep up, so their numbers describe another trace or "
            "slower engines, not the routing:** " + "; ".join(invalid) + ". Run them again on a quieter "
            "machine, or at a larger time scale.",
        ]
    stalled = [(a["summary"]["policy"], a["summary"].get("engine_stalls")) for a in result["arms"]]
    threshold = next((st["threshold_s"] for _, st in stalled if st), None)
    if threshold is not None:
        lines += [
            "",
            f"Engines' event loop held over {threshold * 1000:g} ms (`bench/replay/stalls.py`; CPU = "
            "what their process "
            "ran meanwhile, GC = the collector's share of it): "
            + "; ".join(
                f"{policy}: {st['stalls']} times, {st['stalled_s']:.1f} s (CPU {st['stalled_cpu_s']:.1f} s, "
                f"GC {st['stalled_gc_s']:.1f} s, longest {st['longest_s'] * 1000:.0f} ms)"
                for policy, st in stalled
                if st
            )
            + ".",
        ]
    lines += [
        "",
        "How to read it:",
        "",
        "- *hit rate* = the engines' own `(prefix_cache_hits + external_prefix_cache_hits) / "
        "prefix_cache_queries` (tokens, counted once per admission, summed over engines; external = "
        "loaded back from the CPU offload tier); *GPU hit rate* counts GPU hits only. "
        "*TTFT*, *e2e* = every request's engine-side time to first "
        "token and end-to-end latency in *simulated* seconds (the values the engines feed their "
        "`vllm:time_to_first_token_seconds` / `e2e_request_latency` histograms, kept per request); they "
        "exclude routing time, which is real wall time and shown as *decide ms*. Percentiles are "
        "nearest-rank.",
        "- *req/engine max/mean*, *CV* = requests routed to each engine: max over mean, and standard "
        "deviation over mean (0 = perfectly even).",
        (
            "- Offline: decisions run through the real `Scheduler` + `PrefixRouting` (tokenizer "
            "`extproc:tiny`, the engines' KV events applied to the router's index the moment their "
            "step ends, as its ingest decodes them: handed over decoded, or with `--wire-events` "
            "encoded as vLLM sends them); the engine cores step in virtual time as "
            "the simulator's loop steps them, so client times equal engine times plus nothing, and "
            "*wall s* is the trace's simulated length. Leases are held until each request's last token."
            if offline
            else "- Decisions run through the real `Scheduler` + `PrefixRouting` (tokenizer `extproc:tiny`, "
            "real ZMQ KV-event subscriptions); requests go straight to the chosen engine over HTTP, no "
            "Envoy (on 2 cores Envoy's CPU would distort the engines' pacing). Leases are held until "
            "each response ends, so in-flight counts are exact."
        ),
        "- Policies: round-robin; least-in-flight (ours, no cache input); *gie-like* = 3 x prefix-match "
        "ratio (approximate: our routing history of prompt chunks, no KV events) + 2 x (1 - min-max "
        "normalised in-flight) + 1 x (1 - kv usage; 0 without engine signals), max score; *dynamo-like* = "
        "argmin of prefill_load_scale (1.0) x max(active prefill blocks + new prompt blocks - overlap "
        "blocks, 0) + active blocks, overlap from the precise KV-event index, active blocks from our own "
        "in-flight accounting (prompt blocks only); *ours* = the router's policy (see its name).",
        "- Prompts: each trace hash id is 512 fixed pseudo-random token ids of the shipped tokenizer's "
        "vocabulary (seeded by the id), the last block cut to `input_length`.",
        "",
    ]
    return "\n".join(lines)


def plots(result: dict[str, Any], out: Path) -> list[Path]:
    """Hit rate per policy (with the upper bound) and TTFT CDF per policy; [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    arms = result["arms"]
    names = [a["summary"]["policy"] for a in arms]
    written: list[Path] = []

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.barh(names, [a["summary"]["hit_rate"] for a in arms], color="tab:blue")
    bound = result["upper_bound"]["hit_rate_engine_blocks"]
    ax.axvline(bound, color="tab:red", linestyle="--", label=f"upper bound {bound:.1%}")
    ax.set_xlabel("prefix-cache hit rate (engine counters)")
    ax.invert_yaxis()
    ax.legend(loc="lower right")
    fig.tight_layout()
    path = out.with_name(out.stem + "_hit_rate.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for arm in arms:
        ttft = sorted(t for e in arm["raw"]["engines"] for t in e["ttft"])
        if ttft:
            ax.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=arm["summary"]["policy"])
    ax.set_xscale("log")
    ax.set_xlabel("TTFT, simulated seconds (log)")
    ax.set_ylabel("fraction of requests")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path = out.with_name(out.stem + "_ttft_cdf.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written


def summary_path(out: Path) -> Path:
    """Where a run's summary goes: raw outputs (``results/raw/X.json``, not tracked) have their
    ``.md`` and PNGs one folder up, in ``results/`` (tracked); any other output has them beside it."""
    folder = out.parent.parent if out.parent.name == "raw" else out.parent
    return folder / out.with_suffix(".md").name


def write(result: dict[str, Any], out: Path) -> str:
    """Write the run's ``.md`` and PNGs (see :func:`summary_path`); returns the markdown."""
    summary = summary_path(out)
    images = plots(result, summary)
    md = markdown(result)
    if images:
        md += "\n" + "\n".join(f"![{p.stem}]({p.name})" for p in images) + "\n"
    summary.write_text(md)
    return md


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results/raw/replay.json")
    print(write(json.loads(target.read_text()), target))
