"""Decode batches for the CUDA-graph tests, and the eager forward a graph's
replay is checked against (CUDA, page size 16)."""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend
from engine.forward_batch import ExtendSpec, ForwardBatch
from engine.runner import ModelRunner

PAGE_SIZE = 16


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
