"""Cluster authentication of the ZMQ planes, derived from the cluster token.

The request plane (gateway -> worker) and the KV plane's bootstrap channel
(decode -> prefill) run ZMQ CURVE with one key pair per plane side derived
from the cluster token: a peer that does not hold the token cannot compute the
server's public key, so its handshake fails inside libzmq and none of its
messages reach the application; the traffic is encrypted as well. CURVE also
authenticates the server to the client (it proves it holds the secret key),
so a worker only talks to a real peer of its cluster.

The server's public key is never published (it is derived, not exchanged), so
no ZAP handler is needed: knowing it is knowing the token.

Without a token everything stays plaintext and open (``keys_for(None)`` is
None): a worker refuses that unless it listens on loopback only.

Torch-free.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

import zmq
from zmq.utils import z85

_LABEL = b"disagg-serve/curve/v1/"


def _derive(token: str, purpose: str) -> bytes:
    """A Z85 CURVE secret key for ``purpose`` from the token (one-way)."""
    raw = hmac.new(token.encode(), _LABEL + purpose.encode(), hashlib.sha256).digest()
    return z85.encode(raw)


@dataclass(frozen=True)
class ClusterKeys:
    """The CURVE keys of one cluster token (Z85, as pyzmq takes them)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def from_token(cls, token: str) -> ClusterKeys:
        if not token:
            raise ValueError("the cluster token must not be empty")
        server_secret = _derive(token, "server")
        client_secret = _derive(token, "client")
        return cls(
            server_public=zmq.curve_public(server_secret),
            server_secret=server_secret,
            client_public=zmq.curve_public(client_secret),
            client_secret=client_secret,
        )

    def serve(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before bind) accept only peers holding the token."""
        sock.curve_secretkey = self.server_secret
        sock.curve_publickey = self.server_public
        sock.curve_server = True

    def connect(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before connect) talk only to a server holding the token."""
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.client_public
        sock.curve_secretkey = self.client_secret


def keys_for(token: str | None) -> ClusterKeys | None:
    """The keys of ``token``; None (plaintext, open) without one."""
    return ClusterKeys.from_token(token) if token else None


def secure_server(sock: zmq.Socket, keys: ClusterKeys | None) -> None:
    if keys is not None:
        keys.serve(sock)


def secure_client(sock: zmq.Socket, keys: ClusterKeys | None) -> None:
    if keys is not None:
        keys.connect(sock)


LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a socket reachable from this machine only."""
    return host in LOOPBACK_HOSTS or host.startswith("127.")
