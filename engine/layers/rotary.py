"""Rotary position embedding (rotate-half convention), with Llama-3 scaling."""

from __future__ import annotations

import math

import torch

from engine.layers.kernels import LayerKernels, RotaryInput
from engine.model_config import RopeScaling


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    # Llama 3: long wavelengths are divided by `factor`, short ones kept, and the
    # band between is interpolated smoothly.
    old_ctx = scaling.original_max_position_embeddings
    low_wavelen = old_ctx / scaling.low_freq_factor
    high_wavelen = old_ctx / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: RopeScaling | None,
        max_positions: int,
        kernels: LayerKernels,
    ) -> None:
        super().__init__()
        self.register_buffer(
            "inv_freq", inv_frequencies(head_dim, theta, scaling), persistent=False
        )
        self.kernels = kernels
        self.max_positions = max_positions
        self._table: torch.Tensor | None = None

    def table(self) -> torch.Tensor:
        """float32 ``[max_positions, head_dim]``: cos of every position in the first
        half, sin in the second. Built on first use, on the model's device."""
        if self._table is None:
            pos = torch.arange(self.max_positions, device=self.inv_freq.device).float()
            freqs = pos[:, None] * self.inv_freq[None, :]
            self._table = torch.cat((freqs.cos(), freqs.sin()), dim=-1).contiguous()
        return self._table

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryInput:
        """What every layer's rotation of one forward shares, computed once."""
        return self.kernels.rotary_input(positions, self, dtype)
