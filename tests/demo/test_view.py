"""The live view's text, from snapshots alone: no terminal, no servers, no clock."""

from __future__ import annotations

import pytest

from extproc.demo.view import (
    CLEAR,
    EndpointRow,
    EngineLine,
    Intro,
    ModelLine,
    Snapshot,
    TrafficStats,
    curl_examples,
    hit_rate,
    kv_usage,
    render_frame,
    render_intro,
    render_line,
    render_table,
    share_bar,
)

ROWS = (
    EndpointRow("llama-3-8b", "127.0.0.1:40001", 10, 1, 1, 0, 0.0131, 4000, 3000),
    EndpointRow("llama-3-8b", "127.0.0.1:40002", 30, 0, 0, 0, 0.0, 12000, 10200),
    EndpointRow("llama-3-8b", "127.0.0.1:40003", 0, 2, 2, 5, 0.995, 0, 0),
    EndpointRow("qwen-2-7b", "127.0.0.1:40004", 5, 0, 0, 0, 0.0, 1000, 0),
)
SNAPSHOT = Snapshot(
    url="http://127.0.0.1:8080",
    elapsed=3725.9,
    endpoints=ROWS,
    outcomes={"routed": 46, "answered": 3, "model_not_found": 0, "no_ready_endpoint": 3},
    traffic=TrafficStats(sent=50, ok=49, failed=1),
)
MODELS = (
    ModelLine("chat", "meta-llama/Meta-Llama-3-8B-Instruct", 3),
    ModelLine("qwen", "Qwen/Qwen2-7B-Instruct", 1),
)


def test_table_shows_every_endpoint_with_router_and_engine_columns() -> None:
    """Served and share per set, the router's in-flight, then each engine's queue, cache use and
    prefix-cache hit rate (prompt tokens found in cache); the total's hit rate is over all tokens."""
    assert render_table(SNAPSHOT) == (
        "extproc demo  up 01:02:05  gateway http://127.0.0.1:8080  sample traffic: 50 sent, 49 ok, 1 failed\n"
        "\n"
        "worker set  endpoint         served  in flight  run/wait  kv cache  prefix hits  share of set\n"
        "----------  ---------------  ------  ---------  --------  --------  -----------  ---------------\n"
        "llama-3-8b  127.0.0.1:40001      10          1       1/0      1.3%          75%   25% ###.......\n"
        "llama-3-8b  127.0.0.1:40002      30          0       0/0      0.0%          85%   75% ########..\n"
        "llama-3-8b  127.0.0.1:40003       0          2       2/5     99.5%            -    0% ..........\n"
        "qwen-2-7b   127.0.0.1:40004       5          0       0/0      0.0%           0%  100% ##########\n"
        "total                            45          3       3/5                    78%\n"
        "\n"
        "router outcomes: routed 46  answered 3  no_ready_endpoint 3\n"
    )


def test_table_fits_a_100_column_terminal() -> None:
    """Four-digit counts and a full cache still leave the table under 100 columns."""
    rows = tuple(EndpointRow(r.worker_set, r.address, 9999, 999, 256, 1000, 1.0, 10**9, 10**9) for r in ROWS)
    table = render_table(Snapshot("http://127.0.0.1:8080", 0.0, rows)).splitlines()
    assert max(len(line) for line in table[2:]) <= 100


def test_table_before_any_traffic_says_so_and_has_no_traffic_part() -> None:
    rows = tuple(EndpointRow(r.worker_set, r.address, 0, 0) for r in ROWS)
    text = render_table(Snapshot("http://127.0.0.1:8080", 0.0, rows))
    assert "router outcomes: none yet" in text
    assert "sample traffic" not in text
    # No division by zero: share and hit rate say "nothing yet" rather than 0%.
    assert "   - .........." in text
    assert text.splitlines()[-3].split() == ["total", "0", "0", "0/0", "-"]
    assert all(line == line.rstrip() for line in text.splitlines())


def test_table_columns_line_up_with_long_names() -> None:
    rows = (EndpointRow("a-very-long-worker-set-name", "[::1]:8000", 1234567, 12),)
    lines = render_table(Snapshot("http://x", 1, rows)).splitlines()
    header, rule, row = lines[2], lines[3], lines[4]
    assert len(rule) == len(row) >= len(header)
    # Numbers are right-aligned under their (right-aligned) headers.
    assert row.index("1234567") + len("1234567") == header.index("served") + len("served")


