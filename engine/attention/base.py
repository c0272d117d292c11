"""Attention backend interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import torch
from torch.nn import functional as F

from engine.attention.rope_kv_write import QKPrologue
from engine.forward_batch import ForwardBatch
from engine.kvcache.pool import KVPool


class FreshIndex(NamedTuple):
    """A forward of fresh prompts: every request starts at position 0 (no
    cached prefix) and its rows are consecutive. Each row's position in its
    prompt, and the page and slot its K/V go to (padding rows: the scratch
    page 0). Device tensors ``[rows]``, so that a CUDA graph reads them."""

    positions: torch.Tensor
    write_pages: torch.Tensor
    write_slots: torch.Tensor
    rows: torch.Tensor
    """0, 1, 2, ...: each row taken as a request of its own, whose one page
    is its ``write_pages`` entry (how ``forward_fresh_fused`` hands the rows
    to a page-table KV write)."""


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

    def forward_fresh(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        fresh: FreshIndex,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``forward`` for a forward of fresh prompts, with no ``begin_forward``:
        k and v written where ``fresh`` says, and each row attends the rows of
        its own prompt up to itself among this forward's k and v (as the pages
        hold them), found from the positions alone (nothing here depends on
        the host, so a CUDA graph replays it for any prompts)."""
        self.pool.write(layer, fresh.write_pages, fresh.write_slots, k, v)
        out = torch.empty_like(q) if out is None else out
        return self.attend_fresh(q, k, v, fresh.positions, out)

    def forward_fresh_fused(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        pre: QKPrologue,
        fresh: FreshIndex,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``forward_fresh`` with the layer's prologue ``pre`` applied on the
        way, as ``forward_fused`` applies it: the same pages, and the same
        rows attended (k and v as the pages hold them). Only backends that
        set ``fuses_prologue`` take it."""
        raise NotImplementedError(f"{type(self).__name__} does not fuse the q/k prologue")

    def attend_fresh(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """``forward_fresh``'s attention into ``out``. This reference masks a
        dense ``[rows, rows]`` score matrix; backends may run a kernel."""
        n = q.shape[0]
        rows = torch.arange(n, device=q.device)
        first = (rows - positions).clamp(min=0)
        mask = (rows[None, :] <= rows[:, None]) & (rows[None, :] >= first[:, None])
        group = self.num_heads // self.num_kv_heads
        # As the pages hold them (e4m3 pages: saturated and rounded).
        keys = self.pool.stored(k).to(q.dtype).repeat_interleave(group, dim=1).transpose(0, 1)
        values = self.pool.stored(v).to(q.dtype).repeat_interleave(group, dim=1).transpose(0, 1)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), keys, values, attn_mask=mask, scale=self.scale
        )
        return out.copy_(o.transpose(0, 1))
