"""On CUDA: FP8 products (the few-row kernel and ``torch._scaled_mm``) against
float64 products of the quantized operands, an FP8 model's decode replayed
from CUDA graphs against its eager forward, FP8 KV pages through FlashInfer
against the torch attention on the same pages, and the quantization fused
into the norm and SiLU-and-mul kernels against the separate kernels."""

from __future__ import annotations

import pytest
import torch
from graph_decode import (
    PAGE_SIZE,
    assert_graph_equals_eager,
    decode_specs,
    eager_logits,
    small_runner,
)

from engine.attention.torch_native import TorchNativeAttention
from engine.forward_batch import ExtendSpec, ForwardBatch, build_forward_batch
from engine.layers import fp8, fp8_quant, fp8_skinny, linear, norm
from engine.layers.linear import any_linear
from engine.runner import ModelRunner

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 64, 1024])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
def test_products_match_float64_of_the_quantized_operands(rows: int, n: int, k: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, k, device="cuda", generator=g).to(torch.bfloat16)
    q, s = fp8.quantize_rows(torch.randn(n, k, device="cuda", generator=g) * 0.02)
    assert (fp8_skinny.fits(x, q) is not None) == (rows <= fp8_skinny.MAX_ROWS)
    got = any_linear(x, q, None, s)  # what a projection runs
    xq, sx = fp8.quantize_rows(x)
    ref = fp8.dequantize_rows(xq, sx).double() @ fp8.dequantize_rows(q, s).double().t()
    # bf16 output (2^-9 of each value); an operand rounded the other way at a tie.
    err = (got.double() - ref).abs()
    assert err.max().item() < 1e-2 * ref.abs().max().item()
    assert (err.norm() / ref.norm()).item() < 4e-3


def test_precise_sums_are_nearer_float64_over_a_long_k() -> None:
    """Over K 14336, the tensor cores' own accumulation drifts from float64
    more than sums promoted to float32 every k tile (``Tiles.precise``, which
    ``fp8_skinny.tiles`` takes at one row tile past ``PRECISE_K``, with K split
    in two) or than two sums split over K."""
    g = torch.Generator(device="cuda").manual_seed(16)
    n, k = 4096, 14336
    x = torch.randn(16, k, device="cuda", generator=g).to(torch.bfloat16)
    q, s = fp8.quantize_rows(torch.randn(n, k, device="cuda", generator=g) * 0.02)
    rows = fp8_quant.Quantized(*fp8.quantize_rows(x), x.dtype)
    ref = fp8.dequantize_rows(rows.q, rows.scale).double() @ fp8.dequantize_rows(q, s).double().t()

    def err(t: fp8_skinny.Tiles) -> float:
        got = fp8_skinny.run(rows, q, s, None, t).double()
        return ((got - ref).norm() / ref.norm()).item()

    unsplit = fp8_skinny.Tiles(64, 512, 1, 4, 4)
    own, precise = err(unsplit), err(unsplit._replace(precise=True))
    split = err(unsplit._replace(split_k=2))
    both = err(unsplit._replace(split_k=2, precise=True))
    print(
        f"K {k} from float64: unsplit {own:.2e}, precise {precise:.2e}, split {split:.2e}, "
        f"split with precise sums {both:.2e}"
    )
    assert fp8_skinny.tiles(n, k) == unsplit._replace(split_k=2, precise=True)
    assert precise < own and precise < split < 4e-3
    assert both < split and both < 1.1 * precise


def _runner(graph_bs: int, kv_heads: int = 1, **kw: str) -> ModelRunner:
    return small_runner(graph_bs, kv_heads=kv_heads, num_pages=600, max_running_requests=256, **kw)


@pytest.mark.parametrize("batch_size", [1, 3, 64])
def test_fp8_weights_decode_graph_equals_eager(batch_size: int) -> None:
    runner = _runner(64, quantization="fp8")
    assert runner.graphs is not None and runner.model_config.fp8
    runner.pool.kv.normal_()
    batch = build_forward_batch(decode_specs(runner, batch_size), PAGE_SIZE, "cuda:0")
    assert_graph_equals_eager(runner, batch)