def test_one_line_summary_for_logs() -> None:
    assert render_line(SNAPSHOT) == (
        "demo t=01:02:05 served=45 in_flight=3 llama-3-8b=[10/30/0] qwen-2-7b=[5] prefix_hits=78% "
        "outcomes: routed=46 answered=3 no_ready_endpoint=3 traffic: sent=50 ok=49 failed=1"
    )
    quiet = render_line(Snapshot("http://x", 0, ROWS[:1]))
    assert quiet == "demo t=00:00:00 served=10 in_flight=1 llama-3-8b=[10] prefix_hits=75% outcomes: none"
    assert "\n" not in quiet and "\x1b" not in quiet


def test_frame_clears_the_screen_then_shows_intro_and_table() -> None:
    frame = render_frame(SNAPSHOT, "INTRO\n")
    assert frame.startswith(CLEAR + "INTRO\n\n")
    assert frame.endswith(render_table(SNAPSHOT))
    assert render_frame(SNAPSHOT) == CLEAR + render_table(SNAPSHOT)


@pytest.mark.parametrize(
    ("part", "whole", "expected"),
    [
        (1, 3, " 33% ###......."),
        (2, 3, " 67% #######..."),
        (3, 3, "100% ##########"),
        (0, 0, "   - .........."),
        (5, 3, "100% ##########"),  # clamped: never wider than the bar
    ],
)
def test_share_bar(part: int, whole: int, expected: str) -> None:
    assert share_bar(part, whole, width=10) == expected


def test_intro_names_every_address_model_and_how_to_stop() -> None:
    intro = Intro(
        url="http://127.0.0.1:8080",
        envoy_admin_url="http://127.0.0.1:9901",
        envoy_pid=4242,
        metrics_url="http://127.0.0.1:5555/metrics",
        body_mode="BUFFERED",
        models=MODELS,
        duration=30,
        engines=(
            EngineLine("llama-3-8b", "127.0.0.1:40001", "tcp://127.0.0.1:50001", "tcp://127.0.0.1:50002"),
            EngineLine("qwen-2-7b", "127.0.0.1:40004", "tcp://127.0.0.1:50003"),
        ),
    )
    text = render_intro(intro)
    assert "simulated vLLM engines" in text.splitlines()[0]
    # Every engine with the ZMQ endpoints a KV-aware router would subscribe to, set names aligned.
    assert (
        "  llama-3-8b  127.0.0.1:40001  events tcp://127.0.0.1:50001  replay tcp://127.0.0.1:50002\n"
        "  qwen-2-7b   127.0.0.1:40004  events tcp://127.0.0.1:50003\n"
    ) in text
    assert "Gateway URL: http://127.0.0.1:8080\n" in text
    assert "Envoy admin: http://127.0.0.1:9901 (pid 4242)" in text
    assert "http://127.0.0.1:5555/metrics" in text
    assert "Body mode: BUFFERED" in text
    assert "by itself after 30 s" in text
    assert "  chat -> meta-llama/Meta-Llama-3-8B-Instruct (3 endpoints)\n" in text
    assert "  qwen -> Qwen/Qwen2-7B-Instruct (1 endpoint)\n" in text
    for command in curl_examples(intro.url, MODELS):
        assert f"  {command}\n" in text
    forever = render_intro(Intro("http://u", "http://a", None, "http://m", "FULL_DUPLEX_STREAMED", MODELS))
    assert "stop: Ctrl-C\n" in forever and "pid" not in forever
    assert "Engines" not in forever


@pytest.mark.parametrize(
    ("hits", "queries", "expected"),
    [(0, 0, "-"), (0, 10, "0%"), (2, 3, "67%"), (10, 10, "100%"), (11, 10, "100%")],
)
def test_hit_rate(hits: int, queries: int, expected: str) -> None:
    assert hit_rate(hits, queries) == expected


@pytest.mark.parametrize(
    ("fraction", "expected"),
    [(0.0, "0.0%"), (0.0131, "1.3%"), (0.5, "50.0%"), (1.0, "100.0%"), (-1.0, "0.0%")],
)
def test_kv_usage(fraction: float, expected: str) -> None:
    assert kv_usage(fraction) == expected


def test_curl_examples_are_valid_shell_and_json() -> None:
    """Copy-pasted into a shell, each example is one command whose -d payload is valid JSON."""
    import json
    import shlex

    chat, stream, models = curl_examples("http://127.0.0.1:8080", MODELS)
    for command, alias, streamed in ((chat, "chat", False), (stream, "qwen", True)):
        words = shlex.split(command)
        assert words[:3] == ["curl", "-sN" if streamed else "-s", "http://127.0.0.1:8080/v1/chat/completions"]
        payload = json.loads(words[words.index("-d") + 1])
        assert payload["model"] == alias
        assert payload.get("stream", False) is streamed
        assert payload["messages"][0]["role"] == "user"
    assert shlex.split(models) == ["curl", "-s", "http://127.0.0.1:8080/v1/models"]
