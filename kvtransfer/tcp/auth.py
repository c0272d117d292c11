"""Authentication of the tcp data channel with the cluster token.

With a cluster token, every connection must first prove it holds the token
before the receiver takes a transfer message from it: the writer sends
``Hello(writer)``, the receiver answers ``Challenge(nonce)`` (fresh per
connection), the writer answers ``Auth(HMAC(token, nonce, writer))`` and gets
``Welcome``. Transfer messages of a connection that did not pass (a rogue
writer, even one that learnt the receiver's metadata) are refused unwritten.
The receiver tells connections apart by their ZMQ routing ids, which it
assigns itself per connection, so a reconnect must authenticate again.

This module owns the receiver's side of the handshake (which connections were
challenged and which passed) and the writer's answer to a challenge; the I/O
loop (``kvtransfer.tcp.loop``) carries the messages.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict

from kvtransfer.compat import sign, verify
from kvtransfer.tcp.frames import _Auth, _Challenge, _Hello, _Reply, _Welcome

logger = logging.getLogger(__name__)

_AUTH_LABEL = "kvtcp-auth-v1"
_MAX_REMEMBERED_CONNECTIONS = 4096
"""Connections remembered as challenged, and as authenticated; the oldest are
forgotten first (a forgotten connection is refused and re-authenticates)."""


class _ReceiverAuth:
    """The receiver's side of the handshake: which connections (ZMQ routing
    ids) it challenged, and which proved they hold ``token``.

    Args:
        agent_name: the receiving agent (for log lines).
        token: the cluster token (None: no handshake, every connection admitted).
    """

    def __init__(self, agent_name: str, token: str | None) -> None:
        self.agent_name = agent_name
        self.token = token
        # connection (routing id) -> its challenge, until it authenticates
        self.nonces: OrderedDict[bytes, tuple[str, str]] = OrderedDict()
        self.authed: OrderedDict[bytes, None] = OrderedDict()

    def admits(self, ident: bytes) -> bool:
        """Whether transfer messages of connection ``ident`` may be taken."""
        return self.token is None or ident in self.authed

    def answer(self, ident: bytes, msg: _Hello | _Auth) -> _Challenge | _Welcome | _Reply:
        """The reply to a handshake message from connection ``ident``."""
        token = self.token
        if isinstance(msg, _Hello):
            if token is None:
                return _Welcome()
            nonce = os.urandom(16).hex()
            self.nonces[ident] = (nonce, msg.writer)
            while len(self.nonces) > _MAX_REMEMBERED_CONNECTIONS:
                self.nonces.popitem(last=False)
            return _Challenge(nonce)
        pending = self.nonces.pop(ident, None)
        if token is None or (pending is not None and verify(token, msg.mac, _AUTH_LABEL, *pending)):
            self.authed[ident] = None
            while len(self.authed) > _MAX_REMEMBERED_CONNECTIONS:
                self.authed.popitem(last=False)
            return _Welcome()
        logger.warning("%s: a writer failed the cluster-token handshake", self.agent_name)
        return _Reply(-1, 0, "refused: cluster token mismatch", True)


def _answer_challenge(token: str | None, challenge: _Challenge, writer: str) -> _Auth:
    """The writer's proof that it holds ``token`` (None: it holds none, so the
    receiver refuses it)."""
    return _Auth(sign(token or "", _AUTH_LABEL, challenge.nonce, writer))
