"""Pure-ZeroMQ transfer backend: KV bytes travel over TCP.

Wire protocol (msgpack headers, one ZMQ DEALER per peer on the writer side, one
ROUTER on the receiver side; both served by one background I/O thread):

* ``Begin(writer, xfer, token, ranges)`` announces every ``(dst_offset, nbytes)``
  of a transfer. The receiver checks the token (its incarnation, from its
  metadata) and every range against its buffer size *before* writing anything;
  a rejected transfer gets an error reply and none of its bytes are written.
* ``Data(writer, xfer, token, pieces)`` + payload frames: a chunk of at most
  ``chunk_bytes`` bytes made of ``(dst_offset, nbytes)`` pieces whose bytes
  follow, in order, in the payload frames (a piece never straddles two frames;
  big pieces travel zero-copy in a frame of their own, small ones are gathered
  into one). Large ranges are split over several chunks and small ones
  (scattered pages) share one. The receiver checks every piece, copies them
  into its buffer and replies ``Reply(xfer, nbytes)``.
* A write is DONE once every chunk has been acknowledged, i.e. every byte is in
  the peer buffer. At most ``window`` chunks per peer are unacknowledged, which
  bounds memory on both sides. A peer that makes no progress for ``timeout``
  seconds fails its transfers, and its socket is dropped (with whatever it still
  queued) so no stale bytes land later. A transfer with a chunk unacknowledged
  for ``timeout`` seconds fails on its own (a lost message), even while the
  peer acknowledges other transfers.

Test hook: ``kvtransfer.faults`` can drop or delay data messages (only when
its environment variable is set, by the fault matrix).

With a cluster token, every connection must first prove it holds the token
(an HMAC challenge, see ``kvtransfer.tcp.auth``) before the receiver takes a
transfer message from it; transfer messages of a connection that did not pass
are refused unwritten.

Source bytes are read from the registered buffer by the I/O thread while the
transfer runs (zero-copy for CPU buffers): as with RDMA, the caller must leave
the source pages alone until ``poll`` reports DONE or FAILED.

Modules: ``frames`` (the messages and their codecs), ``auth`` (the cluster-token
handshake), ``buffer`` (a registered tensor as bytes: payload frames out,
scatter in), ``transfer`` (one write and its split into messages),
``receiver`` (the checks on incoming messages), ``loop`` (the I/O thread) and
``backend`` (``TcpBackend``, the ``TransferBackend`` API).
"""

from __future__ import annotations

from kvtransfer.tcp.backend import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_TIMEOUT_S,
    DEFAULT_WINDOW,
    TcpBackend,
)
from kvtransfer.tcp.frames import (
    TcpMetadata,
    _Auth,
    _Begin,
    _Challenge,
    _Data,
    _Hello,
    _Reply,
    _Welcome,
)

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_WINDOW",
    "TcpBackend",
    "TcpMetadata",
    "_Auth",
    "_Begin",
    "_Challenge",
    "_Data",
    "_Hello",
    "_Reply",
    "_Welcome",
]
