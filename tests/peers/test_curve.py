"""Peer sync with a shared CURVE key (``--peer-key-file``), over real ZMQ sockets on loopback."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import zmq
import zmq.asyncio
from waiting import until

from extproc.control.load import Lease, LoadView
from extproc.control.peer_messages import decode
from extproc.control.peers import LeaseFeed, PeerLeases
from extproc.errors import ConfigError
from extproc.peers.curve import CurveKey, new_secret, parse_key, read_key
from extproc.peers.sync import PeerSync
from extproc.tasks import cancel_and_wait
from extproc.types import EndpointAddress


@contextlib.asynccontextmanager
async def replica(
    owner: str, peers: tuple[str, ...], key: CurveKey | None
) -> AsyncIterator[tuple[PeerLeases, int, PeerSync]]:
    """A replica's peer sync holding one lease (on 10.0.0.1:8000), bound on a free loopback port:
    what it hears of its peers, its port and its sync."""
    load = LoadView()
    load.add(Lease(owner, 1, EndpointAddress("10.0.0.1:8000")))
    heard = PeerLeases(load, peers)
    sync = PeerSync("127.0.0.1:0", LeaseFeed(owner, lambda: load.leases(owner)), heard, curve=key)
    port = sync.bind()
    task = asyncio.create_task(sync.run())
    try:
        yield heard, port, sync
    finally:
        await cancel_and_wait(task)


async def first_frame(
    port: int, key: CurveKey | None, server_key: bytes | None, within: float
) -> bytes | None:
    """What a bare SUB (a CURVE client with ``key`` when given) receives from the port, if anything."""
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    if key is not None and server_key is not None:
        sub.curve_serverkey, sub.curve_publickey, sub.curve_secretkey = server_key, key.public, key.secret
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        return await asyncio.wait_for(sub.recv(), within)
    except TimeoutError:
        return None
    finally:
        sub.close(linger=0)
        ctx.term()


async def test_replicas_with_the_same_key_hear_each_other_and_nobody_else_reads_them() -> None:
    key = parse_key(new_secret(), what="test")
    async with (
        replica("a", (), key) as (_, port, a_sync),
        replica("b", (f"127.0.0.1:{port}",), key) as (heard, _, _),
    ):

        async def a_lease_seen() -> bool:
            state = heard.debug_state()[0]
            return bool(state["connected"]) and state["leases"] == {"10.0.0.1:8000": 1}

        await until(a_lease_seen, within=5, what="B hearing A's lease")
        # A holder of the key reads A's snapshots (so the silence below is the key's doing) ...
        frame = await first_frame(port, key, key.public, within=3)
        assert frame is not None and decode(frame).owner == "a"
        # ... a plain subscriber reads nothing, nor one with another key that knows A's public key.
        assert await first_frame(port, None, None, within=1.5) is None
        other = parse_key(new_secret(), what="test")
        assert await first_frame(port, other, key.public, within=1.5) is None
        assert a_sync.refused_subscribers >= 1, "the one with another key was refused by the handler"


async def test_a_replica_without_the_key_is_not_heard() -> None:
    key = parse_key(new_secret(), what="test")
    async with (
        replica("plain", (), None) as (_, port, _),
        replica("keyed", (f"127.0.0.1:{port}",), key) as (heard, _, _),
    ):
        await asyncio.sleep(1.5)  # three snapshots' time
        assert not heard.connected(f"127.0.0.1:{port}")


def test_a_bad_key_file_is_refused_with_its_name(tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.write_text("abc\n")
    with pytest.raises(
        ConfigError, match=r"--peer-key-file .*short: a CURVE secret key is 40 Z85 characters"
    ):
        read_key(short)
    with pytest.raises(ConfigError, match="cannot read"):
        read_key(tmp_path / "missing")
    good = tmp_path / "key"
    good.write_text(new_secret() + "\n")  # a trailing newline, as `extproc peer-key > key` leaves
    assert len(read_key(good).public) == 40
