"""On CUDA: forwards replayed from the piecewise graphs (``engine.piece_graphs``)
against the eager forward of the same weights, for every kind of step a
serving loop makes, with the kernels each model and flag set takes inside
the pieces (FP8 products and their fused quantization, the fused q/k
prologue and e4m3 pages in the eager attention between them)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from graph_decode import PAGE_SIZE, mixed_steps, small_runner

from engine.forward_batch import ExtendSpec, build_forward_batch
from engine.piece_graphs import PieceGraphs

pytestmark = pytest.mark.gpu

CASES = {
    "llama": ("LlamaForCausalLM", {}),
    "qwen3-fused-prologue": ("Qwen3ForCausalLM", {}),
    "fp8-e4m3": ("LlamaForCausalLM", {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"}),
}


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("case", list(CASES))
def test_piece_graphs_equal_eager(case: str) -> None:
    """Each step three ways: replayed from the graphs; the same pieces at the
    same padded size run eagerly (the same kernels: equal but for the
    capture); and the model's own forward at the batch's real size, where the
    products may take other kernels (bf16: within 2%; FP8, whose rounding
    steps amplify a changed summation order: within 5%, as its logits alone
    and in a batch are), the greedy tokens of steps of 16 rows or more
    agreeing on 90% of them."""
    arch, settings = CASES[case]
    runners = [
        small_runner(0, arch, cuda_graph_max_tokens=0, **settings),
        small_runner(0, arch, cuda_graph_max_tokens=256, fresh_prefill_graphs=False, **settings),
    ]
    runner = runners[1]
    pieces = runner.pieces
    assert runners[0].pieces is None and pieces is not None and pieces.sizes[-1] == 256
    eager_pieces = PieceGraphs(runner.model, runner.device, 256, capture=False)
    free = [r.pool.allocator.num_free for r in runners]
    steps, taken = mixed_steps(runners)
    for i, specs in enumerate(steps):
        batch = build_forward_batch(specs, PAGE_SIZE, "cuda:0")
        with torch.inference_mode():
            ref, got = (r.forward_logits(batch).float() for r in runners)
            hidden = eager_pieces.run(batch, runner.attn)
            same = runner.model.compute_logits(hidden[batch.logits_indices]).float()
        assert _rel(got, same) < 1e-3, f"step {i}: replay against the eager pieces"
        rel = _rel(got, ref)
        assert rel < (5e-2 if settings else 2e-2), f"step {i}: {rel:.2e} from the forward"
        if got.shape[0] >= 16:  # a share of a handful of rows says little
            agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
            assert agree > 0.9, f"step {i}: argmax agrees on {agree:.0%}"
    for r, pages, n in zip(runners, taken, free):
        r.pool.allocator.free(pages)
        assert r.pool.allocator.num_free == n


def test_piece_graphs_replay_alike_and_fall_back_past_their_largest() -> None:
    """The same prompt twice gives the same logits to the bit (the buffers a
    replay reads are all refilled); a prompt past the largest bucket runs
    eagerly, and one of the smaller buckets still replays after it."""
    runner = small_runner(0, cuda_graph_max_tokens=128)
    pieces = runner.pieces
    assert pieces is not None and pieces.sizes == [64, 128]
    gen = torch.Generator().manual_seed(1)
    a, b, c = (torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (100, 300, 40))
    alloc = runner.pool.allocator
    free = alloc.num_free
    outs = []
    for ids in (a, b, a, c):
        pages = alloc.alloc(-(-len(ids) // PAGE_SIZE))
        assert pages is not None
        batch = build_forward_batch([ExtendSpec(ids, 0, pages, "all")], PAGE_SIZE, "cuda:0")
        assert pieces.can_run(batch) == (len(ids) <= 128)
        with torch.inference_mode():
            outs.append(runner.forward_logits(batch).float().clone())
        alloc.free(pages)
    assert torch.equal(outs[0], outs[2])
    assert outs[1].isfinite().all() and outs[3].isfinite().all()
    assert alloc.num_free == free


FP8_E4M3 = {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"}


def _first_layer_kv(r: Any, specs: list[ExtendSpec], lens: list[int]) -> list[torch.Tensor]:
    """Each prompt's layer-0 K and V as its pages hold them ``[2, tokens, heads, dim]``."""
    out = []
    for spec, n in zip(specs, lens):
        pages = torch.tensor(spec.page_table, device=r.pool.kv.device)
        kv = r.pool.kv[pages, 0].transpose(0, 1).flatten(1, 2)  # [2, pages x page_size, ...]
        out.append(kv[:, :n].float())
    return out


