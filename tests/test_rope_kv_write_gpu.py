"""On CUDA: layers whose q/k norms, rotary embedding, KV scales and KV write
run as one kernel (``--fuse-rope-kv-write``) against the same model with the
separate kernels, on the same dummy weights and the same forwards (prefill,
chunks over a cached prefix, mixed and pure decode batches, a decode graph),
for Llama (rotary only) and Qwen3 (q/k norms) layers, bf16 and e4m3 pages."""

from __future__ import annotations

import pytest
import torch
from graph_decode import (
    PAGE_SIZE,
    assert_graph_equals_eager,
    decode_specs,
    mixed_steps,
    small_runner,
)

from engine.forward_batch import build_forward_batch
from engine.runner import ModelRunner

pytestmark = pytest.mark.gpu


def _runner(arch: str, fused: bool, graph_bs: int, kv_cache_dtype: str) -> ModelRunner:
    runner = small_runner(graph_bs, arch, kv_cache_dtype=kv_cache_dtype, fuse_rope_kv_write=fused)
    assert runner.attn.fuses_prologue == fused
    return runner


def _assert_close(got: torch.Tensor, ref: torch.Tensor, what: str, e4m3: bool) -> None:
    """Logits of the fused and the separate kernels. On e4m3 pages the two
    round differently: the separate kernels round q/k to bf16 after the norm
    and after the rotation and only then to e4m3, the fused one rounds its
    float32 result once, so a few percent of the K/V entries sit one e4m3
    step (2^-3) apart, and the logits move by about that fraction of it."""
    scale = ref.abs().max().item()
    diff = (got.float() - ref.float()).abs()
    worst, mean = diff.max().item() / scale, diff.mean().item() / scale
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"{what}: max {worst:.2e}, mean {mean:.2e} of the largest logit, argmax {agree:.0%}")
    assert worst < (0.06 if e4m3 else 0.03), f"{what}: max {worst:.2e} of {scale}"
    assert mean < (0.01 if e4m3 else 0.003), f"{what}: mean {mean:.2e} of {scale}"
    # On e4m3 pages the random model's flat logits tie within that noise.
    assert e4m3 or agree > 0.9, f"{what}: argmax agrees on {agree:.0%}"


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_fused_prologue_matches_the_separate_kernels(arch: str, kv_cache_dtype: str) -> None:
    runners = [
        _runner(arch, False, 0, kv_cache_dtype),
        _runner(arch, True, 0, kv_cache_dtype),
        _runner(arch, True, 8, kv_cache_dtype),  # decode of four rows from a graph
    ]
    assert runners[0].model_config.qk_norm == (arch == "Qwen3ForCausalLM")
    free = [r.pool.allocator.num_free for r in runners]
    steps, taken = mixed_steps(runners)
    with torch.inference_mode():
        for i, specs in enumerate(steps):
            batch = build_forward_batch(specs, PAGE_SIZE, "cuda:0")
            ref, *outs = (r.forward_logits(batch) for r in runners)
            for j, got in enumerate(outs):
                _assert_close(got, ref, f"step {i}, runner {j + 1}", kv_cache_dtype != "auto")
            # The same kernels, eager or replayed: the same numbers up to the work split.
            apart = (outs[1] - outs[0]).abs().max().item() / ref.abs().max().item()
            assert apart < 0.01, f"step {i}: graph and eager {apart:.2e} apart"
    # Every K and V row the fused kernel wrote is where, and what, the separate
    # kernels wrote. Layer 0's rows come from the same embeddings on both sides:
    # there they agree to an ulp or two (bf16: the separate norm rounds once
    # more) or to one step of e4m3. A later layer's input already differs by
    # what the pages before it did, which on e4m3 pages takes a few of its
    # rows past one step: there, at most 1% of the entries (bf16: none).
    written = sorted(taken[0])
    pages = runners[0].pool.kv[written].float()
    rel = 0.13 if kv_cache_dtype == "fp8_e4m3" else 0.02
    for r in runners[1:]:
        got = r.pool.kv[written].float()
        bad = (got - pages).abs() > rel * pages.abs() + 0.02
        first = bad[:, 0]
        assert not first.any(), (int(first.sum()), got[:, 0][first][:8].tolist())
        share = bad.float().mean().item()
        assert share <= (0.01 if kv_cache_dtype == "fp8_e4m3" else 0.0), share
    for r, pages_taken in zip(runners, taken):
        r.pool.allocator.free(pages_taken)
    assert [r.pool.allocator.num_free for r in runners] == free


