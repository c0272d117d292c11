"""Decode batches for the CUDA-graph tests, and the eager forward a graph's
replay is checked against (CUDA, page size 16)."""

from __future__ import annotations

from typing import Any

import torch

from engine.attention.base import AttentionBackend
from engine.config import EngineConfig
from engine.forward_batch import ExtendSpec, ForwardBatch
from engine.model_config import ModelConfig
from engine.runner import ModelRunner

PAGE_SIZE = 16
SMALL_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "vocab_size": 1000,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}
"""A model's config.json: small, in the head size FlashInfer's kernels are
built for (bf16, 128), four query heads per KV head (tensor-core decode)."""


def small_runner(
    graph_bs: int,
    arch: str = "LlamaForCausalLM",
    kv_heads: int = 1,
    num_pages: int = 300,
    **settings: Any,
) -> ModelRunner:
    """A runner of ``SMALL_LLAMA`` as ``arch`` (Qwen3: with q/k norms) with
    ``kv_heads`` KV heads and dummy bf16 weights on cuda:0: ``num_pages``
    pages of ``PAGE_SIZE``, decode graphs up to ``graph_bs`` rows (0: none),
    and the given engine settings; piecewise graphs only where they name
    ``cuda_graph_max_tokens`` (otherwise every other forward is eager)."""
    settings.setdefault("cuda_graph_max_tokens", 0)
    config = {**SMALL_LLAMA, "architectures": [arch], "num_key_value_heads": kv_heads}
    mc = ModelConfig.from_dict(config, dtype=torch.bfloat16)
    cfg = EngineConfig(
        model="small-test",
        load_format="dummy",
        device="cuda:0",
        page_size=PAGE_SIZE,
        num_pages=num_pages,
        cuda_graph_max_bs=graph_bs,
        **settings,
    ).resolve(mc)
    return ModelRunner(cfg, mc)


def decode_specs(runner: ModelRunner, batch_size: int) -> list[ExtendSpec]:
    """``batch_size`` decoding rows of contexts 8 to 67, pages from the pool,
    one random token each (seeded by the batch size)."""
    gen = torch.Generator().manual_seed(batch_size)
    specs = []
    for i in range(batch_size):
        ctx = 8 + (37 * i) % 60
        pages = runner.pool.allocator.alloc(-(-(ctx + 1) // PAGE_SIZE))
        assert pages is not None
        specs.append(ExtendSpec([int(torch.randint(3, 1000, (1,), generator=gen))], ctx, pages))
    return specs


def eager_logits(runner: ModelRunner, attn: AttentionBackend, batch: ForwardBatch) -> torch.Tensor:
    """The batch's logits from an eager forward through ``attn``."""
    attn.begin_forward(batch)
    hidden = runner.model(batch.input_ids, batch.positions, attn)
    return runner.model.compute_logits(hidden[batch.logits_indices])


def assert_graph_equals_eager(runner: ModelRunner, batch: ForwardBatch) -> torch.Tensor:
    """The batch replayed from the runner's CUDA graph gives the eager
    forward's logits (to 1% of their largest) and tokens; returns the eager ones."""
    assert runner.graphs is not None and runner.graphs.can_run(batch)
    with torch.inference_mode():
        graph = runner.forward_logits(batch).clone()
        eager = eager_logits(runner, runner.attn, batch)
    scale = eager.abs().max().item()
    assert (graph - eager).abs().max().item() < 0.01 * scale
    assert graph.argmax(-1).tolist() == eager.argmax(-1).tolist()
    return eager


def mixed_steps(runners: list[ModelRunner]) -> tuple[list[list[ExtendSpec]], list[list[int]]]:
    """The same forwards for every runner, each kind a serving loop makes:
    prompts prefilled together and in chunks over a cached prefix, decode
    rows alone and mixed with prompts (decode rows first, and one after a
    prompt). Five prompts' pages (out of pool order) are taken from each pool
    alike; returns the steps and every runner's pages, to free."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (5, 37, 70, 50, 30)]
    ps = PAGE_SIZE
    tables = []
    for p in prompts:
        pages = runners[0].pool.allocator.alloc(-(-(len(p) + 8) // ps))
        assert pages is not None
        perm = torch.randperm(len(pages), generator=gen).tolist()
        tables.append([pages[i] for i in perm])  # out of pool order
    taken = [[page for t in tables for page in t]]
    for r in runners[1:]:
        got = [r.pool.allocator.alloc(-(-(len(p) + 8) // ps)) for p in prompts]
        assert all(g is not None and sorted(g) == sorted(t) for g, t in zip(got, tables))
        taken.append(list(taken[0]))
    steps: list[list[ExtendSpec]] = []
    # 1. Prefill three prompts at once; the fourth only its first 20 tokens.
    steps.append([ExtendSpec(p, 0, t, "all") for p, t in zip(prompts[:3], tables[:3])])
    steps[-1].append(ExtendSpec(prompts[3][:20], 0, tables[3], "all"))
    # 2. The fourth's next chunk over its cached prefix, with the others decoding.
    steps.append(
        [ExtendSpec([7], len(p), t) for p, t in zip(prompts[:3], tables[:3])]
        + [ExtendSpec(prompts[3][20:], 20, tables[3], "all")]
    )
    # 3. Pure decode steps for all four.
    for k in range(3):
        steps.append(
            [
                ExtendSpec([11 + k], len(p) + (1 + k if i < 3 else k), t)
                for i, (p, t) in enumerate(zip(prompts[:4], tables))
            ]
        )
    # 4. Decoding rows first (the decode kernel), then a new prompt and one more
    # decoding row after it (both on the prefill kernel).
    steps.append(
        [ExtendSpec([13], len(p) + 3, t) for p, t in zip(prompts[:2], tables[:2])]
        + [ExtendSpec(prompts[4], 0, tables[4], "all")]
        + [ExtendSpec([13], len(prompts[2]) + 3, tables[2])]
    )
    return steps, taken
