"""The live view's text, from snapshots alone: no terminal, no servers, no clock."""

from __future__ import annotations

import pytest

from extproc.demo.view import (
    CLEAR,
    EndpointRow,
    Intro,
    ModelLine,
    Snapshot,
    TrafficStats,
    curl_examples,
    render_frame,
    render_intro,
    render_line,
    render_table,
    share_bar,
)

ROWS = (
    EndpointRow("llama-3-8b", "127.0.0.1:40001", "llama-3-8b-1", 10, 1),
    EndpointRow("llama-3-8b", "127.0.0.1:40002", "llama-3-8b-2", 30, 0),
    EndpointRow("llama-3-8b", "127.0.0.1:40003", "llama-3-8b-3", 0, 2),
    EndpointRow("qwen-2-7b", "127.0.0.1:40004", "qwen-2-7b-1", 5, 0),
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


def test_table_shows_every_endpoint_with_counts_and_share_of_its_set() -> None:
    assert render_table(SNAPSHOT) == (
        "extproc demo  up 01:02:05  gateway http://127.0.0.1:8080  sample traffic: 50 sent, 49 ok, 1 failed\n"
        "\n"
        "worker set  endpoint         backend       served  in flight  share of set\n"
        "----------  ---------------  ------------  ------  ---------  -------------------------\n"
        "llama-3-8b  127.0.0.1:40001  llama-3-8b-1      10          1   25% #####...............\n"
        "llama-3-8b  127.0.0.1:40002  llama-3-8b-2      30          0   75% ###############.....\n"
        "llama-3-8b  127.0.0.1:40003  llama-3-8b-3       0          2    0% ....................\n"
        "qwen-2-7b   127.0.0.1:40004  qwen-2-7b-1        5          0  100% ####################\n"
        "total                                          45          3\n"
        "\n"
        "router outcomes: routed 46  answered 3  no_ready_endpoint 3\n"
    )


def test_table_before_any_traffic_says_so_and_has_no_traffic_part() -> None:
    rows = tuple(EndpointRow(r.worker_set, r.address, r.backend, 0, 0) for r in ROWS)
    text = render_table(Snapshot("http://127.0.0.1:8080", 0.0, rows))
    assert "router outcomes: none yet" in text
    assert "sample traffic" not in text
    # No division by zero, and the share column says "nothing yet" rather than 0%.
    assert "   - ...................." in text
    assert all(line == line.rstrip() for line in text.splitlines())


def test_table_columns_line_up_with_long_names() -> None:
    rows = (EndpointRow("a-very-long-worker-set-name", "[::1]:8000", "b", 1234567, 12),)
    lines = render_table(Snapshot("http://x", 1, rows)).splitlines()
    header, rule, row = lines[2], lines[3], lines[4]
    assert len(rule) == len(row) >= len(header)
    # Numbers are right-aligned under their (right-aligned) headers.
    assert row.index("1234567") + len("1234567") == header.index("served") + len("served")


def test_one_line_summary_for_logs() -> None:
    assert render_line(SNAPSHOT) == (
        "demo t=01:02:05 served=45 in_flight=3 llama-3-8b=[10/30/0] qwen-2-7b=[5] "
        "outcomes: routed=46 answered=3 no_ready_endpoint=3 traffic: sent=50 ok=49 failed=1"
    )
    quiet = render_line(Snapshot("http://x", 0, ROWS[:1]))
    assert quiet == "demo t=00:00:00 served=10 in_flight=1 llama-3-8b=[10] outcomes: none"
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
    )
    text = render_intro(intro)
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
