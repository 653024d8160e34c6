"""The fleet benchmark's fake engines: a real-size page serve reads as an SGLang engine's load."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from fleet import PAGE_BYTES, KvPlan, addresses, engine_page, kv_events

from extproc.engines.metrics_page import parse_signals


def test_the_fake_engines_page_is_a_real_pages_size_and_reads_as_sglang_load() -> None:
    """serve's scraper finds the SGLang series in the padded page: 3 running, 1 waiting, 42% used."""
    page = engine_page("m")
    assert PAGE_BYTES <= len(page) < PAGE_BYTES + 4_000
    signals = parse_signals(page)
    assert (signals.running, signals.waiting) == (3, 1)
    assert signals.kv_cache_usage is not None and abs(signals.kv_cache_usage - 0.42) < 0.01


def test_a_thousand_endpoints_get_a_thousand_loopback_addresses() -> None:
    """Each endpoint of a large pool has its own 127.x address, so serve sees distinct pods."""
    pool = addresses(1000, 8000)
    assert len(set(pool)) == 1000
    assert all(a.startswith("127.0.") and a.endswith(":8000") for a in pool)


def test_precise_mode_announces_the_chat_prompt_on_one_endpoint_in_ten() -> None:
    """The fake publishers' events are valid KV events: every endpoint its random blocks, one in
    ten the load's prompt blocks too, so serve's lookups find holders."""
    plan = KvPlan(port=9000, prompt_ids=tuple(range(40)), blocks_per_engine=3)
    holder = kv_events("127.0.0.1:8000", 0, plan)
    other = kv_events("127.0.0.2:8000", 1, plan)
    assert [len(e.block_hashes) for e in holder] == [3, 2] and [len(e.block_hashes) for e in other] == [3]
    assert holder[1].token_ids == tuple(range(32))
    assert all(len(e.token_ids) == len(e.block_hashes) * e.block_size for e in holder + other)
    assert holder[0].block_hashes != other[0].block_hashes
