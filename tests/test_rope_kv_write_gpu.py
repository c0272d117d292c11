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
    SMALL_LLAMA,
    assert_graph_equals_eager,
    decode_specs,
    mixed_steps,
)

from engine.config import EngineConfig
from engine.forward_batch import build_forward_batch
from engine.model_config import ModelConfig
from engine.runner import ModelRunner

pytestmark = pytest.mark.gpu


def _runner(arch: str, fused: bool, graph_bs: int, kv_cache_dtype: str) -> ModelRunner:
    mc = ModelConfig.from_dict({**SMALL_LLAMA, "architectures": [arch]}, dtype=torch.bfloat16)
    cfg = EngineConfig(
        model="fused-prologue-test",
        load_format="dummy",
        device="cuda:0",
        page_size=PAGE_SIZE,
        num_pages=300,
        cuda_graph_max_bs=graph_bs,
        kv_cache_dtype=kv_cache_dtype,
        fuse_rope_kv_write=fused,
    ).resolve(mc)
    runner = ModelRunner(cfg, mc)
    assert runner.attn.fuses_prologue == fused
    return runner


def _assert_close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    scale = ref.abs().max().item()
    diff = (got.float() - ref.float()).abs()
    assert diff.max().item() < 0.03 * scale, f"{what}: {diff.max().item()} vs {scale}"
    assert diff.mean().item() < 0.003 * scale, f"{what}: mean {diff.mean().item()}"
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree > 0.9, f"{what}: argmax agrees on {agree:.0%}"


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
                _assert_close(got, ref, f"step {i}, runner {j + 1}")
            # The same kernels, eager or replayed: the same numbers up to the work split.
            assert (outs[1] - outs[0]).abs().max().item() < 0.01 * ref.abs().max().item()
    # Every K and V row the fused kernel wrote is where, and what, the separate
    # kernels wrote (e4m3 pages: to one step of the format).
    # (bf16 rows may differ by an ulp or two: the separate norm rounds once.)
    written = sorted(taken[0])
    pages = runners[0].pool.kv[written].float()
    rel = 0.13 if kv_cache_dtype == "fp8_e4m3" else 0.02
    for r in runners[1:]:
        got = r.pool.kv[written].float()
        bad = (got - pages).abs() > rel * pages.abs() + 0.02
        assert not bad.any(), (int(bad.sum()), got[bad][:8].tolist(), pages[bad][:8].tolist())
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
            _assert_close(got, ref, f"step {i}")
    for r, pages_taken in zip(runners, taken):
        r.pool.allocator.free(pages_taken)