@pytest.mark.parametrize("batch_size", [1, 3, 64])
def test_a_quantized_lm_head_on_the_gpu(batch_size: int) -> None:
    """``--quantize-lm-head``: the head's product against float64 of its
    operands (the final norm's rows quantized per token), and a decode graph
    that replays the eager forward."""
    runner = _runner(64, quantization="fp8", quantize_lm_head=True)
    head = runner.model.lm_head
    assert runner.model_config.fp8_lm_head and head.weight.dtype == fp8.E4M3
    g = torch.Generator(device="cuda").manual_seed(batch_size)
    h = torch.randn(batch_size, head.weight.shape[1], device="cuda", generator=g)
    h = h.to(torch.bfloat16)
    with torch.inference_mode():
        got = runner.model.compute_logits(h).double()
    xq, sx = fp8.quantize_rows(h)
    ref = fp8.dequantize_rows(xq, sx).double() @ (
        fp8.dequantize_rows(head.weight, head.weight_scale).double().t()
    )
    # bf16 logits (the product's output dtype), then float32.
    assert ((got - ref).norm() / ref.norm()).item() < 4e-3
    runner.pool.kv.normal_()
    batch = build_forward_batch(decode_specs(runner, batch_size), PAGE_SIZE, "cuda:0")
    assert_graph_equals_eager(runner, batch)
    # A head of Llama-3's vocabulary (128256 rows: the few-row kernel's tiles
    # up to 64 rows, torch._scaled_mm past them), its first and last rows.
    q, s = fp8.quantize_rows(torch.randn(128256, 4096, device="cuda", generator=g) * 0.02)
    x = torch.randn(batch_size, 4096, device="cuda", generator=g).to(torch.bfloat16)
    got = any_linear(x, q, None, s).double()
    xd = fp8.dequantize_rows(*fp8.quantize_rows(x)).double()
    for part in (slice(0, 4096), slice(-4096, None)):
        ref = xd @ fp8.dequantize_rows(q[part], s[part]).double().t()
        assert ((got[:, part] - ref).norm() / ref.norm()).item() < 4e-3


def _torch_attention(runner: ModelRunner) -> TorchNativeAttention:
    """The torch attention over the runner's pool (the reference)."""
    return TorchNativeAttention(
        runner.pool, runner.num_heads, runner.num_kv_heads, 128, q_dtype=torch.bfloat16
    )


def _prompt_prefill(runner: ModelRunner) -> tuple[ForwardBatch, list[int]]:
    """A 40-token prompt's prefill (logits at every position) and its 3 pages."""
    gen = torch.Generator().manual_seed(0)
    ids = [int(i) for i in torch.randint(3, 1000, (40,), generator=gen)]
    pages = runner.pool.allocator.alloc(3)
    assert pages is not None
    return build_forward_batch([ExtendSpec(ids, 0, pages, "all")], 16, "cuda:0"), pages


@pytest.mark.parametrize("kv_heads", [1, 2])  # tensor-core decode, CUDA-core decode
def test_fp8_kv_with_flashinfer_against_the_torch_attention(kv_heads: int) -> None:
    """FP8 pages through FlashInfer's kernels (prefill, decode, a decode
    graph) against the torch attention reading the same pages."""
    runner = _runner(64, kv_heads, kv_cache_dtype="fp8_e4m3")
    assert runner.pool.kv.dtype == torch.float8_e4m3fn
    assert runner.config.attention_backend == "flashinfer" and runner.graphs is not None
    torch_attn = _torch_attention(runner)
    prefill, _ = _prompt_prefill(runner)
    with torch.inference_mode():
        fi = runner.forward_logits(prefill).float()
        ref = eager_logits(runner, torch_attn, prefill).float()
        assert ((fi - ref).norm() / ref.norm()).item() < 2e-2
        runner.pool.kv.copy_(
            (torch.randn_like(runner.pool.kv, dtype=torch.float32) * 2).to(torch.float8_e4m3fn)
        )
    batch = build_forward_batch(decode_specs(runner, 3), PAGE_SIZE, "cuda:0")
    eager = assert_graph_equals_eager(runner, batch).float()
    with torch.inference_mode():
        ref = eager_logits(runner, torch_attn, batch).float()
    assert ((eager - ref).norm() / ref.norm()).item() < 2e-2


def test_scaled_fp8_kv_with_flashinfer_against_the_torch_attention() -> None:
    """A checkpoint's K/V scales (here set on the layers) move onto the query
    and the output around FlashInfer's kernels as around the torch attention."""
    runner = _runner(0, 1, kv_cache_dtype="fp8_e4m3")
    for layer in runner.model.model.layers:
        layer.self_attn.kv_scales = (0.25, 0.5)
    torch_attn = _torch_attention(runner)
    prefill, pages = _prompt_prefill(runner)
    step = build_forward_batch([ExtendSpec([5], 40, pages)], 16, "cuda:0")
    with torch.inference_mode():
        for batch in (prefill, step):
            fi = runner.forward_logits(batch).float()
            ref = eager_logits(runner, torch_attn, batch).float()
            assert ((fi - ref).norm() / ref.norm()).item() < 2e-2


