"""Fixtures for the benchmarks' own tests: a real serve, started as the benchmarks start it."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from ports import free_port
from stack import MODEL, ServeProcess

from extproc.demo.catalog import LocalWorkerSet, catalog_yaml


@pytest.fixture
async def serve_two_endpoints(tmp_path: Path) -> AsyncIterator[tuple[ServeProcess, list[str]]]:
    """serve (``bench/stack.py``) routing the benchmarks' model to two endpoints on free loopback
    ports, where nothing listens; with those endpoints. Stopped afterwards."""
    endpoints = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    catalog = tmp_path / "catalog.yaml"
    catalog.write_text(catalog_yaml([LocalWorkerSet("bench", MODEL, endpoints)]))
    serve = ServeProcess(catalog)
    await serve.start()
    try:
        yield serve, endpoints
    finally:
        await serve.stop()
