from __future__ import annotations

import torch
from torch.nn import functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x`` holds [gate | up] on its last dim; returns silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
