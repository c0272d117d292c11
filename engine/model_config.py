"""Model configuration, read from a HF ``config.json`` (or a named preset for
dummy weights), and the torch dtypes a config may name."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from engine.presets import PRESETS
from engine.quantization import QUANTIZATIONS

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM",
    "MixtralForCausalLM",
)
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


class ModelConfigError(ValueError):
    """The checkpoint's config cannot be served."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent scaling (``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class MoEConfig:
    """The sparse MLP of a mixture-of-experts model: a router picks ``top_k`` of
    ``num_experts`` gated MLPs per token and sums their outputs weighted by the
    router's softmax (renormalized over the chosen ones with ``norm_topk_prob``);
    Qwen2-MoE adds a shared expert whose output a sigmoid gate scales."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def sparse(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is the sparse one (else the dense
        ``intermediate_size`` MLP, as Qwen2-MoE's ``mlp_only_layers`` ask)."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    dtype: torch.dtype = torch.float32
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    moe: MoEConfig | None = None
    """None for a dense model."""
    quantization: str | None = None
    """``"fp8"``: the attention and MLP projections hold e4m3 weights with a
    scale per output row (``engine.layers.fp8``), from an FP8 checkpoint or
    quantized at load (``EngineConfig.quantization``); None: the model's dtype."""

    fp8_lm_head: bool = False
    """The LM head in e4m3 too (``EngineConfig.quantize_lm_head``); needs ``fp8``."""

    def sparse_layer(self, layer: int) -> bool:
        return self.moe is not None and self.moe.sparse(layer)

    @property
    def fp8(self) -> bool:
        return self.quantization == "fp8"

    def with_quantization(self, quantization: str | None, lm_head: bool = False) -> ModelConfig:
        """This config with the engine's ``--quantization`` applied (None: as
        the checkpoint is), and ``--quantize-lm-head`` (``lm_head``)."""
        q = quantization or self.quantization
        if q not in (None, *QUANTIZATIONS):
            raise ModelConfigError(
                f"unknown quantization {q!r}; choose from {', '.join(QUANTIZATIONS)}"
            )
        if q is not None and self.moe is not None:
            raise ModelConfigError(
                f"quantization {q!r} is not supported for mixture-of-experts models yet"
            )
        if lm_head and q != "fp8":
            raise ModelConfigError(
                "--quantize-lm-head needs FP8 weights (--quantization fp8, or an FP8 checkpoint)"
            )
        if q == self.quantization and lm_head == self.fp8_lm_head:
            return self
        return replace(self, quantization=q, fp8_lm_head=lm_head)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], dtype: torch.dtype | None = None) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelConfigError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            kv_heads = int(cfg.get("num_key_value_heads") or heads)
            head_dim = int(cfg.get("head_dim") or hidden // heads)
            layers = int(cfg["num_hidden_layers"])
            vocab = int(cfg["vocab_size"])
            inter = int(cfg["intermediate_size"])
        except KeyError as e:
            raise ModelConfigError(f"config.json lacks required key {e.args[0]!r}") from None
        if heads % kv_heads:
            raise ModelConfigError(
                f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"unsupported hidden_act {cfg['hidden_act']!r}; only 'silu'")
        # transformers >= 5 nests rope settings under rope_parameters.
        rope = dict(cfg.get("rope_scaling") or {})
        rope.update(cfg.get("rope_parameters") or {})
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None
        if rope_type == "llama3":
            scaling = RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
        elif rope_type not in ("default", None):
            raise ModelConfigError(
                f"unsupported rope type {rope_type!r}; supported: default, llama3"
            )
        if dtype is None:
            name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
            dtype = DTYPES.get(str(name), torch.float32)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        bias = arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM") or bool(
            cfg.get("attention_bias", False)
        )
        moe = _moe_config(arch, cfg)
        quantization = _quantization(cfg.get("quantization_config"))
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bias,
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            dtype=dtype,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            moe=moe,
            quantization=quantization,
        ).with_quantization(None)

    @classmethod
    def load(cls, model: str | os.PathLike | None, dtype: torch.dtype | None = None) -> ModelConfig:
        """From a checkpoint dir (its config.json), a config.json path, or a preset name."""
        if model is None:
            # EngineConfig.model is None until resolve_model_and_device() picks the tiny model.
            raise ModelConfigError("no model given: resolve the engine config's model first")
        if isinstance(model, str) and model in PRESETS:
            return cls.from_dict(PRESETS[model], dtype)
        path = Path(model)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ModelConfigError(
                f"no config.json at {path} (and {str(model)!r} is not a preset: "
                f"{', '.join(sorted(PRESETS))})"
            )
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{path} is not valid JSON: {e}") from None
        # Generation config may carry the chat model's extra stop ids.
        gen = path.parent / "generation_config.json"
        if gen.is_file():
            try:
                g = json.loads(gen.read_text())
                if g.get("eos_token_id") is not None:
                    cfg = {**cfg, "eos_token_id": g["eos_token_id"]}
            except json.JSONDecodeError:
                pass
        return cls.from_dict(cfg, dtype)


