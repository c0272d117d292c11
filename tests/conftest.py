from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# name -> (HF config class name, config overrides). Cover GQA ratios 1, 2 and 4, MQA,
# tied and untied embeddings, Llama-3 rope scaling, Qwen2 bias, Qwen3 q/k norm.
TINY_VARIANTS: dict[str, tuple[str, dict]] = {
    "llama-mha-llama3rope": (
        "LlamaConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=4,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "llama-gqa4-tied": (
        "LlamaConfig",
        dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True),
    ),
    "qwen2-gqa2": (
        "Qwen2Config",
        dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    ),
    "qwen3-gqa2-tied": (
        "Qwen3Config",
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
    ),
    "qwen3-gqa4": (
        "Qwen3Config",
        dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False),
    ),
    # One KV head: more tensor-parallel ranks than KV heads replicates it.
    "llama-mqa": (
        "LlamaConfig",
        dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False),
    ),
    # Mixtures of experts: expert counts and top-k, with and without the
    # renormalized top-k, a shared expert and a dense layer.
    "qwen3moe-e8k2-norm": (
        "Qwen3MoeConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
        ),
    ),
    "qwen3moe-e16k4": (
        "Qwen3MoeConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=16,
            norm_topk_prob=False,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3moe-e4k1": (
        "Qwen3MoeConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=1,
            moe_intermediate_size=32,
            norm_topk_prob=False,
        ),
    ),
    "qwen2moe-shared": (
        "Qwen2MoeConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
        ),
    ),
    "mixtral-e4k2": (
        "MixtralConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=32,
            tie_word_embeddings=False,
        ),
    ),
}
MOE_VARIANTS = [v for v, (cls, _) in TINY_VARIANTS.items() if "Moe" in cls or "Mixtral" in cls]


def make_hf_model(variant: str, seed: int = 0) -> torch.nn.Module:
    import transformers

    cls_name, overrides = TINY_VARIANTS[variant]
    base = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        # Large enough that logits are well separated: greedy comparisons
        # should not hinge on near-ties.
        initializer_range=0.15,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    overrides = copy.deepcopy(overrides)
    rope_scaling = overrides.pop("rope_scaling", None)
    cfg = getattr(transformers, cls_name)(**{**base, **overrides})
    if rope_scaling is not None:
        cfg.rope_parameters = {"rope_theta": base["rope_theta"], **rope_scaling}
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model_cls = getattr(transformers, cls_name.replace("Config", "ForCausalLM"))
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Random (not unit) norm weights and biases so a loader that drops
            # them is caught.
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture(scope="session")
def model_dir() -> str:
    """The built-in tiny model's checkpoint directory (built on first use)."""
    from engine.tiny import ensure_tiny_model

    return str(ensure_tiny_model())


@pytest.fixture(scope="session")
def hf_checkpoint(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[..., tuple[Path, torch.nn.Module]]:
    """Build (once per session) a HF checkpoint dir for a tiny variant."""
    cache: dict[tuple, tuple[Path, torch.nn.Module]] = {}

    def get(variant: str, shard: bool = False) -> tuple[Path, torch.nn.Module]:
        key = (variant, shard)
        if key not in cache:
            model = make_hf_model(variant)
            d = tmp_path_factory.mktemp(f"{variant}{'-sharded' if shard else ''}")
            model.save_pretrained(d, max_shard_size="100KB" if shard else "10GB")
            cache[key] = (d, model)
        return cache[key]

    return get
