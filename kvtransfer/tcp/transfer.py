"""One write of the tcp backend: its ranges packed into messages, and its
progress. The API thread creates it and reads its outcome; the I/O thread
(``kvtransfer.tcp.loop``) sends it and records its acknowledgements.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtransfer.backend import ByteRange, TransferState
from kvtransfer.tcp.buffer import _ByteBuffer
from kvtransfer.tcp.frames import _MAX_PIECES


@dataclass(eq=False)
class _Xfer:
    """One write: ``state`` and ``error`` are its outcome, read by ``poll``
    under the backend's lock; the progress fields belong to the I/O thread."""

    handle: int
    peer: str
    src: _ByteBuffer
    ranges: list[tuple[int, int]]  # (dst_offset, nbytes), announced by Begin
    chunks: list[list[tuple[int, int, int]]]  # one message: [(src, dst, nbytes), ...]
    total: int
    state: TransferState = TransferState.PENDING
    error: str | None = None
    begun: bool = False
    next_chunk: int = 0
    inflight: int = 0
    acked: int = 0
    deadline: float = 0.0
    """While chunks of it are unacknowledged: when it fails for lack of
    progress (a lost message), even while the peer acknowledges others."""


def _split(ranges: list[ByteRange], chunk_bytes: int) -> list[list[tuple[int, int, int]]]:
    """Pack ranges into messages of at most ``chunk_bytes`` payload bytes
    (and ``_MAX_PIECES`` pieces): big ranges span several, small ones share.
    Each message is a list of ``(src_offset, dst_offset, nbytes)`` pieces."""
    step = chunk_bytes
    chunks: list[list[tuple[int, int, int]]] = []
    cur: list[tuple[int, int, int]] = []
    room = step
    for r in ranges:
        off = 0
        while off < r.nbytes:
            n = min(room, r.nbytes - off)
            cur.append((r.src_offset + off, r.dst_offset + off, n))
            off += n
            room -= n
            if room == 0 or len(cur) == _MAX_PIECES:
                chunks.append(cur)
                cur, room = [], step
    if cur:
        chunks.append(cur)
    return chunks
