"""Attention backend interface."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from engine.attention.rope_kv_write import QKPrologue
from engine.forward_batch import ForwardBatch
from engine.kvcache.pool import KVPool


class AttentionBackend(ABC):
    """Paged attention over a ``KVPool`` for a batch of mixed requests.

    Each request contributes ``extend_len`` new tokens whose queries attend
    causally to its whole sequence: the cached prefix already in the pool plus
    the new tokens themselves. Decode is the case ``extend_len == 1``.
    """

    def __init__(
        self,
        pool: KVPool,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        q_dtype: torch.dtype | None = None,
    ) -> None:
        """``q_dtype``: the queries' (the model's) dtype; None: the pool's."""
        self.pool = pool
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.q_dtype = q_dtype or pool.kv.dtype
        self.fuses_prologue = False
        """Whether layers call ``forward_fused`` (their q/k norms, rotary
        embedding and KV scales left to it) in place of ``forward``."""

    @abstractmethod
    def begin_forward(self, batch: ForwardBatch) -> None:
        """Plan the batch once; every layer's ``forward`` then reuses the plan."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write the new ``k``/``v`` ``[n, kv_heads, head_dim]`` into the pool, then
        return attention output ``[n, heads, head_dim]`` for ``q`` ``[n, heads, head_dim]``:
        ``out`` (contiguous) where given, else a new tensor."""

    def forward_fused(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        pre: QKPrologue,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``forward`` with the layer's prologue ``pre`` applied on the way:
        ``q`` and ``k`` normed and rotated, and the KV scales applied (q times
        the K scale, the pages' K and V over theirs); the output is still to
        be multiplied by the V scale. Only backends that set
        ``fuses_prologue`` take it."""
        raise NotImplementedError(f"{type(self).__name__} does not fuse the q/k prologue")
