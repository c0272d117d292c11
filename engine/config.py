"""Model and engine configuration.

``ModelConfig`` is read from a HF ``config.json`` (or a named preset for dummy
weights); ``EngineConfig`` holds the runtime knobs. Both are frozen: values
that start as "auto" are resolved by ``EngineConfig.resolve`` building a new
config.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from engine.kvcache.pool import KVPoolConfig
from engine.presets import PRESETS

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

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
        bias = arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False))
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
            qk_norm=arch == "Qwen3ForCausalLM",
            dtype=dtype,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
        )

    @classmethod
    def load(cls, model: str | os.PathLike, dtype: torch.dtype | None = None) -> ModelConfig:
        """From a checkpoint dir (its config.json), a config.json path, or a preset name."""
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


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    if name is None or isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return None
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose from {', '.join(DTYPES)} or auto")
    return DTYPES[name]


@dataclass(frozen=True)
class EngineConfig:
    model: str
    """Checkpoint directory, config.json path, or preset name (with load_format='dummy')."""
    load_format: str = "auto"
    """'auto' (safetensors from the checkpoint dir) or 'dummy' (random weights)."""
    dtype: str = "auto"
    device: str = "cpu"
    page_size: int = 1
    num_pages: int | None = None
    """Pages in the KV pool; None sizes it from kv_cache_memory_gb."""
    kv_cache_memory_gb: float = 0.25
    max_num_batched_tokens: int = 2048
    """Token budget of one forward (prefill chunks plus decode tokens)."""
    chunk_size: int | None = None
    """Largest prefill chunk of one request per step; None means the token budget."""
    max_running_requests: int = 256
    context_length: int | None = None
    """None: the model's max_position_embeddings."""
    enable_prefix_cache: bool = True
    overlap: bool = True
    """Schedule step N+1 while step N runs (decode and colocated engines)."""
    attention_backend: str = "auto"
    cuda_graph_max_bs: int | None = None
    """Largest decode batch replayed from a CUDA graph; 0 disables graphs, None
    picks min(max_running_requests, 64) with the flashinfer backend, else 0."""
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError("chunk_size must be >= 1")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 0:
            raise ValueError("cuda_graph_max_bs must be >= 0")

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return parse_dtype(self.dtype)

    @property
    def effective_chunk_size(self) -> int:
        return min(self.chunk_size or self.max_num_batched_tokens, self.max_num_batched_tokens)

    def resolve(self, model_config: ModelConfig) -> EngineConfig:
        """Fill the 'auto' values from the model (returns a new config)."""
        ctx = self.context_length or model_config.max_position_embeddings
        num_pages = self.num_pages
        if num_pages is None:
            m = model_config
            per_page = KVPoolConfig.bytes_per_page(
                self.page_size, m.num_layers, m.num_kv_heads, m.head_dim, m.dtype
            )
            num_pages = max(2, int(self.kv_cache_memory_gb * (1 << 30)) // per_page + 1)
        backend = self.attention_backend
        if backend == "auto":
            from engine.attention.flashinfer import flashinfer_usable

            usable = flashinfer_usable(self.device, model_config.dtype, model_config.head_dim)
            backend = "flashinfer" if usable else "torch_native"
        graph_bs = self.cuda_graph_max_bs
        if graph_bs is None:
            graph_bs = min(self.max_running_requests, 64) if backend == "flashinfer" else 0
        if graph_bs and backend != "flashinfer":
            raise ValueError("CUDA graphs need attention_backend 'flashinfer'")
        return replace(
            self,
            context_length=ctx,
            num_pages=num_pages,
            attention_backend=backend,
            cuda_graph_max_bs=graph_bs,
        )
