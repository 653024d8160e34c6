"""Reading the local serve's /debug/worker-sets: the parser, and the watcher against a real serve."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from waiting import eventually

from extproc.reconcile.serve_state import (
    ModelView,
    RouterView,
    ServeStateError,
    ServeWatcher,
    parse_router_view,
)
from extproc.serve.app import Server
from extproc.settings import ServeSettings, SourceSettings

DATA = Path(__file__).resolve().parents[1] / "data" / "catalog.yaml"


def test_an_answer_that_is_no_object_is_an_error() -> None:
    """An answer that is not a JSON object of sets is told apart from one with no sets."""
    with pytest.raises(ServeStateError, match="worker-sets"):
        parse_router_view([])
    assert parse_router_view({}) == RouterView({})


def test_fields_of_the_wrong_shape_are_dropped() -> None:
    """Junk in one field does not lose the rest of the set."""
    document: dict[str, Any] = {
        "ns/a": {
            "endpoints": {"ready": 3, "terminating": "two"},
            "models": [
                {"upstreamName": "m", "readyEndpoints": True, "contextWindow": {"min": 1, "max": "x"}},
                {"aliases": ["nameless"]},
                "junk",
            ],
            "kvEvents": [],
            "problems": ["p", 7],
        },
        "ns/b": "junk",
    }
    view = parse_router_view(document)
    assert list(view.sets) == ["ns/a"]
    a = view.sets["ns/a"]
    assert (a.ready_endpoints, a.terminating_endpoints, a.kv_subscribed) == (3, 0, 0)
    assert a.models == (ModelView("m"),)
    assert a.problems == ("p",)


async def test_the_watcher_reads_a_real_serve_and_notices_it_going_away() -> None:
    """What serve routes arrives typed; a stopped serve makes the view None after failed polls."""
    settings = ServeSettings(
        source=SourceSettings.parse(f"file:{DATA}"), listen="127.0.0.1:0", admin_listen="127.0.0.1:0"
    )
    changes: list[int] = []
    server = Server(settings)
    await server.start()
    watcher = ServeWatcher(
        f"http://127.0.0.1:{server.admin_port}", on_change=lambda: changes.append(1), interval=0.05
    )
    watcher.start()
    try:
        await eventually(lambda: watcher.view is not None)
        assert watcher.view is not None
        llama = watcher.view.sets["default/llama-3-8b"]
        assert llama.ready_endpoints == 2
        assert llama.models == (ModelView("meta-llama/Meta-Llama-3-8B-Instruct", ("chat",), 2),)
        assert llama.kv_subscribed == 0  # nothing publishes on the catalog's KV ports
        qwen = watcher.view.sets["default/qwen-2-7b"]
        assert (qwen.ready_endpoints, qwen.terminating_endpoints) == (1, 1)
        assert changes
        await server.stop()
        await eventually(lambda: watcher.view is None)
        assert watcher.error is not None and "Connect" in watcher.error
    finally:
        await watcher.close()
        await server.stop()
