"""The sparse MLP of mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral).

Per token, a router (one ``[experts, hidden]`` matrix) scores the experts; the
softmax's ``top_k`` largest are kept (renormalized to sum to 1 where the
checkpoint says ``norm_topk_prob``), and the token's output is the sum of those
experts' gated MLPs (``down(silu(gate(x)) * up(x))``) weighted by them.

Weights of all experts of a layer live in two stacked tensors, the layout the
fused kernels read: ``w13`` ``[experts, 2 * inter, hidden]`` (each expert's
gate rows, then its up rows) and ``w2`` ``[experts, hidden, inter]``. With
tensor parallelism every rank holds every expert's slice ``[start, stop)`` of
the intermediate dimension (gate and up rows, down columns) and the ranks'
outputs are summed, as the dense MLP's are; the router is replicated.

``route`` and ``experts_reference`` are the torch definitions (any device,
data-dependent loops: not for CUDA graphs). On CUDA the experts run in
``engine.layers.moe_triton``'s fused kernels, which read only the chosen
experts' weights and keep every shape static.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.nn import functional as F

from engine.layers.gemv import linear
from engine.model_config import ModelConfig, MoEConfig
from engine.parallel.group import TPGroup

GATE, UP, DOWN = "gate", "up", "down"


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights float32 [n, top_k], expert ids int32 [n, top_k])`` from the
    router's logits ``[n, experts]``: softmax in float32, the ``top_k``
    largest, renormalized over them when asked."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def experts_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` for every token ``t``,
    one expert at a time over the tokens that chose it (in ``x``'s dtype, the
    weight applied to the expert's output as HF transformers does)."""
    out = torch.zeros_like(x)
    inter = w2.shape[-1]
    flat = ids.reshape(-1).long()
    for e in torch.unique(flat).tolist():
        pairs = (flat == e).nonzero().squeeze(1)
        tokens = pairs // ids.shape[1]
        gate_up = F.linear(x[tokens], w13[e])
        h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = F.linear(h, w2[e]) * weights.reshape(-1)[pairs, None].to(x.dtype)
        out.index_add_(0, tokens, y)
    return out


def use_fused(x: torch.Tensor) -> bool:
    """Whether the Triton kernels run the experts of ``x``: on CUDA always
    (the reference's loops are data-dependent, so no CUDA graph holds them)."""
    return x.is_cuda


class Experts(nn.Module):
    """Every expert's gated MLP (this rank's slice of the intermediate dim)."""

    def __init__(self, moe: MoEConfig, hidden: int, tp: TPGroup | None) -> None:
        super().__init__()
        e, inter = moe.num_experts, moe.intermediate_size
        self.cols = (0, inter) if tp is None else tp.shard.even(inter)
        local = self.cols[1] - self.cols[0]
        self.num_experts = e
        self.w13 = nn.Parameter(torch.empty(e, 2 * local, hidden))
        self.w2 = nn.Parameter(torch.empty(e, hidden, local))
        # What load_weights must see of each parameter: every expert's shards.
        self.param_shards = {
            "w13": {(kind, i) for i in range(e) for kind in (GATE, UP)},
            "w2": {(DOWN, i) for i in range(e)},
        }

    def shard_slice(self, shard: tuple[str, int]) -> tuple[int, slice]:
        """Where checkpoint shard ``(gate|up|down, expert)`` goes in its tensor."""
        kind, e = shard
        local = self.w2.shape[-1]
        if kind == GATE:
            return e, slice(0, local)
        if kind == UP:
            return e, slice(local, 2 * local)
        return e, slice(None)

    def select_shard(
        self, param: str, shard: tuple[str, int], tensor: torch.Tensor
    ) -> torch.Tensor:
        """This rank's part of one expert's checkpoint matrix."""
        a, b = self.cols
        return tensor[:, a:b] if shard[0] == DOWN else tensor[a:b]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if use_fused(x):
            from engine.layers import moe_triton

            return moe_triton.fused_experts(x, self.w13, self.w2, weights, ids)
        return experts_reference(x, self.w13, self.w2, weights, ids)


