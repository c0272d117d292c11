"""The element-wise kernels of a decoder layer: RMSNorm (alone and fused with the
residual add), rotary embedding and SiLU-and-mul.

``TorchKernels`` is the reference (any device, float32 norm statistics like HF
transformers). ``FlashInferKernels`` runs each op as one fused CUDA kernel: the
residual add and the norm in one pass, rotary applied in place on the q/k
views of the QKV projection's output from a float32 cos/sin cache. A model is built
with one set; the runner picks FlashInfer's wherever its attention runs.

FlashInfer's norms are launched the ordinary way, so the product after a norm
cannot start before the norm ends. Where the products prefetch their weights
before their wait (``engine.layers.pdl.PREFETCH_BYTES``), a forward's rows
take ``engine.layers.norm_triton``'s kernel instead, launched with
programmatic dependent launch, so that the product's programs are placed and
its weight streams in while the norm runs. (Without the prefetch the two
norms measured even: docs/benchmarks.md.)
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Protocol

import torch
from torch.nn import functional as F

from engine.layers import norm_triton, pdl

KERNELS = ("torch", "flashinfer")


class LayerKernels(ABC):
    """The element-wise ops of a decoder layer."""

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim of ``x`` ``[n, d]`` or ``[n, heads, d]`` (any
        row strides, last dim contiguous); returns a new tensor."""

    @abstractmethod
    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(x + residual), x + residual)``; may overwrite ``x`` and
        ``residual`` (both are the caller's intermediates)."""

    @abstractmethod
    def rotary_input(
        self, positions: torch.Tensor, cache: RotaryTable, dtype: torch.dtype
    ) -> RotaryInput:
        """What every layer's ``rotary`` of one forward takes, computed once."""

    @abstractmethod
    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, rope: RotaryInput
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q`` ``[n, heads, d]`` and ``k`` ``[n, kv_heads, d]`` (rotate-half
        convention) by the positions ``rope`` was made for; may work in place on
        the given views."""

    @abstractmethod
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``x`` holding ``[gate | up]`` on its last dim."""


RotaryInput = tuple[torch.Tensor, torch.Tensor]
"""Per forward: (cos, sin) for the torch kernels, (positions, cos/sin table) for
FlashInfer's."""


class RotaryTable(Protocol):
    inv_freq: torch.Tensor

    def table(self) -> torch.Tensor: ...


class TorchKernels(LayerKernels):
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The sum is rounded to the model's dtype before the norm, as HF does.
        h = x + residual
        return self.rms_norm(h, weight, eps), h

    def rotary_input(
        self, positions: torch.Tensor, cache: RotaryTable, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * cache.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, rope: RotaryInput
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class FlashInferKernels(LayerKernels):
    def __init__(self) -> None:
        # FlashInfer may route norms to CuTe DSL kernels that compile at first
        # use; the CUDA norm kernels are built ahead of time and equivalent.
        os.environ.setdefault("FLASHINFER_USE_CUDA_NORM", "1")
        import flashinfer.activation
        import flashinfer.norm
        import flashinfer.rope

        self._norm = flashinfer.norm
        self._rope = flashinfer.rope
        self._act = flashinfer.activation

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if pdl.PREFETCH_BYTES and norm_triton.fits(x):
            return norm_triton.rms_norm(x, weight, eps)
        return self._norm.rmsnorm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # In place: residual += x, then x = rms_norm(residual).
        if pdl.PREFETCH_BYTES and norm_triton.fits(x) and residual.stride(-1) == 1:
            return norm_triton.add_rms_norm(x, residual, weight, eps)
        self._norm.fused_add_rmsnorm(x, residual, weight, eps)
        return x, residual

    def rotary_input(
        self, positions: torch.Tensor, cache: RotaryTable, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return positions, cache.table()

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, rope: RotaryInput
    ) -> tuple[torch.Tensor, torch.Tensor]:
        positions, table = rope
        n, head_dim = q.shape[0], q.shape[-1]
        self._rope.apply_rope_with_cos_sin_cache_inplace(
            positions, q.view(n, -1), k.view(n, -1), head_dim, table, is_neox=True
        )
        return q, k

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._act.silu_and_mul(x)


def layer_kernels(name: str) -> LayerKernels:
    """The kernel set registered as ``name`` (one of ``KERNELS``)."""
    if name == "torch":
        return TorchKernels()
    if name == "flashinfer":
        return FlashInferKernels()
    raise ValueError(f"unknown layer kernels {name!r}; choose from {', '.join(KERNELS)}")
