"""The offline replay against the online one: the same rows and engines, policy by policy.

Issue 15's tolerance: the two modes agree within 10% (relative) on hit rate and on mean TTFT, for
every policy, when the online run is valid (its machine kept up).

Given offline runs of several tie-break seeds, each policy's online figures are set against the
nearest of them, and the range over the seeds is shown: an online run's tie-breaks follow its
timing, so it is one more draw of them, and some policies move by more than the tolerance with the
seed alone (approximate prefix affinity: 9.6-10.7% hit rate over four seeds on rows 0-1,499).

    python -m bench.replay.crosscheck [ONLINE.json [OFFLINE.json ...]] [--out OUT.md]
    # defaults: results/raw/replay.json, results/raw/replay_offline.json -> results/replay_crosscheck.md
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.replay.report import validity

RESULTS = Path(__file__).resolve().parents[1] / "results"
TOLERANCE = 0.10
#: What must match for the two runs to be comparable.
_SAME = ("engines", "output_cap", "engine_params", "engine_kind")


def _relative(online: float, offline: float) -> float:
    return (offline - online) / online if online else 0.0


def _gaps(online: dict[str, Any], offline: dict[str, Any]) -> tuple[float, float]:
    """Offline against online, relative: hit rate, mean TTFT."""
    return (
        _relative(online["hit_rate"], offline["hit_rate"]),
        _relative(online["ttft_mean_s"], offline["ttft_mean_s"]),
    )


def markdown(online: dict[str, Any], offline: dict[str, Any] | list[dict[str, Any]]) -> str:
    offlines = offline if isinstance(offline, list) else [offline]
    first = offlines[0]
    mismatched = sorted(
        {k for run in offlines for k in _SAME if online["config"].get(k) != run["config"].get(k)}
    )
    rows = (online["trace"]["first_row"], online["trace"]["requests"])
    if any(rows != (run["trace"]["first_row"], run["trace"]["requests"]) for run in offlines):
        mismatched.append("trace rows")
    by_name: dict[str, list[dict[str, Any]]] = {}
    for run in offlines:
        for arm in run["arms"]:
            by_name.setdefault(arm["summary"]["policy"], []).append(arm["summary"])
    several = len(offlines) > 1
    lines = [
        "# Replay: offline (virtual time) against online (wall clock)",
        "",
        f"Online: commit {online['machine']['git_commit'][:10]}, {online['machine']['date']}, time scale "
        f"{online['config']['time_scale']}, {online['total_wall_s']:.0f} s. Offline: commit "
        f"{first['machine']['git_commit'][:10]}, {first['machine']['date']}, "
        f"{first['total_wall_s']:.0f} s"
        + (f", {len(offlines)} tie-break seeds (each policy against the nearest)" if several else "")
        + f". Rows {rows[0]}-{rows[0] + rows[1] - 1}, "
        f"{online['config']['engines']} engines. Tolerance: {TOLERANCE:.0%} relative.",
        "",
    ]
    if mismatched:
        lines += [f"**Not comparable**: the runs differ in {', '.join(mismatched)}.", ""]
    offline_head = "offline (nearest seed; range)" if several else "offline"
    lines += [
        f"| policy | hit rate online / {offline_head} | diff | mean TTFT s online / {offline_head} "
        "| diff | within |",
        "|---|--:|--:|--:|--:|---|",
    ]
    for arm in online["arms"]:
        on = arm["summary"]
        runs = by_name.get(on["policy"])
        if not runs:
            continue

        off = min(runs, key=lambda run: max(map(abs, _gaps(on, run))))
        hit, ttft = _gaps(on, off)
        why = validity(on)
        verdict = "yes" if max(abs(hit), abs(ttft)) <= TOLERANCE else "**no**"
        if why is not None:
            verdict = f"online run invalid ({why})"
        hits = sorted(r["hit_rate"] for r in runs)
        ttfts = sorted(r["ttft_mean_s"] for r in runs)
        hit_range = f" ({hits[0]:.2%}-{hits[-1]:.2%})" if several else ""
        ttft_range = f" ({ttfts[0]:.3f}-{ttfts[-1]:.3f})" if several else ""
        lines.append(
            f"| {on['policy']} | {on['hit_rate']:.2%} / {off['hit_rate']:.2%}{hit_range} | {hit:+.1%} "
            f"| {on['ttft_mean_s']:.3f} / {off['ttft_mean_s']:.3f}{ttft_range} | {ttft:+.1%} | {verdict} |"
        )
    lines += [
        "",
        "Offline, KV events reach the index the moment their step ends and nothing waits on a socket, "
        "an event loop or a CPU; online, the engines' loops group steps shorter than a millisecond of "
        "wall time and the client's arrivals run a little late, which lengthens TTFTs slightly.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.replay.crosscheck", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("online", nargs="?", type=Path, default=RESULTS / "raw" / "replay.json")
    parser.add_argument(
        "offline",
        nargs="*",
        type=Path,
        help="offline runs of the same rows (several seeds: the nearest counts)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "replay_crosscheck.md")
    args = parser.parse_args(argv)
    offline_paths = args.offline or [RESULTS / "raw" / "replay_offline.json"]
    md = markdown(
        json.loads(args.online.read_text()), [json.loads(path.read_text()) for path in offline_paths]
    )
    args.out.write_text(md)
    print(md)


if __name__ == "__main__":
    main()
