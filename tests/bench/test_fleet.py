"""The fleet benchmark's fake engines: a real-size page serve reads as an SGLang engine's load."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from fleet import PAGE_BYTES, addresses, engine_page

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
