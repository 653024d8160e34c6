"""The demo's live view as pure text: a :class:`Snapshot` in, a string out.

Kept free of terminals, clocks and servers so the layout is tested by comparing strings; the demo
(:mod:`extproc.demo.run`) gathers a snapshot every second and decides how to show it: a full-screen
redraw on a TTY (:func:`render_frame`), a one-line summary in logs and CI (:func:`render_line`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

#: Clear the screen and move the cursor home: each frame replaces the last one in place.
CLEAR = "\x1b[H\x1b[2J"
#: ASCII only: the view must read the same in any terminal and any locale.
_BAR_WIDTH = 20
_HEADERS = ("worker set", "endpoint", "backend", "served", "in flight", "share of set")


@dataclass(frozen=True, slots=True)
class EndpointRow:
    """One endpoint as the live view shows it."""

    worker_set: str
    address: str
    #: The backend's own name (what it reports in ``x_backend``), so curl output can be matched.
    backend: str
    #: Completion answers the backend finished (its own count, not the router's).
    served: int
    #: Requests the router sent there that have not finished (the router's own accounting).
    in_flight: int


@dataclass(frozen=True, slots=True)
class TrafficStats:
    """What the demo's own sample traffic (``--traffic``) has done so far."""

    sent: int = 0
    ok: int = 0
    failed: int = 0


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything one frame shows, gathered at one instant."""

    url: str
    elapsed: float
    endpoints: Sequence[EndpointRow]
    #: ``extproc_requests_total`` by outcome (``routed``, ``answered``, error codes).
    outcomes: Mapping[str, int] = field(default_factory=dict)
    #: None when the demo sends no traffic of its own.
    traffic: TrafficStats | None = None


@dataclass(frozen=True, slots=True)
class ModelLine:
    """One client-facing alias of the demo's catalog, for the intro."""

    alias: str
    upstream: str
    endpoints: int


@dataclass(frozen=True, slots=True)
class Intro:
    """The static part of the screen: where things listen and what to type."""

    url: str
    envoy_admin_url: str
    envoy_pid: int | None
    metrics_url: str
    body_mode: str
    models: Sequence[ModelLine]
    duration: float | None = None


def render_intro(intro: Intro) -> str:
    """Addresses, the models to ask for, and copy-pasteable curl commands (one per line)."""
    stop = "Ctrl-C" if intro.duration is None else f"Ctrl-C, or by itself after {intro.duration:g} s"
    pid = f" (pid {intro.envoy_pid})" if intro.envoy_pid is not None else ""
    lines = [
        "extproc demo: Envoy -> ext_proc router -> fake OpenAI-compatible backends, all on loopback",
        f"Gateway URL: {intro.url}",
        f"Envoy admin: {intro.envoy_admin_url}{pid}   router metrics: {intro.metrics_url}",
        f"Body mode: {intro.body_mode}   stop: {stop}",
        "Models:",
    ]
    for m in intro.models:
        plural = "" if m.endpoints == 1 else "s"
        lines.append(f"  {m.alias} -> {m.upstream} ({m.endpoints} endpoint{plural})")
    lines.append("Try:")
    lines.extend("  " + command for command in curl_examples(intro.url, intro.models))
    return "\n".join(lines) + "\n"


def curl_examples(url: str, models: Sequence[ModelLine]) -> list[str]:
    """A chat through the first alias, a streamed chat through the last one, and the model list."""
    first = models[0].alias if models else "chat"
    last = models[-1].alias if models else first
    json_header = "-H 'content-type: application/json'"
    chat = f'{{"model": "{first}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'
    stream = (
        f'{{"model": "{last}", "stream": true, '
        '"messages": [{"role": "user", "content": "Tell me a story"}]}'
    )
    return [
        f"curl -s {url}/v1/chat/completions {json_header} -d '{chat}'",
        f"curl -sN {url}/v1/chat/completions {json_header} -d '{stream}'",
        f"curl -s {url}/v1/models",
    ]


def render_frame(snapshot: Snapshot, intro: str = "") -> str:
    """A full-screen frame: clear, the (static) intro, then the table. For TTYs only."""
    parts = [CLEAR]
    if intro:
        parts.append(intro.rstrip("\n") + "\n\n")
    parts.append(render_table(snapshot))
    return "".join(parts)