@pytest.mark.parametrize("batch_size", [1, 3, 64])
def test_fused_prologue_decode_graph_equals_eager(batch_size: int) -> None:
    runner = _runner("Qwen3ForCausalLM", True, 64, "fp8_e4m3")
    free = runner.pool.allocator.num_free
    runner.pool.kv.copy_(
        (torch.randn_like(runner.pool.kv, dtype=torch.float32)).to(torch.float8_e4m3fn)
    )
    specs = decode_specs(runner, batch_size)
    assert_graph_equals_eager(runner, build_forward_batch(specs, PAGE_SIZE, "cuda:0"))
    for s in specs:
        runner.pool.allocator.free(list(s.page_table))
    assert runner.pool.allocator.num_free == free


def test_fused_prologue_with_checkpoint_kv_scales() -> None:
    """The scales go onto the query, the written K and V and the output as
    the separate path puts them."""
    runners = [_runner("Qwen3ForCausalLM", f, 0, "fp8_e4m3") for f in (False, True)]
    for r in runners:
        for layer in r.model.model.layers:
            layer.self_attn.kv_scales = (0.25, 0.5)
    steps, taken = mixed_steps(runners)
    with torch.inference_mode():
        for i, specs in enumerate(steps):
            batch = build_forward_batch(specs, PAGE_SIZE, "cuda:0")
            ref, got = (r.forward_logits(batch) for r in runners)
            _assert_close(got, ref, f"step {i}", True)
    for r, pages_taken in zip(runners, taken):
        r.pool.allocator.free(pages_taken)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("e4m3", [False, True], ids=["model-dtype-pages", "e4m3-pages"])
def test_write_back_leaves_what_the_pages_hold(dtype: torch.dtype, e4m3: bool) -> None:
    """``write_back`` (the fresh-prompt graphs' form, each row its own
    request): k and v rewritten to the values the pages hold, to the bit.
    Rotated rows at their positions, with a K and a V scale; then rows at
    position 0 (where the rotation leaves them as they are) of the probes of
    ``e4m3_values``, which on e4m3 pages must also be torch's own cast."""
    from e4m3_values import e4m3_rounded, probe_rows

    from engine.attention.rope_kv_write import AppendIndex, QKPrologue, rope_kv_write
    from engine.kvcache.pool import KVPool, KVPoolConfig
    from engine.layers.kernels import TorchKernels
    from engine.layers.rotary import RotaryEmbedding

    heads, kv_heads, d, n = 4, 2, 128, 128
    kv_dtype = torch.float8_e4m3fn if e4m3 else dtype
    g = torch.Generator().manual_seed(4)
    pool = KVPool(KVPoolConfig(n // PAGE_SIZE + 1, PAGE_SIZE, 1, kv_heads, d, kv_dtype, "cuda:0"))
    rows = torch.arange(n, device="cuda:0")
    pages, slots = 1 + rows // PAGE_SIZE, rows % PAGE_SIZE
    index = AppendIndex(rows, slots, rows, pages, rows)
    table = RotaryEmbedding(d, 10000.0, None, 1024, TorchKernels()).table().cuda()
    width = (heads + 2 * kv_heads) * d
    random = (torch.randn(n, width, generator=g) * 3).to(dtype).cuda()
    probes = torch.zeros(n, width, dtype=dtype)
    probes[:, heads * d :] = probe_rows(n, 2 * kv_heads * d, seed=5).to(dtype)
    for qkv, positions, scales in (
        (random, rows, (0.7, 1.3)),
        (probes.cuda(), torch.zeros_like(rows), None),
    ):
        q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
        k, v = k.view(n, kv_heads, d), v.view(n, kv_heads, d)
        kv_in = qkv[:, heads * d :].float().clone()
        pre = QKPrologue(positions, table, None, None, 1e-6, scales)
        rope_kv_write(q.view(n, heads, d), k, v, pre, pool.k_layer(0), pool.v_layer(0), index,
                      write_back=True)  # fmt: skip
        held_k = pool.k_layer(0)[pages, slots].to(dtype)
        held_v = pool.v_layer(0)[pages, slots].to(dtype)
        assert torch.equal(k, held_k), (k != held_k).sum().item()
        assert torch.equal(v, held_v), (v != held_v).sum().item()
        if scales is None and e4m3:
            want = e4m3_rounded(kv_in).view(n, 2, kv_heads, d)
            assert torch.equal(held_k.float(), want[:, 0]) and torch.equal(
                held_v.float(), want[:, 1]
            )
