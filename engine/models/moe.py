"""Mixture-of-experts decoders: the Llama-family decoder whose sparse layers'
MLP is ``engine.layers.moe.SparseMoE`` (chosen by ``ModelConfig.moe``).

Qwen3-MoE: q/k RMSNorm, no shared expert. Qwen2-MoE: QKV bias, a shared
expert behind a sigmoid gate, dense layers where ``mlp_only_layers`` or
``decoder_sparse_step`` say. Mixtral: plain attention, always-renormalized
top-k, experts named ``w1``/``w3``/``w2`` (renamed at load).
"""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    pass


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    pass


class MixtralForCausalLM(LlamaForCausalLM):
    pass
