"""Model classes by HF architecture name."""

from __future__ import annotations

from torch import nn

from engine.layers.kernels import LayerKernels
from engine.model_config import SUPPORTED_ARCHITECTURES, ModelConfig, ModelConfigError
from engine.models.llama import LlamaForCausalLM
from engine.models.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from engine.models.qwen2 import Qwen2ForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.parallel.group import TPGroup

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}
assert tuple(MODEL_REGISTRY) == SUPPORTED_ARCHITECTURES


def build_model(
    cfg: ModelConfig, kernels: LayerKernels, tp: TPGroup | None = None
) -> LlamaForCausalLM:
    """The model of ``cfg``; with ``tp``, this rank's shard of it."""
    try:
        cls = MODEL_REGISTRY[cfg.architecture]
    except KeyError:
        raise ModelConfigError(
            f"unsupported architecture {cfg.architecture!r}; supported: {', '.join(MODEL_REGISTRY)}"
        ) from None
    return cls(cfg, kernels, tp)
