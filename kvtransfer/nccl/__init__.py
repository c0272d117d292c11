"""The nccl transfer backend: KV pages move over a two-rank communicator per
(writer, receiver) pair; NCCL between CUDA buffers, gloo (torch.distributed)
between CPU buffers, with one protocol for both, so ``--transfer-backend
nccl`` works on either device and CI runs the whole protocol on CPU.

Protocol (control messages over ZeroMQ, msgpack; data over the communicator):

* The receiver (a decode agent) binds a ROUTER and publishes it in its
  metadata, with its incarnation ``token``; the metadata reaches the writer
  inside the KV plane's authenticated handshake.
* No rank table: on the first write to a peer the writer opens a DEALER to
  it, proves it holds the cluster token (the tcp backend's HMAC challenge,
  ``kvtransfer.tcp.auth``), makes a new rendezvous (an NCCL unique id, or a
  TCPStore it hosts for gloo) and sends ``Pair(pair, token, rendezvous)``. The
  receiver answers ``Paired`` (or ``Refused``: a stale token means it
  restarted), then both join as ranks 0 (writer) and 1 (receiver). The pair
  is cached by the writer until it fails; a new one is built on the next
  write, so pools scale in and out freely and a restarted worker on the same
  address is simply a new pair.
* A write is ``Begin(pair, seq, [(dst_offset, nbytes)...])`` followed by the
  sends of its ranges (one group call); the receiver checks the ranges against
  its buffer, receives them in place (or through a staging buffer when they
  are many and small) and answers ``Landed(seq)``. The write is DONE on
  ``Landed``: every byte is in the receiver's buffer. Writes of one pair run
  in order.
* Failure contract: a write not landed within ``timeout``, a refused range, a
  control connection that stops heart-beating (ZMTP heartbeats, both
  directions), or ``close`` aborts the pair's communicator on the side that
  saw it (``ncclCommAbort`` / gloo ``abort``), which tells the other side
  (``Unpair`` / ``Refused``) where it can; every write of the pair in flight
  or queued fails, and no byte of an aborted pair lands later. A receiver
  frees the communicator of a writer whose connection dropped (its memory
  goes back).

Test hook: ``kvtransfer.faults`` drops (never sends) or delays the data of a
write, as it does for the tcp backend.

Modules: ``frames`` (messages), ``channel`` (the communicators: NCCL, gloo),
``writer`` (one pair's writing thread), ``receiver`` (the control thread and
the receiving pairs), ``backend`` (``NcclBackend``).
"""

from __future__ import annotations

from kvtransfer.nccl.backend import DEFAULT_TIMEOUT_S, NcclBackend
from kvtransfer.nccl.frames import NcclMetadata

__all__ = ["DEFAULT_TIMEOUT_S", "NcclBackend", "NcclMetadata"]
