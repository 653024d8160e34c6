"""The demo's live view as pure text: a :class:`Snapshot` in, a string out.

Kept free of terminals, clocks and servers so the layout is tested by comparing strings; the demo
(:mod:`extproc.demo.run`) gathers a snapshot every second and decides how to show it: a full-screen
redraw on a TTY (:func:`render_frame`), a one-line summary in logs and CI (:func:`render_line`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

#: Clear the screen and move the cursor home: each frame replaces the last one in place.
CLEAR = "\x1b[H\x1b[2J"
#: ASCII only: the view must read the same in any terminal and any locale. The bar is short so a
#: row with the engine's columns still fits in 100 columns.
_BAR_WIDTH = 10
_HEADERS = (
    "worker set",
    "endpoint",
    "served",
    "in flight",
    "run/wait",
    "kv cache",
    "prefix hits",
    "share of set",
)
#: Columns holding numbers: right-aligned, so digits line up under their headers.
_NUMERIC = frozenset(range(2, 7))


@dataclass(frozen=True, slots=True)
class EndpointRow:
    """One endpoint as the live view shows it: the router's view of it and the engine's own state."""

    worker_set: str
    address: str
    #: Requests the engine generated to the end (its own count, not the router's).
    served: int
    #: Requests the router sent there that have not finished (the router's own accounting).
    in_flight: int
    #: The engine's scheduler: requests in the running batch, and queued behind it.
    running: int = 0
    waiting: int = 0
    #: Fraction (0-1) of the engine's KV blocks held by requests (``vllm:kv_cache_usage_perc``).
    kv_cache_usage: float = 0.0
    #: Prompt tokens looked up in the engine's prefix cache, and how many of them were already there.
    prefix_queries: int = 0
    prefix_hits: int = 0


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
class EngineLine:
    """One simulated engine, for the intro: where it serves and where it publishes KV events.

    The event endpoints are what the router subscribes to (the catalog declares them), so a
    reader can match them with ``/debug/state`` -> ``prefix.sources``.
    """

    worker_set: str
    address: str
    kv_events: str
    kv_replay: str | None = None


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
    engines: Sequence[EngineLine] = ()


def render_intro(intro: Intro) -> str:
    """Addresses, the models to ask for, and copy-pasteable curl commands (one per line)."""
    stop = "Ctrl-C" if intro.duration is None else f"Ctrl-C, or by itself after {intro.duration:g} s"
    pid = f" (pid {intro.envoy_pid})" if intro.envoy_pid is not None else ""
    lines = [
        "extproc demo: Envoy -> ext_proc router -> simulated vLLM engines, all on loopback",
        f"Gateway URL: {intro.url}",
        f"Envoy admin: {intro.envoy_admin_url}{pid}   router metrics: {intro.metrics_url}",
        f"Body mode: {intro.body_mode}   stop: {stop}",
        "Models:",
    ]
    for m in intro.models:
        plural = "" if m.endpoints == 1 else "s"
        lines.append(f"  {m.alias} -> {m.upstream} ({m.endpoints} endpoint{plural})")
    if intro.engines:
        lines.append("Engines (each publishes KV-cache events over ZMQ, as vLLM does):")
        width = max(len(e.worker_set) for e in intro.engines)
        for e in intro.engines:
            replay = f"  replay {e.kv_replay}" if e.kv_replay else ""
            lines.append(f"  {e.worker_set.ljust(width)}  {e.address}  events {e.kv_events}{replay}")
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
    endpoints = snapshot.endpoints
    rows = [_row_cells(row, _set_totals(endpoints)) for row in endpoints]
    footer = (
        "total",
        "",
        str(sum(r.served for r in endpoints)),
        str(sum(r.in_flight for r in endpoints)),
        f"{sum(r.running for r in endpoints)}/{sum(r.waiting for r in endpoints)}",
        "",
        hit_rate(sum(r.prefix_hits for r in endpoints), sum(r.prefix_queries for r in endpoints)),
        "",
    )
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
    endpoints = snapshot.endpoints
    hits = hit_rate(sum(r.prefix_hits for r in endpoints), sum(r.prefix_queries for r in endpoints))
    parts = [
        f"demo t={_duration(snapshot.elapsed)}",
        f"served={sum(r.served for r in endpoints)}",
        f"in_flight={sum(r.in_flight for r in endpoints)}",
        spread,
        f"prefix_hits={hits}",
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
    filled = int(fraction * width + 0.5)  # half up: 25% of 10 is 3 marks, as 75% is 8
    return f"{round(fraction * 100):3d}% " + "#" * filled + "." * (width - filled)


def hit_rate(hits: int, queries: int) -> str:
    """``'64%'`` of prompt tokens found in the prefix cache; ``'-'`` before any lookup (not 0%)."""
    if queries <= 0:
        return "-"
    return f"{round(100 * min(max(hits / queries, 0.0), 1.0))}%"


def kv_usage(fraction: float) -> str:
    """``'3.1%'``: one decimal, because a few requests hold only a small share of a large cache."""
    return f"{100 * min(max(fraction, 0.0), 1.0):.1f}%"


# -- helpers --------------------------------------------------------------------------------------


def _set_totals(rows: Sequence[EndpointRow]) -> dict[str, int]:
    totals: dict[str, int] = {}
    for row in rows:
        totals[row.worker_set] = totals.get(row.worker_set, 0) + row.served
    return totals


def _row_cells(row: EndpointRow, set_totals: Mapping[str, int]) -> tuple[str, ...]:
    share = share_bar(row.served, set_totals.get(row.worker_set, 0))
    return (
        row.worker_set,
        row.address,
        str(row.served),
        str(row.in_flight),
        f"{row.running}/{row.waiting}",
        kv_usage(row.kv_cache_usage),
        hit_rate(row.prefix_hits, row.prefix_queries),
        share,
    )


def _join(cells: Sequence[str], widths: Sequence[int]) -> str:
    """Text columns left-aligned, number columns right-aligned; no trailing spaces."""
    out = []
    for i, (cell, width) in enumerate(zip(cells, widths, strict=True)):
        out.append(cell.rjust(width) if i in _NUMERIC else cell.ljust(width))
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


@dataclass(frozen=True, slots=True)
class PrefixView:
    """What the live view shows of the router's prefix routing (rendered here, below the table)."""

    #: ``extproc_prefix_lookups_total`` by mode: precise (tokenized, KV events), approximate, none.
    lookups: Mapping[str, int]
    tokenize_errors: int
    #: Per engine, in table order: (worker set, GPU blocks the router's index holds or None when
    #: not subscribed yet, whether its event stream is complete from seq 0).
    engines: Sequence[tuple[str, int | None, bool]]

    def lines(self, width: int = 100) -> list[str]:
        """Two short lines (wrapped to ``width`` with many engines) for the TTY frame."""
        modes = [
            f"precise {self.lookups.get('precise', 0)}",
            f"approximate {self.lookups.get('approximate', 0)}",
        ]
        if self.tokenize_errors:
            modes.append(f"tokenize errors {self.tokenize_errors}")
        in_sync = sum(1 for _, blocks, complete in self.engines if blocks is not None and complete)
        # (separator, text) pieces; a line may break before any piece, e.g. between two counts.
        pieces = [("", f"router index, blocks per engine ({in_sync}/{len(self.engines)} in sync):")]
        for n, (name, counts) in enumerate(self._per_set().items()):
            pieces.append((" " if n == 0 else "  ", name))
            pieces += [(" " if i == 0 else "/", count) for i, count in enumerate(counts.split("/"))]
        index = [""]
        for sep, text in pieces:
            if index[-1] and len(index[-1]) + len(sep) + len(text) > width:
                index.append("  " + text)
            else:
                index[-1] += (sep if index[-1] else "") + text
        return ["router prefix lookups: " + "  ".join(modes), *index]

    def summary(self) -> str:
        """The one-line summary's part: ``lookups: precise=N approximate=M indexed=a/b/c,d``."""
        indexed = ",".join(self._per_set().values())
        return (
            f"lookups: precise={self.lookups.get('precise', 0)} "
            f"approximate={self.lookups.get('approximate', 0)} indexed={indexed}"
        )

    def _per_set(self) -> dict[str, str]:
        groups: dict[str, list[str]] = {}
        for name, blocks, _ in self.engines:
            groups.setdefault(name, []).append("-" if blocks is None else str(blocks))
        return {name: "/".join(counts) for name, counts in groups.items()}


def render_demo_frame(snapshot: Snapshot, prefix: PrefixView, intro: str = "") -> str:
    """The view's frame, then the router's prefix lines below the outcomes."""
    return render_frame(snapshot, intro) + "\n".join(prefix.lines()) + "\n"


def render_demo_line(snapshot: Snapshot, prefix: PrefixView) -> str:
    """The view's one-line summary with the prefix part before the traffic (which stays last)."""
    line = render_line(replace(snapshot, traffic=None)) + " " + prefix.summary()
    if snapshot.traffic is not None:
        t = snapshot.traffic
        line += f" traffic: sent={t.sent} ok={t.ok} failed={t.failed}"
    return line
