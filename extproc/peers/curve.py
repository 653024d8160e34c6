"""Optional CURVE encryption and authentication of peer sync (``--peer-key-file``).

Every replica holds the same CURVE secret key (a Kubernetes Secret mounted as a file). Each PUB is
a CURVE server with that key, and accepts a subscriber only if it proves it holds it too (a ZAP
handler that allows exactly the matching public key); each SUB is a CURVE client with the same key
that checks the server's. So without the key nobody can read a replica's leases, nor pass for a
peer at a configured address; and the traffic is encrypted on the wire. Without a key file, peer
sync is plain ZMQ protected by the bind address and the network (see :mod:`extproc.peers.sync`).

A key is 40 characters of Z85 (32 bytes); ``extproc peer-key`` prints a new one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

from extproc.errors import ConfigError
from extproc.telemetry import LogLimiter

log = logging.getLogger(__name__)
#: Length of a Z85-encoded CURVE key.
KEY_CHARS = 40


@dataclass(frozen=True, slots=True)
class CurveKey:
    """The replicas' shared CURVE key pair (Z85 bytes)."""

    secret: bytes
    public: bytes


def new_secret() -> str:
    """A fresh secret key, Z85 (what ``extproc peer-key`` prints)."""
    return zmq.curve_keypair()[1].decode()


def parse_key(text: str, *, what: str) -> CurveKey:
    """The key pair of a Z85 secret key; a ConfigError naming ``what`` when it is not one."""
    secret = text.strip().encode()
    if len(secret) != KEY_CHARS:
        raise ConfigError(f"{what}: a CURVE secret key is {KEY_CHARS} Z85 characters, got {len(secret)}")
    try:
        public = zmq.curve_public(secret)
    except (zmq.ZMQError, ValueError) as exc:
        raise ConfigError(f"{what}: not a Z85 CURVE secret key ({exc})") from None
    return CurveKey(secret, public)


def read_key(path: Path) -> CurveKey:
    """The key pair in the file at ``path`` (``--peer-key-file``)."""
    if not zmq.has("curve"):
        raise ConfigError("--peer-key-file: this libzmq was built without CURVE support")
    try:
        text = path.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--peer-key-file: cannot read {path}: {exc}") from None
    return parse_key(text, what=f"--peer-key-file {path}")


class _SameKey:
    """ZAP credentials: a subscriber is allowed when its public key is the replicas' own."""

    def __init__(self, public: bytes) -> None:
        self._public = public
        self.refused = 0
        self._log: LogLimiter[str] = LogLimiter(time.monotonic)

    def callback(self, _domain: str, client_key: bytes) -> bool:
        allowed = client_key == self._public
        if not allowed:
            self.refused += 1
            if self._log.allow("subscriber", "key"):
                log.warning("peer subscriber refused: it does not hold the peer key (counted from now on)")
        return allowed


class CurveGuard:
    """Sets a context's peer sockets up for CURVE, and runs its ZAP handler while started."""

    def __init__(self, ctx: zmq.asyncio.Context, key: CurveKey) -> None:
        self._key = key
        self._auth = AsyncioAuthenticator(ctx)
        self._credentials = _SameKey(key.public)

    @property
    def refused(self) -> int:
        """Subscribers refused for not holding the key."""
        return self._credentials.refused

    def start(self) -> None:
        self._auth.start()
        self._auth.configure_curve_callback("*", credentials_provider=self._credentials)

    def stop(self) -> None:
        self._auth.stop()

    def server(self, socket: zmq.asyncio.Socket) -> None:
        """``socket`` (a PUB, before it binds) serves only holders of the key."""
        socket.curve_secretkey = self._key.secret
        socket.curve_publickey = self._key.public
        socket.curve_server = True

    def client(self, socket: zmq.asyncio.Socket) -> None:
        """``socket`` (a SUB, before it connects) proves it holds the key and checks the server's."""
        socket.curve_serverkey = self._key.public
        socket.curve_publickey = self._key.public
        socket.curve_secretkey = self._key.secret
