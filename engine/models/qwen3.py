"""Qwen3 dense: Llama with per-head RMSNorm on q and k before RoPE (set by ModelConfig)."""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass
