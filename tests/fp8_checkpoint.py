"""FP8 checkpoints written from a full-precision one, in the format public FP8
Llama checkpoints use (compressed-tensors' float-quantized weights with a
``weight_scale`` per channel or per tensor), and CPU runners of a checkpoint,
for the FP8 tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from engine.config import EngineConfig
from engine.layers import fp8
from engine.model_config import ModelConfig
from engine.runner import ModelRunner

QUANTIZED = (".q_proj.", ".k_proj.", ".v_proj.", ".o_proj.", ".gate_proj.", ".up_proj.", ".down_proj.")  # fmt: skip
CHANNEL_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
            "input_activations": {
                "num_bits": 8,
                "type": "float",
                "strategy": "token",
                "dynamic": True,
            },  # fmt: skip
        }
    },
    "ignore": ["lm_head"],
}


def quantized_checkpoint(src: Path, dst: Path, per_tensor: bool) -> dict[str, torch.Tensor]:
    """``src`` rewritten as an FP8 checkpoint: the projections in e4m3 with
    ``weight_scale`` per channel ``[N, 1]`` (or one per tensor, with a static
    ``input_scale`` beside it), the rest as it was. Returns the stored tensors."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(".weight") and any(f in name for f in QUANTIZED):
            base = name[: -len(".weight")]
            if per_tensor:
                scale = (t.float().abs().amax() / fp8.E4M3_MAX).reshape(())
                out[name] = (t.float() / scale).clamp(-448, 448).to(fp8.E4M3)
                out[f"{base}.weight_scale"] = scale
                out[f"{base}.input_scale"] = torch.tensor(0.05)
                if name.endswith(".k_proj.weight"):  # KV scales, as FP8-KV checkpoints carry
                    attn = name[: -len(".k_proj.weight")]
                    out[f"{attn}.k_scale"], out[f"{attn}.v_scale"] = (
                        torch.tensor(0.1),
                        torch.tensor(0.2),
                    )
            else:
                q, scale = fp8.quantize_rows(t)
                out[name], out[f"{base}.weight_scale"] = q, scale[:, None]
        else:
            out[name] = t
    for f in dst.glob("*.safetensors"):
        f.unlink()
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    qc = json.loads(json.dumps(CHANNEL_CONFIG))
    if per_tensor:
        qc["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
    (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    return out


def cpu_runner(model: str | Path, quantization: str | None = None, **settings: Any) -> ModelRunner:
    """A runner of the checkpoint ``model`` on the CPU: 64 pages of 4 tokens,
    ``quantization`` and any other engine ``settings`` as given."""
    mc = ModelConfig.load(model)
    cfg = EngineConfig(
        model=str(model),
        device="cpu",
        page_size=4,
        num_pages=64,
        quantization=quantization,
        **settings,
    ).resolve(mc)
    return ModelRunner(cfg, mc)
