"""KV events: which prompt prefixes a worker's prefix cache holds, as chained
hashes of fixed token blocks, and the messages that carry them to gateways.

One definition of a block's hash serves both ends: the hash of block ``i`` of
a prompt chains the hash of block ``i - 1`` (0 before the first) with the
block's token ids, so equal hashes mean equal prefixes (up to collisions).
Only whole blocks are hashed. Python's tuple hash of ints is the same in
every process of one Python build (no per-process seed, unlike str), so a
gateway and its workers must run one build, which they already must
(``protocol`` messages are shared code).

A worker's blocks are its cache pages (``block_tokens`` = its page size). It
publishes what its cache stores and evicts as ``KvEvents`` batches with a
sequence number per epoch (a worker process's life); a requester that sees a
gap, or a new epoch, asks for a snapshot in its next ``Heartbeat``
(``kv_seq = -1``), and the worker answers with every block it holds.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

NO_PARENT = 0
"""The parent hash of a prompt's first block."""


def chain(parent: int, block: tuple[int, ...]) -> int:
    """The hash of ``block`` following the block whose hash is ``parent``."""
    return hash((parent, block))


def block_hashes(token_ids: Sequence[int], block_tokens: int, parent: int = NO_PARENT) -> list[int]:
    """The chained hash of every whole block of ``token_ids``."""
    out: list[int] = []
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        parent = chain(parent, tuple(token_ids[start : start + block_tokens]))
        out.append(parent)
    return out


class KvEvents(msgspec.Struct, tag="kv_events", frozen=True):
    """Blocks a worker's prefix cache stored and removed since the previous
    batch (``seq - 1``), or, with ``snapshot``, every block it holds at
    ``seq``."""

    epoch: str
    """The worker process's life: a restarted worker starts a new epoch (and
    an empty cache)."""
    seq: int
    block_tokens: int
    stored: list[int]
    removed: list[int]
    snapshot: bool = False


SNAPSHOT_PLEASE = -1
"""``Heartbeat.kv_seq`` of a requester that needs a snapshot."""