class SparseMoE(nn.Module):
    """Router, experts and (Qwen2-MoE) the gated shared expert of one layer."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup | None, shared: nn.Module | None) -> None:
        super().__init__()
        assert cfg.moe is not None
        self.moe = cfg.moe
        self.tp = tp
        self.gate = nn.Linear(cfg.hidden_size, cfg.moe.num_experts, bias=False)
        self.experts = Experts(cfg.moe, cfg.hidden_size, tp)
        self.shared_expert = shared
        self.shared_expert_gate = (
            nn.Linear(cfg.hidden_size, 1, bias=False) if shared is not None else None
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if use_fused(x):
            from engine.layers import moe_route, moe_triton

            # Where the experts' matrix-vector path follows, the routing asks
            # L2 for the chosen experts' first rows (moe_route.expert_rows).
            small = x.shape[0] * self.moe.top_k <= moe_triton.SMALL_PAIRS
            return moe_route.route_rows(
                x,
                self.gate.weight,
                self.moe.top_k,
                self.moe.norm_topk_prob,
                self.experts.w13 if small else None,
            )
        return route(linear(x, self.gate.weight), self.moe.top_k, self.moe.norm_topk_prob)

    def warm_up(self, max_tokens: int) -> None:
        """Compile the fused kernels for every shape class of up to
        ``max_tokens`` tokens (CUDA; nothing elsewhere)."""
        if use_fused(self.gate.weight):
            from engine.layers import moe_triton

            w13, w2 = self.experts.w13, self.experts.w2
            moe_triton.warm_up(
                self.gate.weight, w13, w2, self.moe.top_k, self.moe.norm_topk_prob, max_tokens
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = self.experts(x, weights, ids)
        if self.tp is not None:
            out = self.tp.all_reduce(out)
        if self.shared_expert is not None:
            # The shared MLP sums its own ranks' parts.
            gate = torch.sigmoid(linear(x, self.shared_expert_gate.weight))
            out = out + gate * self.shared_expert(x)
        return out


_MIXTRAL_EXPERT = re.compile(r"\.experts\.(\d+)\.w([123])\.")
_MIXTRAL_KIND = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_KIND = {"gate_proj": GATE, "up_proj": UP, "down_proj": DOWN}


def checkpoint_tensors(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """A MoE checkpoint's tensors in one naming: Qwen's per-expert
    ``mlp.experts.E.{gate,up,down}_proj.weight``. Mixtral's
    ``block_sparse_moe.experts.E.w{1,3,2}`` and stacked ``mlp.experts.gate_up_proj``
    ``[E, 2 * inter, hidden]`` / ``mlp.experts.down_proj`` ``[E, hidden, inter]``
    (transformers' in-memory layout) are renamed or split into it."""
    for name, tensor in weights:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        name = _MIXTRAL_EXPERT.sub(lambda m: f".experts.{m[1]}.{_MIXTRAL_KIND[m[2]]}.", name)
        if name.endswith(".mlp.experts.gate_up_proj"):
            inter = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                yield f"{name[: -len('gate_up_proj')]}{e}.gate_proj.weight", tensor[e, :inter]
                yield f"{name[: -len('gate_up_proj')]}{e}.up_proj.weight", tensor[e, inter:]
        elif name.endswith(".mlp.experts.down_proj"):
            for e in range(tensor.shape[0]):
                yield f"{name[: -len('down_proj')]}{e}.down_proj.weight", tensor[e]
        else:
            yield name, tensor


def expert_target(name: str) -> tuple[str, tuple[str, int]] | None:
    """``(parameter, (gate|up|down, expert))`` for a per-expert checkpoint
    tensor's name, None for any other."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    kind = _KIND[m[3]]
    return f"{m[1]}.{'w2' if kind == DOWN else 'w13'}", (kind, int(m[2]))


def warm_up(model: nn.Module, max_tokens: int) -> None:
    """``SparseMoE.warm_up`` on the model's first sparse layer (every sparse
    layer has the same shapes), if it has one."""
    layer = next((m for m in model.modules() if isinstance(m, SparseMoE)), None)
    if layer is not None:
        layer.warm_up(max_tokens)
