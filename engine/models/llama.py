"""Llama-family decoder. Qwen2 (QKV bias) and Qwen3 (q/k RMSNorm) differ only in
flags of ``ModelConfig``, so they reuse these modules."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.nn import functional as F

from engine.attention.base import AttentionBackend
from engine.layers.kernels import LayerKernels, RotaryInput
from engine.layers.linear import MergedLinear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.model_config import ModelConfig
from engine.weights import WeightLoadError, load_named_weights


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, kernels: LayerKernels) -> None:
        super().__init__()
        self.layer = layer
        self.kernels = kernels
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.qkv_proj = MergedLinear(
            cfg.hidden_size,
            {"q": cfg.q_size, "k": cfg.kv_size, "v": cfg.kv_size},
            cfg.attention_bias,
        )
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, kernels)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, kernels)
        else:
            self.q_norm = self.k_norm = None
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size

    def forward(self, x: torch.Tensor, rope: RotaryInput, attn: AttentionBackend) -> torch.Tensor:
        n = x.shape[0]
        # Views into the projection's output: the kernels read them through their
        # strides (rotary may rotate them in place), so no copy is made.
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.kernels.rotary(q, k, rope)
        out = attn.forward(q, k, v, self.layer)
        return self.o_proj(out.reshape(n, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: LayerKernels) -> None:
        super().__init__()
        self.kernels = kernels
        self.gate_up_proj = MergedLinear(
            cfg.hidden_size, {"gate": cfg.intermediate_size, "up": cfg.intermediate_size}, False
        )
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.kernels.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, kernels: LayerKernels) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.self_attn = Attention(cfg, layer, kernels)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.mlp = MLP(cfg, kernels)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RotaryInput,
        attn: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp output, residual stream before it)``: the add of the two is left
        to the next norm, which fuses it (``residual`` None: the first layer)."""
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm.add_forward(h, residual)
        h = self.self_attn(h, rope, attn)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: LayerKernels) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, kernels) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (our fused parameter fragment, shard name)
    stacked_params = {
        ".q_proj.": (".qkv_proj.", "q"),
        ".k_proj.": (".qkv_proj.", "k"),
        ".v_proj.": (".qkv_proj.", "v"),
        ".gate_proj.": (".gate_up_proj.", "gate"),
        ".up_proj.": (".gate_up_proj.", "up"),
    }

    def __init__(self, cfg: ModelConfig, kernels: LayerKernels) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, kernels)
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings, kernels
        )
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """Hidden states ``[n, hidden]`` after the final norm."""
        h = self.model.embed_tokens(input_ids)
        rope = self.rotary.prepare(positions, h.dtype)
        residual = None
        for layer in self.model.layers:
            h, residual = layer(h, residual, rope, attn)
        if residual is None:  # no layers
            return self.model.norm(h)
        return self.model.norm.add_forward(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head_weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors, fusing q/k/v and gate/up into one matrix each."""
        params = dict(self.named_parameters())
        expected = {
            n: set(getattr(self.get_submodule(n.rsplit(".", 1)[0]), "shards", {None}))
            for n in params
        }
        seen: dict[str, set[str | None]] = {n: set() for n in params}

        def targets(name: str) -> tuple[str, str | None] | None:
            if "rotary_emb.inv_freq" in name:
                return None
            if name == "lm_head.weight" and self.lm_head is None:
                return None  # tied checkpoints may still store a copy
            for frag, (fused, shard) in self.stacked_params.items():
                if frag in name:
                    return name.replace(frag, fused), shard
            return name, None

        for name, tensor in weights:
            t = targets(name)
            if t is None:
                continue
            pname, shard = t
            if pname not in params:
                raise WeightLoadError(f"unexpected weight {name!r} in checkpoint")
            param = params[pname]
            dst = param.data
            if shard is not None:
                dst = dst[self.get_submodule(pname.rsplit(".", 1)[0]).shard_slice(shard)]
            load_named_weights(name, dst, tensor)
            seen[pname].add(shard)
        missing = [n for n, shards in expected.items() if seen[n] != shards]
        if missing:
            raise WeightLoadError(
                f"checkpoint lacks {len(missing)} weight(s), e.g. {', '.join(sorted(missing)[:5])}"
            )
