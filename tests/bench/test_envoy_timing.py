"""Envoy's own timing of the routing decision, which ``bench/long_prompts.py`` reports: real serve,
real Envoy from the shipped config, real fake engines."""

from __future__ import annotations

from pathlib import Path

import pytest
from envoy_timing import TimedGateway, parse_log
from ports import free_port
from stack import MODEL, ServeProcess


def chat(words: str) -> bytes:
    return f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "{words}"}}]}}'.encode()


async def test_every_request_is_logged_with_its_kind_and_envoys_decision_time(
    tmp_path: Path, serve_two_endpoints: tuple[ServeProcess, list[str]]
) -> None:
    serve, endpoints = serve_two_endpoints
    gateway = TimedGateway(tmp_path, serve.grpc_port, endpoints, free_port(), free_port())
    async with gateway:
        for kind in ("short", "long", "short"):
            await gateway.post(kind, chat("the quick brown fox " * (1 if kind == "short" else 200)))
    timings = gateway.timings()
    assert [t.kind for t in timings] == ["short", "long", "short"]
    assert all(t.status == 200 for t in timings)
    # Envoy timed serve's answer to the request headers (the decision) and to the response's headers.
    assert all(t.decision_us > 0 and t.response_headers_us is not None for t in timings)
    assert sorted(gateway.round_trips) == ["long", "short"]
    assert len(gateway.round_trips["short"]) == 2


def test_a_log_line_in_another_shape_is_refused_with_the_line() -> None:
    assert parse_log("next_turn 812 301 200\ncold 9120 - 503\n")[1].response_headers_us is None
    with pytest.raises(ValueError, match="unexpected access log line 'next_turn - - 500'"):
        parse_log("next_turn - - 500\n")
