"""Attention backends, picked by name.

Names map to import strings, resolved only by ``get_attention_backend``: the
names (the worker's ``--attention-backend`` choices, with "auto") can be listed
without importing torch or a backend's optional kernels.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.attention.base import AttentionBackend

ATTENTION_BACKENDS: dict[str, str] = {
    "torch_native": "engine.attention.torch_native:TorchNativeAttention",
    "flashinfer": "engine.attention.flashinfer:FlashInferAttention",
}
"""Name -> "module:Class" of the backend."""

DECODE_KERNELS = ("flashinfer", "triton")
"""Decode attention kernels of the flashinfer backend: FlashInfer's own, or
``engine.attention.paged_decode`` (Triton) over the same pages."""


def get_attention_backend(name: str) -> type[AttentionBackend]:
    """The backend class registered as ``name`` (imports its module)."""
    try:
        target = ATTENTION_BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; available: {', '.join(ATTENTION_BACKENDS)}"
        ) from None
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)
