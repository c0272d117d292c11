"""On CUDA: the fused mixture-of-experts kernels against the torch definitions
(float64 products of the same bf16 weights), a MoE model's forward through
them against the torch reference path, and decode replayed from CUDA graphs
at batch 1, 3, 64 and 256 against the eager forward."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from graph_decode import (
    PAGE_SIZE,
    assert_graph_equals_eager,
    decode_specs,
    eager_logits,
    mixed_steps,
)

from engine.config import EngineConfig
from engine.forward_batch import ExtendSpec, build_forward_batch
from engine.layers import moe
from engine.model_config import ModelConfig
from engine.runner import ModelRunner

pytestmark = pytest.mark.gpu

MOE_MODEL = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 512,
    "intermediate_size": 1024,
    "moe_intermediate_size": 256,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "norm_topk_prob": True,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "vocab_size": 1000,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}
"""Small, with the head size FlashInfer's kernels are built for (bf16, 128)."""


def _case(n: int, experts: int, top_k: int, hidden: int, inter: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev, bf16 = "cuda", torch.bfloat16
    x = torch.randn(n, hidden, generator=g, device=dev).to(bf16)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g, device=dev) / hidden**0.5).to(bf16)
    w2 = (torch.randn(experts, hidden, inter, generator=g, device=dev) / inter**0.5).to(bf16)
    logits = torch.randn(n, experts, generator=g, device=dev) * 2
    return x, w13, w2, logits


def test_route_matches_torch() -> None:
    from engine.layers import moe_route

    # 5 tokens: one-token programs; 300: blocks of tokens.
    for n, experts, top_k, renorm in (
        (300, 128, 8, True),
        (5, 128, 8, True),
        (300, 60, 4, False),
        (5, 8, 2, True),
    ):
        logits = torch.randn(n, experts, device="cuda").to(torch.bfloat16)
        w, ids = moe_route.route(logits, top_k, renorm)
        rw, rids = moe.route(logits, top_k, renorm)
        # Same experts (order within a row may differ only on exact ties).
        assert torch.equal(ids.sort(-1).values, rids.sort(-1).values)
        torch.testing.assert_close(w.sort(-1).values, rw.sort(-1).values)


@pytest.mark.parametrize("n", [1, 3, 4, 5, 64, 256, 1000, 4096])
def test_fused_experts_match_float64(n: int) -> None:
    """Both paths (few pairs: matrix-vector; many: grouped GEMMs) in real
    Qwen3-30B-A3B proportions, against float64 products of the same weights."""
    from engine.layers import moe_triton

    experts, top_k, hidden, inter = 64, 8, 1024, 384
    x, w13, w2, logits = _case(n, experts, top_k, hidden, inter, seed=n)
    weights, ids = moe.route(logits, top_k, True)
    ours = moe_triton.fused_experts(x, w13, w2, weights, ids).double()
    ref = moe.experts_reference(x.double(), w13.double(), w2.double(), weights.double(), ids)
    scale = ref.abs().max().item()
    diff = (ours - ref).abs()
    # bf16 output and intermediate: a few units in the last place of bf16.
    assert diff.max().item() < 0.02 * scale, (diff.max().item(), scale)
    assert diff.mean().item() < 0.002 * scale


@pytest.mark.parametrize("n", [1, 3, 64, 256])
def test_fused_experts_replay_in_a_graph(n: int) -> None:
    from engine.layers import moe_route, moe_triton

    experts, top_k, hidden, inter = 64, 8, 1024, 384
    x, w13, w2, logits = _case(n, experts, top_k, hidden, inter, seed=7 + n)

    def step() -> torch.Tensor:
        weights, ids = moe_route.route(logits, top_k, True)
        return moe_triton.fused_experts(x, w13, w2, weights, ids)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in range(3):  # new inputs in the captured buffers
        x2, _, _, logits2 = _case(n, experts, top_k, hidden, inter, seed=100 + seed)
        x.copy_(x2)
        logits.copy_(logits2)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, step()), f"replay {seed}"


def _runner(
    graph_bs: int | None = None,
    num_pages: int = 1200,
    graph_tokens: int = 0,
    fresh: bool | None = None,
) -> ModelRunner:
    """``graph_tokens``: piecewise graphs' largest forward (0, the default:
    every forward but the decode graphs' eager, so ``reference_experts`` applies);
    ``fresh``: ``fresh_prefill_graphs`` (None: auto)."""
    mc = ModelConfig.from_dict(MOE_MODEL, dtype=torch.bfloat16)
    cfg = EngineConfig(
        model="moe-kernel-test",
        load_format="dummy",
        device="cuda:0",
        page_size=16,
        num_pages=num_pages,
        max_running_requests=256,
        cuda_graph_max_bs=graph_bs,
        cuda_graph_max_tokens=graph_tokens,
        fresh_prefill_graphs=fresh,
    ).resolve(mc)
    runner = ModelRunner(cfg, mc)
    # Dummy router weights are small; scaled up, a token's top-k is clear of
    # the next expert, so bf16 rounding does not change which experts run.
    with torch.no_grad():
        for layer in runner.model.model.layers:
            layer.mlp.gate.weight.mul_(20)
    return runner