def _greedy(
    runner: ModelRunner, prompts: list[list[int]], steps: int
) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """Greedy tokens of ``prompts`` and the logits each was chosen from: each
    prompt prefilled alone, then ``steps - 1`` decode steps of all of them in
    one batch."""
    tables, out, logits_of = [], [], [[] for _ in prompts]
    with torch.inference_mode():
        for i, ids in enumerate(prompts):
            pages = runner.pool.allocator.alloc(-(-(len(ids) + steps) // PAGE_SIZE))
            assert pages is not None
            tables.append(pages)
            batch = build_forward_batch([ExtendSpec(ids, 0, pages)], PAGE_SIZE, "cuda:0")
            row = runner.forward_logits(batch)[0].float()
            logits_of[i].append(row.cpu())
            out.append([int(row.argmax())])
        for step in range(steps - 1):
            specs = [
                ExtendSpec([toks[-1]], len(ids) + step, pages)
                for ids, toks, pages in zip(prompts, out, tables, strict=True)
            ]
            logits = runner.forward_logits(build_forward_batch(specs, PAGE_SIZE, "cuda:0"))
            for i, row in enumerate(logits.float()):
                logits_of[i].append(row.cpu())
                out[i].append(int(row.argmax()))
    for pages in tables:
        runner.pool.allocator.free(pages)
    return out, logits_of


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_greedy_tokens_do_not_depend_on_the_batch(quantization: str | None) -> None:
    """A prompt decoded alone (the few-row kernels) and among 31 others
    (cuBLAS, or quantize + ``torch._scaled_mm``): the same logits up to the
    order of the sums, and so the same greedy tokens, bf16 weights and FP8
    ones alike.

    With FP8 weights a sum's last bit can move an activation across an e4m3
    rounding boundary (2^-3 apart, against bf16's 2^-8), so on this random
    model's flat logits two tokens within that noise of each other can swap.
    Where the runs part, the test asks that they part at such a near tie:
    the two tokens' gap in one run no wider than twice the largest logit
    difference between the runs at that step. The logits themselves stay
    within 2% (bf16) or 5% (FP8) of each other.
    """
    runner = _runner(64, quantization=quantization)
    free = runner.pool.allocator.num_free
    gen = torch.Generator().manual_seed(0)
    prompts = [
        [int(t) for t in torch.randint(3, 1000, (20 + i,), generator=gen)] for i in range(32)
    ]
    alone = [_greedy(runner, [p], 12) for p in prompts[:3]]
    together, together_logits = _greedy(runner, prompts, 12)
    for p, ((toks,), (logits,)) in enumerate(alone):
        for step, (a, b) in enumerate(zip(toks, together[p], strict=True)):
            ref, got = logits[step], together_logits[p][step]
            diff = (got - ref).abs().max().item()
            where = f"prompt {p}, step {step}"
            rel = ((got - ref).norm() / ref.norm()).item()
            assert rel < (5e-2 if quantization else 2e-2), f"{where}: logits {rel:.2e} apart"
            if a == b:
                continue
            assert quantization == "fp8", f"{where}: {a} alone, {b} in the batch"
            gap = (ref[a] - ref[b]).item()
            assert gap <= 2 * diff, f"{where}: {a} vs {b}, gap {gap:.4f}, runs differ {diff:.4f}"
            print(f"{where}: a near tie parted the runs (gap {gap:.4f}, runs differ {diff:.4f})")
            break  # past here the runs decode different tokens
    assert runner.pool.allocator.num_free == free


def test_fp8_kv_stays_near_bf16_kv_on_the_gpu() -> None:
    runner, ref_runner = _runner(0, kv_cache_dtype="fp8_e4m3"), _runner(0)
    gen = torch.Generator().manual_seed(0)
    ids = [int(i) for i in torch.randint(3, 1000, (40,), generator=gen)]
    out = []
    for r in (runner, ref_runner):
        pages = r.pool.allocator.alloc(3)
        assert pages is not None
        batch = build_forward_batch([ExtendSpec(ids, 0, pages, "all")], 16, "cuda:0")
        with torch.inference_mode():
            out.append(r.forward_logits(batch).float())
    rel = ((out[0] - out[1]).norm() / out[1].norm()).item()
    assert 0 < rel < 0.1, rel


def _same_but_a_step(got: fp8_quant.Quantized, want_q: torch.Tensor, want_s: torch.Tensor) -> None:
    """e4m3 values equal but for a few one step apart (the activation rounded
    from sums in another order), scales within a bf16 step of the amax."""
    assert ((got.scale - want_s).abs() <= want_s * 2.0**-8).all()
    a, b = got.q.float(), want_q.float()
    step = 2.0 ** (torch.floor(torch.log2(torch.maximum(a.abs(), b.abs()).clamp_min(2**-6))) - 3)
    assert ((a - b).abs() <= step).all()
    assert (a == b).float().mean().item() > 0.99


def test_norm_and_silu_quantization_match_the_separate_kernels() -> None:
    """One kernel for the residual add, RMSNorm and the per-token quantization
    against FlashInfer's fused add + RMSNorm then the quantization kernel
    (the residual sum bit for bit); likewise SiLU-and-mul, at Llama-3.1-8B's
    widths."""
    from engine.layers.kernels import FlashInferKernels

    kernels = FlashInferKernels()
    g = torch.Generator(device="cuda").manual_seed(0)
    x, r = (torch.randn(64, 4096, device="cuda", generator=g).to(torch.bfloat16) for _ in "xr")
    w = (torch.rand(4096, device="cuda", generator=g) + 0.5).to(torch.bfloat16)
    y, h = kernels.add_rms_norm(x.clone(), r.clone(), w, 1e-5)
    got, got_h = fp8_quant.norm_quantize(x.clone(), r.clone(), w, 1e-5)
    assert torch.equal(got_h, h)
    _same_but_a_step(got, *fp8_quant.quantize_rows(y))
    gate_up = torch.randn(64, 2 * 14336, device="cuda", generator=g).to(torch.bfloat16)
    want = fp8_quant.quantize_rows(kernels.silu_and_mul(gate_up))
    _same_but_a_step(fp8_quant.silu_mul_quantize(gate_up), *want)


def test_an_fp8_prefill_quantizes_in_the_norm_and_silu_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 40-token prefill (past the few-row kernel): only the attention
    output goes through the quantization kernel, one per layer instead of
    four; the logits stay near those of the separate kernels."""
    runner = _runner(0, quantization="fp8")
    prefill, pages = _prompt_prefill(runner)
    calls = []
    real = fp8_quant.quantize_rows
    monkeypatch.setattr(fp8_quant, "quantize_rows", lambda x: calls.append(1) or real(x))
    layers = runner.model_config.num_layers
    with torch.inference_mode():
        fused = runner.forward_logits(prefill).float()
        assert len(calls) == layers
        calls.clear()
        monkeypatch.setattr(linear, "quantized_upstream", lambda layer, rows: False)
        monkeypatch.setattr(norm, "quantized_upstream", lambda layer, rows: False)
        separate = runner.forward_logits(prefill).float()
        assert len(calls) == 4 * layers
    rel = ((fused - separate).norm() / separate.norm()).item()
    print(f"fused against separate quantization: logits {rel:.2e} apart")
    assert rel < 2e-2
    runner.pool.allocator.free(pages)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_gated_mlp_gives_the_three_kernels_logits(
    batch_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode batch of up to ``fp8_skinny.DEFERRED_ROWS`` rows runs each MLP
    as two kernels (``linear.gated_mlp``: no SiLU-and-mul kernel), with the
    logits of the three separate kernels (the same numbers but for the order
    of the products' sums over their k tiles), eager and replayed
    (``linear.GATED_MLP``)."""
    monkeypatch.setattr(linear, "GATED_MLP", True)  # before the graphs are captured
    runner = _runner(8, quantization="fp8")
    runner.pool.kv.normal_()
    batch = build_forward_batch(decode_specs(runner, batch_size), PAGE_SIZE, "cuda:0")
    calls = []
    real = fp8_quant.silu_mul_quantize
    monkeypatch.setattr(fp8_quant, "silu_mul_quantize", lambda x: calls.append(1) or real(x))
    with torch.inference_mode():
        gated = assert_graph_equals_eager(runner, batch)
        assert not calls
        monkeypatch.setattr(linear, "GATED_MLP", False)
        separate = eager_logits(runner, runner.attn, batch).float()
        assert len(calls) == runner.model_config.num_layers
    rel = ((gated.float() - separate).norm() / separate.norm()).item()
    print(f"gated MLP against three kernels: logits {rel:.2e} apart")
    assert rel < 1e-3
    assert torch.equal(gated.argmax(-1), separate.argmax(-1))
