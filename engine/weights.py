"""Checkpoint loading: safetensors (single file or sharded with an index) and
random "dummy" weights of the real shapes for benchmarks."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open


class WeightLoadError(ValueError):
    """The checkpoint's weight files are missing, broken, or do not fit the model."""


def safetensors_files(model_dir: str | Path) -> list[Path]:
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise WeightLoadError(f"{index} is not a valid safetensors index: {e}") from None
        files = [d / f for f in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise WeightLoadError(
                f"{index.name} names shard(s) missing from {d}: {', '.join(absent)}"
            )
        return files
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors weight files in {d}")
    return files


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    for f in safetensors_files(model_dir):
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, st.get_tensor(name)
        except SafetensorError as e:
            raise WeightLoadError(f"cannot read {f}: {e}") from None


def load_named_weights(name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise WeightLoadError(
            f"weight {name!r} has shape {tuple(src.shape)}, model expects {tuple(dst.shape)}"
        )
    dst.copy_(src.to(dst.dtype))


DUMMY_STD = 0.02
FP8_DUMMY_STD = 32.0
"""Random e4m3 weights well inside the format's range (448) and above its
subnormals, scaled back to ``DUMMY_STD`` by their ``weight_scale``."""


def init_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights at a scale that keeps activations finite in any dtype."""
    gens: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            elif name.endswith(".weight_scale"):
                p.fill_(DUMMY_STD / FP8_DUMMY_STD)  # FP8 rows: the same spread as others
            else:
                std = FP8_DUMMY_STD if p.dtype == torch.float8_e4m3fn else DUMMY_STD
                gen = gens.setdefault(p.device, torch.Generator(p.device).manual_seed(seed))
                # Chunked so a huge embedding needs no float32 copy of itself.
                flat = p.data.view(-1)
                step = 1 << 26
                for i in range(0, flat.numel(), step):
                    n = min(step, flat.numel() - i)
                    r = torch.randn(n, generator=gen, device=p.device, dtype=torch.float32)
                    flat[i : i + n].copy_(r.mul_(std))