def render_table(snapshot: Snapshot) -> str:
    """The status line, one row per endpoint, a total row, and the router's outcome totals."""
    rows = [_row_cells(row, _set_totals(snapshot.endpoints)) for row in snapshot.endpoints]
    total_served = sum(r.served for r in snapshot.endpoints)
    total_inflight = sum(r.in_flight for r in snapshot.endpoints)
    footer = ("total", "", "", str(total_served), str(total_inflight), "")
    widths = [max(len(c[i]) for c in [_HEADERS, *rows, footer]) for i in range(len(_HEADERS))]
    lines = [_status(snapshot), ""]
    lines.append(_join(_HEADERS, widths))
    lines.append(_join(tuple("-" * w for w in widths), widths))
    lines.extend(_join(cells, widths) for cells in rows)
    lines.append(_join(footer, widths))
    lines.append("")
    lines.append("router outcomes: " + (_outcomes(snapshot.outcomes) or "none yet"))
    return "\n".join(lines) + "\n"


def render_line(snapshot: Snapshot) -> str:
    """One line for logs and CI: served per endpoint, grouped by worker set, and outcomes."""
    groups: dict[str, list[str]] = {}
    for row in snapshot.endpoints:
        groups.setdefault(row.worker_set, []).append(str(row.served))
    spread = " ".join(f"{name}=[{'/'.join(counts)}]" for name, counts in groups.items())
    served = sum(r.served for r in snapshot.endpoints)
    inflight = sum(r.in_flight for r in snapshot.endpoints)
    parts = [
        f"demo t={_duration(snapshot.elapsed)}",
        f"served={served}",
        f"in_flight={inflight}",
        spread,
        f"outcomes: {_outcomes(snapshot.outcomes, sep='=') or 'none'}",
    ]
    if snapshot.traffic is not None:
        t = snapshot.traffic
        parts.append(f"traffic: sent={t.sent} ok={t.ok} failed={t.failed}")
    return " ".join(p for p in parts if p)


def share_bar(part: int, whole: int, width: int = _BAR_WIDTH) -> str:
    """``' 33% ######..............'``: the part's share of the whole, as a number and a bar."""
    if whole <= 0:
        return "   - " + "." * width
    fraction = min(max(part / whole, 0.0), 1.0)
    filled = round(fraction * width)
    return f"{round(fraction * 100):3d}% " + "#" * filled + "." * (width - filled)


# -- helpers --------------------------------------------------------------------------------------


def _set_totals(rows: Sequence[EndpointRow]) -> dict[str, int]:
    totals: dict[str, int] = {}
    for row in rows:
        totals[row.worker_set] = totals.get(row.worker_set, 0) + row.served
    return totals


def _row_cells(row: EndpointRow, set_totals: Mapping[str, int]) -> tuple[str, ...]:
    share = share_bar(row.served, set_totals.get(row.worker_set, 0))
    return (row.worker_set, row.address, row.backend, str(row.served), str(row.in_flight), share)


def _join(cells: Sequence[str], widths: Sequence[int]) -> str:
    """Text columns left-aligned, number columns right-aligned; no trailing spaces."""
    out = []
    for i, (cell, width) in enumerate(zip(cells, widths, strict=True)):
        out.append(cell.rjust(width) if i in (3, 4) else cell.ljust(width))
    return "  ".join(out).rstrip()


def _status(snapshot: Snapshot) -> str:
    text = f"extproc demo  up {_duration(snapshot.elapsed)}  gateway {snapshot.url}"
    if snapshot.traffic is not None:
        t = snapshot.traffic
        text += f"  sample traffic: {t.sent} sent, {t.ok} ok, {t.failed} failed"
    return text


def _outcomes(outcomes: Mapping[str, int], sep: str = " ") -> str:
    """Outcomes by count, largest first (ties by name), zero counts left out."""
    items = sorted(((k, v) for k, v in outcomes.items() if v), key=lambda kv: (-kv[1], kv[0]))
    joiner = " " if sep == "=" else "  "
    return joiner.join(f"{name}{sep}{count}" for name, count in items)


def _duration(seconds: float) -> str:
    """``hh:mm:ss``: short, fixed width, never negative."""
    whole = max(int(seconds), 0)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}"
