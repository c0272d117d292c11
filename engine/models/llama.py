"""Llama-family decoder. Qwen2 (QKV bias) and Qwen3 (q/k RMSNorm) differ only in
flags of ``ModelConfig``, so they reuse these modules; so do the mixture-of-
experts models (``ModelConfig.moe``), whose sparse layers take
``engine.layers.moe.SparseMoE`` for the MLP."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from engine.attention.base import AttentionBackend, FreshIndex
from engine.attention.rope_kv_write import QKPrologue
from engine.layers import fp8, moe
from engine.layers.fp8_quant import Quantized
from engine.layers.gemv import linear
from engine.layers.kernels import LayerKernels, RotaryInput
from engine.layers.linear import gated_mlp
from engine.layers.moe import SparseMoE
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.model_config import ModelConfig
from engine.parallel import layers as tp_layers
from engine.parallel.group import TPGroup
from engine.weights import WeightLoadError, load_named_weights


class Attention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer: int, kernels: LayerKernels, tp: TPGroup | None = None
    ) -> None:
        super().__init__()
        self.layer = layer
        self.kernels = kernels
        # With tensor parallelism: this rank's heads only (see engine.parallel).
        self.num_heads, self.num_kv_heads = tp_layers.local_heads(cfg, tp)
        self.head_dim = cfg.head_dim
        self.qkv_proj = tp_layers.qkv_proj(cfg, tp)
        self.o_proj = tp_layers.o_proj(cfg, tp)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, kernels)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, kernels)
        else:
            self.q_norm = self.k_norm = None
        self.eps = cfg.rms_norm_eps
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.kv_scales: tuple[float, float] | None = None
        """``(k_scale, v_scale)`` of an e4m3 KV pool from a checkpoint that
        carries them (``LlamaForCausalLM.scale_kv``): pages hold ``k / k_scale``
        and ``v / v_scale``; None: values as they are."""

    def forward(
        self, x: torch.Tensor | Quantized, rope: RotaryInput, attn: AttentionBackend
    ) -> torch.Tensor:
        return self.o_proj(self.core(self.qkv_proj(x), rope, attn))

    def core(
        self,
        qkv: torch.Tensor,
        rope: RotaryInput,
        attn: AttentionBackend,
        out: torch.Tensor | None = None,
        fresh: FreshIndex | None = None,
    ) -> torch.Tensor:
        """Attention ``[n, heads * head_dim]`` from the QKV projection's output
        ``[n, q + 2 kv]``: q/k norms, rotary embedding, KV write and the
        attention kernel, everything of the layer that reads the KV pool (the
        part ``engine.piece_graphs`` runs between its graphs). Written into
        ``out`` ``[n, heads, head_dim]`` (contiguous) where given. ``fresh``:
        a forward of fresh prompts, attended without a plan
        (``AttentionBackend.forward_fresh``)."""
        n = qkv.shape[0]
        # Views into the projection's output: the kernels read them through their
        # strides (rotary may rotate them in place), so no copy is made.
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if attn.fuses_prologue:
            positions, table = rope  # the FlashInfer kernels' rotary input
            norms = (
                (None, None) if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight)
            )
            pre = QKPrologue(positions, table, *norms, self.eps, self.kv_scales)
            if fresh is None:
                out = attn.forward_fused(q, k, v, self.layer, pre, out)
            else:
                out = attn.forward_fresh_fused(q, k, v, self.layer, pre, fresh, out)
        else:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.kernels.rotary(q, k, rope)
            if self.kv_scales is not None:
                # softmax(q.(K/ks * ks)) (V/vs * vs): the scales move onto the
                # query and the output, so every backend reads the pages as stored.
                ks, vs = self.kv_scales
                q, k, v = q * ks, k / ks, v / vs
            if fresh is None:
                out = attn.forward(q, k, v, self.layer, out)
            else:
                out = attn.forward_fresh(q, k, v, self.layer, fresh, out)
        if self.kv_scales is not None:
            out.mul_(self.kv_scales[1])
        return out.reshape(n, self.q_size)


class MLP(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        kernels: LayerKernels,
        tp: TPGroup | None = None,
        intermediate_size: int | None = None,
    ) -> None:
        super().__init__()
        self.kernels = kernels
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = tp_layers.gate_up_proj(cfg, tp, inter)
        self.down_proj = tp_layers.down_proj(cfg, tp, inter)

    def forward(self, x: torch.Tensor | Quantized) -> torch.Tensor:
        h = gated_mlp(self.gate_up_proj, self.down_proj, x)
        if h is not None:
            return self.down_proj(h)
        return self.down_proj.silu_mul_forward(self.gate_up_proj(x), self.kernels.silu_and_mul)


def _mlp(cfg: ModelConfig, layer: int, kernels: LayerKernels, tp: TPGroup | None) -> nn.Module:
    """The layer's dense MLP, or its sparse mixture of experts."""
    if cfg.moe is None or not cfg.moe.sparse(layer):
        return MLP(cfg, kernels, tp)
    shared_size = cfg.moe.shared_expert_intermediate_size
    shared = MLP(cfg, kernels, tp, shared_size) if shared_size else None
    return SparseMoE(cfg, tp, shared)


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer: int, kernels: LayerKernels, tp: TPGroup | None = None
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.self_attn = Attention(cfg, layer, kernels, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.mlp = _mlp(cfg, layer, kernels, tp)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RotaryInput,
        attn: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp output, residual stream before it)``: the add of the two is left
        to the next norm, which fuses it (``residual`` None: the first layer)."""
        qkv, residual = self.pre(h, residual)
        return self.post(self.self_attn.core(qkv, rope, attn), residual)

    def pre(
        self, h: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(QKV projection, residual stream)``: the layer up to its attention."""
        # An FP8 product after a norm takes the norm's output quantized in the
        # norm's kernel (RMSNorm.forward_for); a sparse MLP takes it as it is.
        h, residual = self.input_layernorm.forward_for(h, residual, self.self_attn.qkv_proj)
        return self.self_attn.qkv_proj(h), residual

    def post(
        self, attn_out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp output, residual stream before it)`` from the attention's
        output: the layer after its attention."""
        h = self.self_attn.o_proj(attn_out)
        gate_up = self.mlp.gate_up_proj if isinstance(self.mlp, MLP) else None
        h, residual = self.post_attention_layernorm.forward_for(h, residual, gate_up)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: LayerKernels, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.embed_tokens = tp_layers.embedding(cfg, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, kernels, tp) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)


STATIC_SCALES = (".input_scale", ".output_scale", ".q_scale", ".k_scale", ".v_scale")
"""Calibrated scales of FP8 checkpoints not read: activations are scaled per
token (``engine.layers.fp8``); KV scales are read where ``KV_SCALES`` names
them, and read past elsewhere."""
KV_SCALES = {
    "self_attn.k_scale": 0,
    "self_attn.v_scale": 1,
    "self_attn.k_proj.output_scale": 0,
    "self_attn.v_proj.output_scale": 1,
}
"""Checkpoint tensor (after ``model.layers.N.``) -> which of a layer's
``(k_scale, v_scale)`` it holds: FP8-KV checkpoints' per-layer scalars, in
compressed-tensors' names and in the older ``output_scale`` ones."""