@contextmanager
def reference_experts() -> Iterator[None]:
    """The torch definitions instead of the fused kernels, for a while."""
    saved = moe.use_fused
    moe.use_fused = lambda x: False
    try:
        yield
    finally:
        moe.use_fused = saved


def test_moe_model_fused_matches_reference() -> None:
    """Prefill of several prompts, a chunk beside decoding rows, decode: the
    same runner with the fused kernels and with the torch reference."""
    runner = _runner(graph_bs=0)
    ps, gen = 16, torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (5, 37, 70, 300)]
    tables = [runner.pool.allocator.alloc(-(-(len(p) + 4) // ps)) for p in prompts]
    assert all(t is not None for t in tables)
    steps = [
        [ExtendSpec(p, 0, t, "all") for p, t in zip(prompts[:3], tables[:3])]
        + [ExtendSpec(prompts[3][:200], 0, tables[3], "all")],
        [ExtendSpec([7], len(p), t) for p, t in zip(prompts[:3], tables[:3])]
        + [ExtendSpec(prompts[3][200:], 200, tables[3], "all")],
        [ExtendSpec([9], len(p) + 1, t) for p, t in zip(prompts, tables)],
    ]
    for i, specs in enumerate(steps):
        batch = build_forward_batch(specs, ps, "cuda:0")
        # The reference first: the fused forward then writes the same KV again.
        with reference_experts():
            ref = runner.forward_logits(batch).float()
        fused = runner.forward_logits(batch).float()
        scale = ref.abs().max().item()
        assert (fused - ref).abs().max().item() < 0.05 * scale, f"step {i}"
        agree = (fused.argmax(-1) == ref.argmax(-1)).float().mean().item()
        assert agree > 0.95, f"step {i}: argmax agrees on {agree:.0%}"


@pytest.mark.parametrize("batch_size", [1, 3, 64, 256])
def test_moe_cuda_graph_decode_equals_eager(batch_size: int) -> None:
    runner = _runner(graph_bs=256)
    assert runner.graphs is not None and 256 in runner.graphs.sizes
    runner.pool.kv.normal_()
    batch = build_forward_batch(decode_specs(runner, batch_size), PAGE_SIZE, "cuda:0")
    eager = assert_graph_equals_eager(runner, batch)
    with torch.inference_mode(), reference_experts():
        ref = eager_logits(runner, runner.attn, batch)
    scale = ref.abs().max().item()
    assert (eager - ref).abs().max().item() < 0.05 * scale
    agree = (eager.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree > 0.95


def test_moe_piece_graphs_equal_eager() -> None:
    """Prefill, a chunk beside decoding rows and decode replayed from the
    piecewise graphs (the experts' grouped kernels captured at each bucket's
    token count) against the eager forward of the same weights; and with
    ``fresh_prefill_graphs``, a fresh prompt's forward as one graph on Triton's attention
    (within 2% of the eager logits, as FlashInfer's and Triton's attention
    sum in other orders)."""
    runners = [
        _runner(graph_bs=0),
        _runner(graph_bs=0, graph_tokens=512, fresh=False),
        _runner(graph_bs=0, graph_tokens=512, fresh=True),
    ]
    assert runners[0].pieces is None and runners[1].pieces is not None
    assert runners[2].pieces is not None and runners[2].pieces.fresh_attn is not None
    free = [r.pool.allocator.num_free for r in runners]
    steps, taken = mixed_steps(runners)
    for i, specs in enumerate(steps):
        ref, got, fresh = (
            r.forward_logits(build_forward_batch(specs, PAGE_SIZE, "cuda:0")).float()
            for r in runners
        )
        scale = ref.abs().max().item()
        assert (got - ref).abs().max().item() < 0.01 * scale, f"step {i}"
        assert ((fresh - ref).norm() / ref.norm()).item() < 2e-2, f"step {i}: fresh"
        for out in (got, fresh):
            agree = (out.argmax(-1) == ref.argmax(-1)).float().mean().item()
            assert agree > 0.95, f"step {i}: argmax agrees on {agree:.0%}"
    for r, pages, n in zip(runners, taken, free):
        r.pool.allocator.free(pages)
        assert r.pool.allocator.num_free == n
