"""The messages ``serve`` replicas send each other about their leases, and their checks.

msgpack (msgspec), one message per ZMQ frame. A message is checked for size before anything of it is
used, so memory stays bounded whatever a peer sends: :func:`decode` refuses it with a
:class:`PeerMessageError` naming the limit. What the messages mean is :mod:`extproc.control.peers`;
the transport is :mod:`extproc.peers`.
"""

from __future__ import annotations

import msgspec

#: Leases one peer may hold in our view; a snapshot or delta beyond it is refused.
MAX_PEER_LEASES = 65_536
#: Approximate-affinity chunk keys one message may carry (a feed sends no more; a peer's are refused).
MAX_AFFINITY_KEYS = 262_144
#: Longest endpoint or model name a lease may carry.
_MAX_TEXT = 512

#: (number, endpoint, model, prefill tokens, seconds of prefill left) of one lease.
WireLease = tuple[int, str, str, int, float]


#: (owner, number) of a lease: another replica's, held by the sender's accounting stream.
WireKey = tuple[str, int]


class Snapshot(msgspec.Struct, tag="snapshot", frozen=True):
    """Every lease the sender holds now (also its heartbeat), and the other replicas' leases its
    accounting streams hold (so a lost "ended" is healed too)."""

    owner: str
    seq: int
    sent_at: float
    leases: list[WireLease]
    held: list[WireKey] = msgspec.field(default_factory=list)


class Delta(msgspec.Struct, tag="delta", frozen=True):
    """Leases the sender took and ended since its last message; other replicas' leases its
    accounting streams took over (``adopted``) and whose requests ended there (``ended``)."""

    owner: str
    seq: int
    sent_at: float
    added: list[WireLease]
    removed: list[int]
    adopted: list[WireKey] = msgspec.field(default_factory=list)
    ended: list[WireKey] = msgspec.field(default_factory=list)
    #: The sender's leases whose response began: their prefill is over.
    started: list[int] = msgspec.field(default_factory=list)
    #: Approximate prefix affinity the sender learned: (prompt chunk keys, the endpoint sent them).
    affinity: list[tuple[list[int], str]] = msgspec.field(default_factory=list)


Message = Snapshot | Delta
_DECODER = msgspec.msgpack.Decoder(Message)
_ENCODER = msgspec.msgpack.Encoder()


class PeerMessageError(ValueError):
    """A peer's message that cannot be used; the message says why."""


def decode(frame: bytes) -> Message:
    """A peer's message, checked for size; raises :class:`PeerMessageError`."""
    try:
        message: Message = _DECODER.decode(frame)
    except msgspec.DecodeError as exc:
        raise PeerMessageError(f"not a peer message: {exc}") from None
    if not 0 < len(message.owner) <= 64:
        raise PeerMessageError("owner must be 1-64 characters")
    leases = message.leases if isinstance(message, Snapshot) else message.added
    keys = message.held if isinstance(message, Snapshot) else [*message.adopted, *message.ended]
    removed = [] if isinstance(message, Snapshot) else [*message.removed, *message.started]
    if max(len(leases), len(removed), len(keys)) > MAX_PEER_LEASES:
        raise PeerMessageError(f"more than {MAX_PEER_LEASES} leases in one message")
    if any(len(owner) > 64 for owner, _ in keys):
        raise PeerMessageError("a lease owner over 64 characters")
    affinity = [] if isinstance(message, Snapshot) else message.affinity
    if sum(len(chunks) for chunks, _ in affinity) > MAX_AFFINITY_KEYS:
        raise PeerMessageError(f"more than {MAX_AFFINITY_KEYS} affinity keys in one message")
    if any(len(endpoint) > _MAX_TEXT for _, endpoint in affinity):
        raise PeerMessageError(f"an affinity endpoint over {_MAX_TEXT} characters")
    for _number, endpoint, model, _tokens, _seconds in leases:
        if len(endpoint) > _MAX_TEXT or len(model) > _MAX_TEXT:
            raise PeerMessageError(f"an endpoint or model name over {_MAX_TEXT} characters")
    return message


def encode(message: Message) -> bytes:
    return _ENCODER.encode(message)


def split_token(token: str) -> WireKey | None:
    """``(owner, number)`` of a lease token (``OWNER-NUMBER``), None when it is not one."""
    owner, _, number = token.rpartition("-")
    if not owner or len(owner) > 64 or not number.isdigit():
        return None
    return owner, int(number)