def kv_scale_target(name: str) -> tuple[int, int] | None:
    """``(layer, 0 for K or 1 for V)`` of a checkpoint's KV scale tensor."""
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in KV_SCALES:
        return int(parts[2]), KV_SCALES[parts[3]]
    return None


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (our fused parameter fragment, shard name)
    stacked_params = {
        ".q_proj.": (".qkv_proj.", "q"),
        ".k_proj.": (".qkv_proj.", "k"),
        ".v_proj.": (".qkv_proj.", "v"),
        ".gate_proj.": (".gate_up_proj.", "gate"),
        ".up_proj.": (".gate_up_proj.", "up"),
    }

    def __init__(self, cfg: ModelConfig, kernels: LayerKernels, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.model = DecoderModel(cfg, kernels, tp)
        self.checkpoint_kv_scales: dict[int, list[float]] = {}
        """Layer -> ``[k_scale, v_scale]`` the checkpoint carries (1.0 where it
        has one of the two); used with an e4m3 KV pool (``scale_kv``)."""
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings, kernels
        )
        if cfg.tie_word_embeddings and not cfg.fp8_lm_head:
            self.lm_head = None
        else:
            # A tied head quantized (--quantize-lm-head) is a copy of the
            # embedding matrix in e4m3, made by ``tie_head`` once it is loaded.
            self.lm_head = tp_layers.lm_head(cfg, tp)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @property
    def _head_from_embedding(self) -> bool:
        return self.config.tie_word_embeddings and self.lm_head is not None

    @torch.no_grad()
    def tie_head(self) -> None:
        """Once the weights are in: a tied head held apart (quantized) takes
        the embedding matrix's rows, quantized per row; any other head is
        already what the checkpoint holds."""
        if self._head_from_embedding:
            q, scale = fp8.quantize_rows(self.model.embed_tokens.weight)
            self.lm_head.weight.copy_(q)
            self.lm_head.weight_scale.copy_(scale)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """Hidden states ``[n, hidden]`` after the final norm."""
        h = self.model.embed_tokens(input_ids)
        rope = self.rotary.prepare(positions, h.dtype)
        residual = None
        for layer in self.model.layers:
            h, residual = layer(h, residual, rope, attn)
        return self.final_norm(h, residual)

    def final_norm(self, h: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The hidden states after the last layer's ``(output, residual)``."""
        if residual is None:  # no layers
            return self.model.norm(h)
        return self.model.norm.add_forward(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.config.fp8_lm_head:  # an e4m3 head: the rows quantized per token first
            logits = self.lm_head(hidden)
        else:
            logits = linear(hidden, self.lm_head_weight)
        if self.tp is not None:  # this rank's vocab columns: gather all of them
            logits = self.tp.gather_vocab(logits, self.config.vocab_size)
        return logits.float()

    def _expected_shards(self, param: str) -> set[Any]:
        """The checkpoint shards that together fill ``param`` (``{None}``: one
        tensor of its own name)."""
        owner, leaf = param.rsplit(".", 1)
        module = self.get_submodule(owner)
        per_param = getattr(module, "param_shards", None)
        if per_param is not None:
            return set(per_param[leaf])
        return set(getattr(module, "shards", {None}))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors, fusing q/k/v and gate/up into one matrix each."""
        params = dict(self.named_parameters())
        expected = {n: self._expected_shards(n) for n in params}
        if self._head_from_embedding:  # made from the embedding (tie_head)
            expected = {n: s for n, s in expected.items() if not n.startswith("lm_head.")}
        seen: dict[str, set[Any]] = {n: set() for n in params}
        if self.config.moe is not None:
            weights = moe.checkpoint_tensors(weights)

        def targets(name: str) -> tuple[str, Any] | None:
            if "rotary_emb.inv_freq" in name or name.endswith(STATIC_SCALES):
                return None
            if name == "lm_head.weight" and (self.lm_head is None or self._head_from_embedding):
                return None  # tied checkpoints may still store a copy
            expert = moe.expert_target(name)
            if expert is not None:
                return expert
            for frag, (fused, shard) in self.stacked_params.items():
                if frag in name:
                    return name.replace(frag, fused), shard
            return name, None

        for name, tensor in weights:
            kv = kv_scale_target(name)
            if kv is not None:
                layer, which = kv
                scales = self.checkpoint_kv_scales.setdefault(layer, [1.0, 1.0])
                scales[which] = float(tensor.float().reshape(-1)[0])
                continue
            t = targets(name)
            if t is None:
                continue
            pname, shard = t
            if pname not in params:
                raise WeightLoadError(f"unexpected weight {name!r} in checkpoint")
            param = params[pname]
            dst = param.data
            owner, leaf = pname.rsplit(".", 1)
            module = self.get_submodule(owner)
            if shard is not None:
                dst = dst[module.shard_slice(shard)]
            select = getattr(module, "select_shard", None)
            if leaf == "weight_scale":
                tensor = tensor.float().reshape(-1)
                if tensor.numel() == 1:  # one scale for the whole tensor: every row's
                    tensor, select = tensor.expand(dst.shape[0]), None
            if select is not None:  # tensor-parallel: this rank's part of the tensor
                tensor = select(leaf, shard, tensor)
            if dst.dtype == fp8.E4M3 and tensor.dtype != fp8.E4M3:
                # A full-precision checkpoint into FP8 rows: quantized here, and
                # the rows' scales come with them.
                scale_name = f"{owner}.weight_scale"
                tensor, scale = fp8.quantize_rows(tensor)
                scale_dst = params[scale_name].data
                if shard is not None:
                    scale_dst = scale_dst[module.shard_slice(shard)]
                load_named_weights(name, scale_dst, scale)
                seen[scale_name].add(shard)
            load_named_weights(name, dst, tensor)
            seen[pname].add(shard)
        missing = [n for n, shards in expected.items() if seen[n] != shards]
        if missing:
            raise WeightLoadError(
                f"checkpoint lacks {len(missing)} weight(s), e.g. {', '.join(sorted(missing)[:5])}"
            )

    def scale_kv(self) -> int:
        """Store K and V in the KV pool divided by the checkpoint's per-layer
        scales (for an e4m3 pool: the range the scales were calibrated for);
        returns the layers scaled. Layers without scales, and scales of 1,
        keep the plain path."""
        scaled = 0
        for i, layer in enumerate(self.model.layers):
            ks, vs = self.checkpoint_kv_scales.get(i, (1.0, 1.0))
            if (ks, vs) != (1.0, 1.0):
                if not (ks > 0 and vs > 0):
                    raise WeightLoadError(f"layer {i}: KV scales must be positive, got {ks}, {vs}")
                layer.self_attn.kv_scales = (ks, vs)
                scaled += 1
        return scaled
