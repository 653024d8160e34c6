"""The offline replay against the online one: the same rows and engines, policy by policy.

Issue 15's tolerance: the two modes agree within 10% (relative) on hit rate and on mean TTFT, for
every policy, when the online run is valid (its machine kept up).

    python -m bench.replay.crosscheck [ONLINE.json OFFLINE.json [OUT.md]]  # -> results/replay_crosscheck.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from bench.replay.report import validity

RESULTS = Path(__file__).resolve().parents[1] / "results"
TOLERANCE = 0.10
#: What must match for the two runs to be comparable.
_SAME = ("engines", "output_cap", "engine_params", "engine_kind")


def _relative(online: float, offline: float) -> float:
    return (offline - online) / online if online else 0.0


def markdown(online: dict[str, Any], offline: dict[str, Any]) -> str:
    mismatched = [k for k in _SAME if online["config"].get(k) != offline["config"].get(k)]
    rows = (online["trace"]["first_row"], online["trace"]["requests"])
    if rows != (offline["trace"]["first_row"], offline["trace"]["requests"]):
        mismatched.append("trace rows")
    by_name = {a["summary"]["policy"]: a["summary"] for a in offline["arms"]}
    lines = [
        "# Replay: offline (virtual time) against online (wall clock)",
        "",
        f"Online: commit {online['machine']['git_commit'][:10]}, {online['machine']['date']}, time scale "
        f"{online['config']['time_scale']}, {online['total_wall_s']:.0f} s. Offline: commit "
        f"{offline['machine']['git_commit'][:10]}, {offline['machine']['date']}, "
        f"{offline['total_wall_s']:.0f} s. Rows {rows[0]}-{rows[0] + rows[1] - 1}, "
        f"{online['config']['engines']} engines. Tolerance: {TOLERANCE:.0%} relative.",
        "",
    ]
    if mismatched:
        lines += [f"**Not comparable**: the runs differ in {', '.join(mismatched)}.", ""]
    lines += [
        "| policy | hit rate online / offline | diff | mean TTFT s online / offline | diff | within |",
        "|---|--:|--:|--:|--:|---|",
    ]
    for arm in online["arms"]:
        on = arm["summary"]
        off = by_name.get(on["policy"])
        if off is None:
            continue
        hit = _relative(on["hit_rate"], off["hit_rate"])
        ttft = _relative(on["ttft_mean_s"], off["ttft_mean_s"])
        why = validity(on)
        verdict = "yes" if max(abs(hit), abs(ttft)) <= TOLERANCE else "**no**"
        if why is not None:
            verdict = f"online run invalid ({why})"
        lines.append(
            f"| {on['policy']} | {on['hit_rate']:.2%} / {off['hit_rate']:.2%} | {hit:+.1%} "
            f"| {on['ttft_mean_s']:.3f} / {off['ttft_mean_s']:.3f} | {ttft:+.1%} | {verdict} |"
        )
    lines += [
        "",
        "Offline, KV events reach the index the moment their step ends and nothing waits on a socket, "
        "an event loop or a CPU; online, the engines' loops group steps shorter than a millisecond of "
        "wall time and the client's arrivals run a little late, which lengthens TTFTs slightly.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    online_path = Path(argv[0]) if argv else RESULTS / "replay.json"
    offline_path = Path(argv[1]) if len(argv) > 1 else RESULTS / "replay_offline.json"
    md = markdown(json.loads(online_path.read_text()), json.loads(offline_path.read_text()))
    (Path(argv[2]) if len(argv) > 2 else RESULTS / "replay_crosscheck.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main(sys.argv[1:])