def _quantization(qc: dict[str, Any] | None) -> str | None:
    """``"fp8"`` for the FP8 checkpoint formats ``engine.layers.fp8`` reads
    (e4m3 weights scaled per output channel or per tensor), None for none;
    any other quantization is refused by name."""
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("weight_block_size"):
            raise ModelConfigError(
                "block-wise FP8 checkpoints (weight_block_size) are not supported; "
                "FP8 with per-channel or per-tensor weight scales is"
            )
        return "fp8"
    if method == "compressed-tensors":
        groups = list((qc.get("config_groups") or {}).values())
        weights = [g.get("weights") or {} for g in groups]
        fp8 = [
            w.get("type") == "float"
            and w.get("num_bits") == 8
            and w.get("strategy") in ("channel", "tensor")
            for w in weights
        ]
        if groups and all(fp8):
            return "fp8"
        raise ModelConfigError(
            "unsupported compressed-tensors checkpoint: only 8-bit float weights "
            "scaled per channel or per tensor are read"
        )
    raise ModelConfigError(
        f"unsupported quantization_config quant_method {method!r}; supported: fp8, "
        "compressed-tensors (FP8 weights)"
    )


def _moe_config(arch: str, cfg: dict[str, Any]) -> MoEConfig | None:
    if arch not in MOE_ARCHITECTURES:
        return None
    # Qwen's checkpoints say num_experts, Mixtral's (and transformers >= 5 on
    # saving any of them) num_local_experts.
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    top_k = cfg.get("num_experts_per_tok")
    if not experts or not top_k:
        raise ModelConfigError(f"{arch} config.json lacks num_experts or num_experts_per_tok")
    experts, top_k = int(experts), int(top_k)
    if not 1 <= top_k <= experts:
        raise ModelConfigError(f"num_experts_per_tok ({top_k}) must be in 1..{experts}")
    mixtral = arch == "MixtralForCausalLM"
    if not mixtral and cfg.get("moe_intermediate_size") is None:
        raise ModelConfigError(f"{arch} config.json lacks moe_intermediate_size")
    step = int(cfg.get("decoder_sparse_step") or 1)
    if step < 1:
        raise ModelConfigError(f"decoder_sparse_step must be >= 1, got {step}")
    return MoEConfig(
        num_experts=experts,
        top_k=top_k,
        # Mixtral's experts are the dense MLP's size; it always renormalizes.
        intermediate_size=int(
            cfg["intermediate_size"] if mixtral else cfg["moe_intermediate_size"]
        ),
        norm_topk_prob=True if mixtral else bool(cfg.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
        decoder_sparse_step=step,
        mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
    )


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    if name is None or isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return None
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose from {', '.join(DTYPES)} or auto")
    return DTYPES[name]
