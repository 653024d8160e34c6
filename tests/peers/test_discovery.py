"""Peers from a Service's EndpointSlices: its port named ``peer``, every replica but this one."""

from __future__ import annotations

from typing import Any

from extproc.peers.discovery import peer_addresses, worker_ports


def slice_(ports: list[dict[str, Any]], *endpoints: tuple[str, dict[str, bool]]) -> dict[str, Any]:
    return {"ports": ports, "endpoints": [{"addresses": [ip], "conditions": c} for ip, c in endpoints]}


def test_every_replica_but_this_one_on_the_peer_port() -> None:
    slices = [
        slice_(
            [{"name": "grpc", "port": 9002}, {"name": "peer", "port": 9003}],
            ("10.0.0.5", {"ready": True}),
            ("10.0.0.6", {"ready": False}),  # starting or draining: it still holds leases
            ("10.0.0.7", {"ready": False, "serving": False, "terminating": True}),  # gone
            ("fd00::8", {"ready": True}),
        ),
        slice_([{"port": 9003}], ("10.0.0.9", {})),  # a single unnamed port will do
        slice_([{"name": "grpc", "port": 9002}, {"name": "metrics", "port": 9090}], ("10.0.0.10", {})),
    ]
    assert peer_addresses(slices, own="10.0.0.5:9003") == ("10.0.0.6:9003", "10.0.0.9:9003", "[fd00::8]:9003")


def test_slices_without_usable_ports_or_endpoints_give_nothing() -> None:
    assert peer_addresses([{"ports": None, "endpoints": None}, {}], own="x") == ()


def test_each_replica_stands_for_its_workers_ports_and_this_worker_is_left_out() -> None:
    replicas = ["10.0.0.5:9003", "10.0.0.6:9003", "[fd00::7]:9003"]
    assert worker_ports(replicas, 3, own="10.0.0.5:9004") == (
        "10.0.0.5:9003",
        "10.0.0.5:9005",
        "10.0.0.6:9003",
        "10.0.0.6:9004",
        "10.0.0.6:9005",
        "[fd00::7]:9003",
        "[fd00::7]:9004",
        "[fd00::7]:9005",
    )
    # One worker per replica (no --workers): the replicas themselves, this one left out if listed.
    assert worker_ports(["10.0.0.6:9003", "10.0.0.5:9003"], 1, own="10.0.0.5:9003") == ("10.0.0.6:9003",)


def test_a_replica_bound_to_every_interface_is_followed_on_loopback() -> None:
    assert worker_ports(["0.0.0.0:9003"], 2, own="0.0.0.0:9003") == ("127.0.0.1:9004",)