@pytest.mark.parametrize(
    ("arch", "settings"),
    [("LlamaForCausalLM", {}), ("Qwen3ForCausalLM", {}), ("LlamaForCausalLM", FP8_E4M3),
     ("LlamaForCausalLM", {**FP8_E4M3, "fuse_rope_kv_write": False})],
    ids=["llama", "qwen3-fused-prologue", "fp8-e4m3-fused-prologue", "fp8-e4m3-separate"],
)  # fmt: skip
def test_fresh_prompts_replay_as_one_graph(arch: str, settings: dict) -> None:
    """``fresh_prefill_graphs``: fresh prompts replayed as one graph a bucket
    (the Triton kernel, no plan) against the piecewise graphs of the same
    weights (FlashInfer's attention: within 2%, greedy tokens of 16 rows or
    more agreeing on 90%); the same prompt twice the same to the bit; a
    batch with a cached prefix, and one past the largest bucket, take the
    other paths. Both sides run the same q/k prologue: the fused kernel
    where the engine fuses it (Qwen3's q/k norms, e4m3 pages), whose fresh
    side writes k and v back as the pages hold them, or the separate
    kernels; so attention is all that differs. FP8 weights over e4m3 pages
    within 8% and agreeing on 85%: the sums' other order moves some
    activations across a step of their per-token e4m3 rounding (6% of the
    value) in the next products; a wrong mask or scale moves the logits by
    far more."""
    one = {"cuda_graph_max_tokens": 128, **settings}
    fresh = small_runner(0, arch, fresh_prefill_graphs=True, **one)
    pieces = small_runner(0, arch, **one)
    assert fresh.pieces is not None and fresh.pieces.fresh_attn is fresh.attn
    free = [r.pool.allocator.num_free for r in (fresh, pieces)]
    cases = [[100], [5, 60, 1], [64, 64], [100], [200]]
    outs = []
    for lens in cases:
        logits, first_layer = [], []
        for r in (fresh, pieces):
            specs = []
            for n in lens:
                table = r.pool.allocator.alloc(-(-n // PAGE_SIZE))
                assert table is not None
                ids = torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(n))
                specs.append(ExtendSpec(ids.tolist(), 0, table, "all"))
            batch = build_forward_batch(specs, PAGE_SIZE, "cuda:0")
            if r is fresh:
                assert r.pieces.can_run_fresh(batch) == (sum(lens) <= 128)
            with torch.inference_mode():
                logits.append(r.forward_logits(batch).float().clone())
            first_layer.append(_first_layer_kv(r, specs, lens))
            if r is fresh and sum(lens) <= 128:
                prefix = ExtendSpec([7], 1, specs[0].page_table, "all")  # after one cached token
                assert not r.pieces.can_run_fresh(
                    build_forward_batch([prefix], PAGE_SIZE, "cuda:0")
                )
            for spec in specs:
                r.pool.allocator.free(spec.page_table)
        got, ref = logits
        assert got.isfinite().all()
        # The first layer's K and V come from the same projection and the
        # same prologue on both sides: the same pages, to the bit.
        assert all(map(torch.equal, *first_layer)), lens
        assert _rel(got, ref) < (8e-2 if settings else 2e-2), lens
        if got.shape[0] >= 16:
            agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
            assert agree > (0.85 if settings else 0.9), lens
        outs.append(got)
    assert torch.equal(outs[0], outs[3])
    assert [r.pool.allocator.num_free for r in (fresh, pieces)] == free
