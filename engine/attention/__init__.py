"""Attention backends, picked by name."""

from __future__ import annotations

from engine.attention.base import AttentionBackend
from engine.attention.flashinfer import FlashInferAttention
from engine.attention.torch_native import TorchNativeAttention

ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    "torch_native": TorchNativeAttention,
    "flashinfer": FlashInferAttention,
}
"""Name -> backend; also the CLI's choices (plus "auto")."""


def get_attention_backend(name: str) -> type[AttentionBackend]:
    try:
        return ATTENTION_BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; available: {', '.join(ATTENTION_BACKENDS)}"
        ) from None
