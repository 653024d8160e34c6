"""The demo's catalog writer: the objects it writes go through the file source's own parser."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from extproc.catalog.model import Catalog
from extproc.demo.catalog import LocalWorkerSet, catalog_documents, catalog_yaml, kv_ports_of
from extproc.kvindex.follow import plan_sources
from extproc.sources.file import compile_documents

MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"
A, B, C = "127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8003"


def load(sets: list[LocalWorkerSet]) -> Catalog:
    """What ``serve --source file:`` builds from the YAML the demo writes."""
    return compile_documents(catalog_yaml(sets).encode(), {}, path=Path("catalog.yaml")).catalog


def test_without_kv_ports_nothing_about_kv_events_is_written() -> None:
    docs = catalog_documents([LocalWorkerSet("llama", MODEL, [A, B], aliases=("chat",))])
    assert [d["kind"] for d in docs] == ["InferenceWorkerSet", "Service", "EndpointSlice", "EndpointSlice"]
    assert "kvEvents" not in docs[0]["spec"]
    assert docs[1]["spec"]["ports"] == [{"name": "http", "port": 80, "protocol": "TCP"}]
    assert [d["ports"] for d in docs[2:]] == [
        [{"name": "http", "port": 8001, "protocol": "TCP"}],
        [{"name": "http", "port": 8002, "protocol": "TCP"}],
    ]
    catalog = load([LocalWorkerSet("llama", MODEL, [A, B], aliases=("chat",))])
    [ws] = catalog.worker_sets.values()
    assert ws.problems == ()
    assert [(e.address, e.kv_events_port, e.kv_replay_port) for e in ws.endpoints] == [
        (A, None, None),
        (B, None, None),
    ]
    assert plan_sources(catalog) == {}


def test_kv_ports_become_named_slice_ports_and_spec_kv_events() -> None:
    ws = LocalWorkerSet("llama", MODEL, [A, B], kv_ports={A: (5557, 5558), B: (6001, 6002)})
    docs = catalog_documents([ws])
    assert docs[0]["spec"]["kvEvents"] == {"port": "kv", "replayPort": "kv-replay"}
    assert [p["name"] for p in docs[1]["spec"]["ports"]] == ["http", "kv", "kv-replay"]
    assert docs[3]["ports"] == [
        {"name": "http", "port": 8002, "protocol": "TCP"},
        {"name": "kv", "port": 6001, "protocol": "TCP"},
        {"name": "kv-replay", "port": 6002, "protocol": "TCP"},
    ]
    catalog = load([ws])
    [built] = catalog.worker_sets.values()
    assert built.problems == ()
    # Each endpoint resolves its own numbers through the names, as pods of a cluster would.
    assert [(e.address, e.kv_events_port, e.kv_replay_port) for e in built.endpoints] == [
        (A, 5557, 5558),
        (B, 6001, 6002),
    ]
    plans = plan_sources(catalog)
    assert {str(s): (p.target.pub_address, p.target.replay_address) for s, p in plans.items()} == {
        f"{A}/dp0": ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"),
        f"{B}/dp0": ("tcp://127.0.0.1:6001", "tcp://127.0.0.1:6002"),
    }
    assert {p.namespace for p in plans.values()} == {MODEL}
    assert {p.block_size for p in plans.values()} == {16}


def test_an_endpoint_without_replay_falls_back_by_port_name() -> None:
    """``replayPort`` is left out, so the CRD's fallback (a port named kv-replay) applies per slice."""
    ws = LocalWorkerSet("llama", MODEL, [A, B], kv_ports={A: (5557, 5558), B: (6001, None)})
    assert catalog_documents([ws])[0]["spec"]["kvEvents"] == {"port": "kv"}
    [built] = load([ws]).worker_sets.values()
    assert built.problems == ()
    assert [(e.kv_events_port, e.kv_replay_port) for e in built.endpoints] == [(5557, 5558), (6001, None)]


def test_an_endpoint_left_out_of_kv_ports_is_a_catalog_problem_but_still_routed() -> None:
    ws = LocalWorkerSet("llama", MODEL, [A, B], kv_ports={A: (5557, 5558)}, not_ready=[C])
    [built] = load([ws]).worker_sets.values()
    assert [(e.address, e.kv_events_port) for e in built.endpoints] == [(A, 5557), (B, None)]
    assert any('"kv" is not a port name of EndpointSlice default/llama-1' in p for p in built.problems)


def test_not_ready_endpoints_may_carry_kv_ports_and_are_never_followed() -> None:
    ws = LocalWorkerSet("llama", MODEL, [A], kv_ports={A: (5557, 5558), C: (7001, 7002)}, not_ready=[C])
    catalog = load([ws])
    assert [str(s) for s in plan_sources(catalog)] == [f"{A}/dp0"]


def test_kv_ports_for_an_unknown_endpoint_are_refused() -> None:
    with pytest.raises(ValueError, match=r"unknown endpoints \['127.0.0.1:9999'\]"):
        LocalWorkerSet("llama", MODEL, [A], kv_ports={"127.0.0.1:9999": (5557, None)})


def test_yaml_round_trips() -> None:
    sets = [
        LocalWorkerSet("llama", MODEL, [A], kv_ports={A: (5557, 5558)}),
        LocalWorkerSet("qwen", "qwen", [B]),
    ]
    assert list(yaml.safe_load_all(catalog_yaml(sets))) == catalog_documents(sets)


@pytest.mark.parametrize(
    ("pub", "replay", "expected"),
    [
        ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", (5557, 5558)),
        ("tcp://127.0.0.1:5557", None, (5557, None)),
        ("tcp://127.0.0.1:5557", "", (5557, None)),
    ],
)
def test_kv_ports_of_zmq_endpoints(pub: str, replay: str | None, expected: tuple[int, int | None]) -> None:
    assert kv_ports_of(pub, replay) == expected
