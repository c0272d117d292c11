"""The approximate prefix tree that the cache-aware policy keeps per worker."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

BlockKeys = Sequence[tuple[int, int]]
"""(key, tokens) per block of a prompt, from ``block_keys``."""


def block_keys(token_ids: Sequence[int], block_tokens: int) -> list[tuple[int, int]]:
    """(key, tokens) per block of the prompt: the key of a block hashes its
    parent's key with its tokens, so equal keys mean equal prefixes (up to hash
    collisions; the tree is approximate). The last, partial block matches only
    an identical tail."""
    keys: list[tuple[int, int]] = []
    parent = 0
    for start in range(0, len(token_ids), block_tokens):
        block = tuple(token_ids[start : start + block_tokens])
        parent = hash((parent, block))
        keys.append((parent, len(block)))
    return keys


class ApproxPrefixTree:
    """The prefixes routed to one worker, as a tree of token blocks stored by
    chained hash (a node's key hashes its parent's key and its tokens), bounded
    to ``max_blocks`` blocks with least-recently-routed eviction.

    Inserting touches a prompt's blocks deepest first, so a parent is always
    more recent than its children and eviction trims trees from their leaves.
    """

    def __init__(self, block_tokens: int, max_blocks: int) -> None:
        if block_tokens < 1 or max_blocks < 1:
            raise ValueError("block_tokens and max_blocks must be >= 1")
        self.block_tokens = block_tokens
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[int, float] = OrderedDict()
        """Block key -> when it was last routed (monotonic seconds)."""

    def __len__(self) -> int:
        return len(self._blocks)

    def match(
        self,
        token_ids: Sequence[int] | None = None,
        *,
        keys: BlockKeys | None = None,
        routed_since: float | None = None,
    ) -> int:
        """Tokens of the longest stored prefix of ``token_ids`` (or of prompt
        ``keys`` from ``block_keys``); with ``routed_since``, of blocks routed
        at or after that time only. Does not refresh recency."""
        if keys is None:
            keys = block_keys(token_ids or (), self.block_tokens)
        matched = 0
        blocks = self._blocks
        for key, n in keys:
            at = blocks.get(key)
            if at is None or (routed_since is not None and at < routed_since):
                break
            matched += n
        return matched

    def insert(
        self, token_ids: Sequence[int] | None = None, *, keys: BlockKeys | None = None
    ) -> None:
        """Store (or refresh) every prefix of the prompt, evicting the least
        recently routed blocks beyond the bound."""
        if keys is None:
            keys = block_keys(token_ids or (), self.block_tokens)
        if len(keys) > self.max_blocks:
            keys = keys[: self.max_blocks]
        now = time.monotonic()
        for key, _ in reversed(keys):
            self._blocks[key] = now
            self._blocks.move_to_end(key)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()
