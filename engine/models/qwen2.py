"""Qwen2 / Qwen2.5: Llama with bias on the q, k and v projections (set by ModelConfig)."""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass
