"""host:port strings as flags give them and as Envoy, ZMQ and URLs want them."""

from __future__ import annotations

import pytest

from extproc.addresses import join_host_port, parse_host_port
from extproc.errors import ConfigError


@pytest.mark.parametrize(
    ("host", "port", "joined"),
    [("10.0.0.5", 8000, "10.0.0.5:8000"), ("fd00::5", 9003, "[fd00::5]:9003"), ("pod.ns", 80, "pod.ns:80")],
)
def test_join_brackets_ipv6_hosts_and_parse_reads_them_back(host: str, port: int, joined: str) -> None:
    assert join_host_port(host, port) == joined
    assert parse_host_port(joined, what="--listen") == (host, port)


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("9002", "expected HOST:PORT"),
        (":9002", "expected HOST:PORT"),
        ("127.0.0.1:http", "is not a number"),
        ("127.0.0.1:70000", "out of range"),
    ],
)
def test_a_bad_address_is_refused_naming_the_flag(value: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says) as refused:
        parse_host_port(value, what="--peer-listen")
    assert str(refused.value).startswith("--peer-listen: ")
