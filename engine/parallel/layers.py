"""Tensor-parallel layers of the Llama-family decoder, and the factories the
model calls: with no group they build exactly the single-device modules.

Each sharded module allocates only its rank's part and loads it from the full
checkpoint tensor through ``select_shard(param, shard, tensor)``:

- column-parallel (fused QKV, fused gate/up): each named shard keeps its own
  rows (this rank's query heads, KV heads, intermediate slice), so the fused
  matrix stays one matmul and the local q/k/v split works as on one device;
- row-parallel (o_proj, down_proj): this rank's input columns, output summed
  over the ranks;
- vocab-parallel embedding and LM head: this rank's rows of the vocabulary
  (padded so every rank has as many); lookups outside it give zeros and the
  ranks' sum is the embedding; the logits of all ranks are gathered.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from engine.layers import fp8 as fp8_math
from engine.layers.fp8_quant import Deferred, Quantized
from engine.layers.gemv import silu_mul_linear
from engine.layers.linear import Linear, MergedLinear, any_linear, silu_mul_input
from engine.model_config import ModelConfig, ModelConfigError
from engine.parallel.group import TPGroup


class ShardedMergedLinear(MergedLinear):
    """``MergedLinear`` holding rows ``[start, stop)`` of each named shard."""

    def __init__(
        self, in_features: int, rows: dict[str, tuple[int, int]], bias: bool, fp8: bool = False
    ) -> None:
        super().__init__(in_features, {n: b - a for n, (a, b) in rows.items()}, bias, fp8)
        self.rows = dict(rows)

    def select_shard(self, param: str, shard: str | None, tensor: torch.Tensor) -> torch.Tensor:
        assert shard is not None
        a, b = self.rows[shard]
        return tensor[a:b]  # rows: of the weight, the bias and the per-row scale alike


class RowParallelLinear(nn.Module):
    """``y = x @ W.T`` over input columns ``[start, stop)``, summed over the ranks."""

    def __init__(
        self, cols: tuple[int, int], out_features: int, tp: TPGroup, fp8: bool = False
    ) -> None:
        super().__init__()
        self.cols = cols
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, cols[1] - cols[0]))
        fp8_math.weight_format(self, fp8)

    def select_shard(self, param: str, shard: str | None, tensor: torch.Tensor) -> torch.Tensor:
        if param == "weight_scale":  # one per output row: every rank needs all
            return tensor
        return tensor[:, self.cols[0] : self.cols[1]]

    def forward(self, x: torch.Tensor | Quantized | Deferred) -> torch.Tensor:
        return self.tp.all_reduce(any_linear(x, self.weight, None, self.weight_scale))

    def silu_mul_forward(
        self, gate_up: torch.Tensor, silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """``self(silu_and_mul(gate_up))``, fused where the GEMV kernel applies."""
        if self.weight_scale is not None:
            return self(silu_mul_input(self, gate_up, silu_and_mul))
        return self.tp.all_reduce(silu_mul_linear(gate_up, self.weight, silu_and_mul))


class VocabRows(nn.Module):
    """Rows ``[start, stop)`` of a ``[vocab, hidden]`` matrix, zero-padded to
    ``padded`` rows: the vocab-parallel embedding, and the LM head."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.start, self.stop, self.padded = tp.shard.vocab(vocab_size)
        self.tp = tp
        self.weight = nn.Parameter(torch.zeros(self.padded, hidden_size))

    def select_shard(self, param: str, shard: str | None, tensor: torch.Tensor) -> torch.Tensor:
        rows = tensor[self.start : self.stop]
        pad = self.padded - rows.shape[0]
        return F.pad(rows, (0, 0, 0, pad)) if pad else rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding of ``ids`` (every rank's part summed)."""
        local = ids - self.start
        outside = (local < 0) | (local >= self.stop - self.start)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(h.masked_fill_(outside.unsqueeze(-1), 0.0))


def local_heads(cfg: ModelConfig, tp: TPGroup | None) -> tuple[int, int]:
    """``(query heads, KV heads)`` one rank computes."""
    if tp is None:
        return cfg.num_heads, cfg.num_kv_heads
    a, b = tp.shard.kv_heads(cfg.num_kv_heads)
    return cfg.num_heads // tp.size, b - a


def qkv_proj(cfg: ModelConfig, tp: TPGroup | None) -> MergedLinear:
    if tp is None:
        return MergedLinear(
            cfg.hidden_size,
            {"q": cfg.q_size, "k": cfg.kv_size, "v": cfg.kv_size},
            cfg.attention_bias,
            cfg.fp8,
        )
    hd = cfg.head_dim
    q0, q1 = tp.shard.even(cfg.num_heads)
    k0, k1 = tp.shard.kv_heads(cfg.num_kv_heads)
    rows = {"q": (q0 * hd, q1 * hd), "k": (k0 * hd, k1 * hd), "v": (k0 * hd, k1 * hd)}
    return ShardedMergedLinear(cfg.hidden_size, rows, cfg.attention_bias, cfg.fp8)


def o_proj(cfg: ModelConfig, tp: TPGroup | None) -> nn.Module:
    if tp is None:
        return Linear(cfg.q_size, cfg.hidden_size, bias=False, fp8=cfg.fp8)
    q0, q1 = tp.shard.even(cfg.num_heads)
    cols = (q0 * cfg.head_dim, q1 * cfg.head_dim)
    return RowParallelLinear(cols, cfg.hidden_size, tp, cfg.fp8)


def gate_up_proj(cfg: ModelConfig, tp: TPGroup | None, inter: int) -> MergedLinear:
    if tp is None:
        return MergedLinear(cfg.hidden_size, {"gate": inter, "up": inter}, False, cfg.fp8)
    part = tp.shard.even(inter)
    return ShardedMergedLinear(cfg.hidden_size, {"gate": part, "up": part}, False, cfg.fp8)


def down_proj(cfg: ModelConfig, tp: TPGroup | None, inter: int) -> nn.Module:
    if tp is None:
        return Linear(inter, cfg.hidden_size, bias=False, fp8=cfg.fp8)
    return RowParallelLinear(tp.shard.even(inter), cfg.hidden_size, tp, cfg.fp8)


def embedding(cfg: ModelConfig, tp: TPGroup | None) -> nn.Module:
    if tp is None:
        return nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    return VocabRows(cfg.vocab_size, cfg.hidden_size, tp)


def lm_head(cfg: ModelConfig, tp: TPGroup | None) -> nn.Module:
    if tp is None:
        return Linear(cfg.hidden_size, cfg.vocab_size, bias=False, fp8=cfg.fp8_lm_head)
    if cfg.fp8_lm_head:
        raise ModelConfigError("--quantize-lm-head is not supported with tensor parallelism")
    return VocabRows(cfg.vocab_size, cfg.hidden_size, tp)
