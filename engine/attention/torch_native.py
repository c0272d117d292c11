"""Reference attention in plain torch: the CPU path and the oracle for GPU kernels."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from engine.attention.base import AttentionBackend
from engine.forward_batch import ForwardBatch


class TorchNativeAttention(AttentionBackend):
    def begin_forward(self, batch: ForwardBatch) -> None:
        device = self.pool.kv.device
        ps = self.pool.page_size
        self._batch = batch
        # Per request: (page, slot) of every position in [0, seq_len) and the
        # causal mask of its new tokens against them.
        self._gather: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._masks: list[torch.Tensor | None] = []
        for seq_len, ext, table in zip(batch.seq_lens, batch.extend_lens, batch.page_tables):
            pos = torch.arange(seq_len, device=device)
            pages = torch.tensor(table, dtype=torch.int64, device=device)[pos // ps]
            self._gather.append((pages, pos % ps))
            if ext == 1:
                self._masks.append(None)
            else:
                q_pos = torch.arange(seq_len - ext, seq_len, device=device)
                self._masks.append(pos[None, :] <= q_pos[:, None])

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        batch = self._batch
        self.pool.write(layer, batch.write_pages, batch.write_slots, k, v)
        k_cache, v_cache = self.pool.k_layer(layer), self.pool.v_layer(layer)
        group = self.num_heads // self.num_kv_heads
        out = torch.empty_like(q) if out is None else out
        start = 0
        for i, ext in enumerate(batch.extend_lens):
            pages, slots = self._gather[i]
            keys = k_cache[pages, slots].to(q.dtype)
            values = v_cache[pages, slots].to(q.dtype)
            if group > 1:
                keys = keys.repeat_interleave(group, dim=1)
                values = values.repeat_interleave(group, dim=1)
            qi = q[start : start + ext].transpose(0, 1)
            oi = F.scaled_dot_product_attention(
                qi,
                keys.transpose(0, 1),
                values.transpose(0, 1),
                attn_mask=self._masks[i],
                scale=self.scale,
            )
            out[start : start + ext] = oi.transpose(0, 1)
            start += ext
        return out
