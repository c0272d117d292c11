"""Values that probe a rounding to e4m3 (float8_e4m3fn): every e4m3 value,
the midpoints between neighbours (ties, to even), values just off them,
subnormals, the saturation bound and past it; all exact in bf16 and fp16."""

from __future__ import annotations

import torch

E4M3_MAX = 448.0


def probe_values() -> torch.Tensor:
    """float32 ``[v]``: the probes, both signs."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mids = (grid[1:] + grid[:-1]) / 2  # ties: 4 significant bits
    near = torch.cat([mids * (1 + 2**-6), mids * (1 - 2**-6)])  # off the ties either way
    past = torch.tensor([449.0, 464.0, 480.0, 1000.0, 60000.0])
    tiny = torch.tensor([2.0**-10, 2.0**-11, 3 * 2.0**-11, 2.0**-12])
    pos = torch.cat([grid, mids, near, past, tiny])
    # Rounded to the probes' bf16 and fp16 values alike: fp16 subnormals and
    # bf16's 8 bits both hold them (the off-tie probes go to 8 bits first).
    pos = pos.to(torch.bfloat16).float()
    return torch.cat([pos, -pos])


def probe_rows(rows: int, width: int, seed: int = 0) -> torch.Tensor:
    """float32 ``[rows, width]``: the probes in a random order, repeated."""
    v = probe_values()
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, v.numel(), (rows * width,), generator=g)
    return v[idx].view(rows, width)


def e4m3_rounded(x: torch.Tensor) -> torch.Tensor:
    """``x`` as an e4m3 pool stores it (saturated, to nearest even), widened
    back to float32: torch's own cast, the reference."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
