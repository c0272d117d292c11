"""On CUDA: the Triton decode attention over paged KV
(``engine.attention.paged_decode``) at the presets' head shapes (Llama-3.1-8B:
32 query / 8 KV heads; Qwen3-30B-A3B: 32 / 4), bf16 queries over bf16 and e4m3
pages, against float64 attention over the same (dequantized) pages and against
FlashInfer's decode on them; replayed from a CUDA graph after the requests
grew, against its eager call. Then a model with ``--decode-kernel triton``
against the same model on FlashInfer's decode kernel, over the forwards a
serving loop makes, and its decode graphs against its eager forward."""

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

from engine.attention import paged_decode as pd
from engine.forward_batch import build_forward_batch
from engine.runner import ModelRunner

pytestmark = pytest.mark.gpu

PAGE, LAYERS, LAYER, HEAD_DIM = 16, 4, 2, 128
DEVICE = "cuda:0"


def _setup(
    batch: int, kv_heads: int, kv_dtype: torch.dtype, max_len: int, seed: int
) -> tuple[torch.Tensor, list[int], list[torch.Tensor]]:
    """A page-major pool ``[pages, layers, 2, PAGE, kv_heads, HEAD_DIM]`` of
    random values, each request's length and its distinct random pages."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (batch,), generator=g).tolist()
    counts = [-(-n // PAGE) for n in lengths]
    num_pages = sum(counts) + 8
    on_device = torch.Generator(device=DEVICE).manual_seed(seed)
    shape = (num_pages, LAYERS, 2, PAGE, kv_heads, HEAD_DIM)
    kv = (torch.randn(shape, device=DEVICE, generator=on_device) * 2).to(kv_dtype)
    order = torch.randperm(num_pages - 1, generator=g) + 1
    tables, used = [], 0
    for c in counts:
        tables.append(order[used : used + c])
        used += c
    return kv, lengths, tables


def _index(lengths: list[int], tables: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    indptr = torch.tensor([0] + [len(t) for t in tables]).cumsum(0)
    last = [n - (len(t) - 1) * PAGE for n, t in zip(lengths, tables, strict=True)]
    return (
        indptr.to(torch.int32).to(DEVICE),
        torch.cat(tables).to(torch.int32).to(DEVICE),
        torch.tensor(last, dtype=torch.int32, device=DEVICE),
    )


def _reference(
    q: torch.Tensor,
    kv: torch.Tensor,
    lengths: list[int],
    tables: list[torch.Tensor],
    sm_scale: float,
    scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    heads, kv_heads = q.shape[1], kv.shape[4]
    out = []
    for b, (n, table) in enumerate(zip(lengths, tables, strict=True)):
        pages = kv[table.to(DEVICE), LAYER].double()  # [pages, 2, PAGE, kv_heads, D]
        k = pages[:, 0].reshape(-1, kv_heads, HEAD_DIM)[:n] * scales[0]
        v = pages[:, 1].reshape(-1, kv_heads, HEAD_DIM)[:n] * scales[1]
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].double(), k) * sm_scale
        out.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v))
    return torch.stack(out)


def _queries(batch: int, heads: int, kv_heads: int, seed: int) -> torch.Tensor:
    """q as the engine passes it: a view into the QKV projection's output."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    qkv = torch.randn(batch, heads + 2 * kv_heads, HEAD_DIM, device=DEVICE, generator=g)
    return qkv.to(torch.bfloat16)[:, :heads]


def _close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    # bf16 output (2^-9), probabilities rounded to bf16 or fp16 for P V.
    err = (got.double() - ref.double()).abs()
    worst = err.max().item() / ref.abs().max().item()
    rel = (err.norm() / ref.norm()).item()
    assert worst < 1e-2 and rel < 5e-3, f"{what}: max {worst:.2e}, norm {rel:.2e}"


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize(("heads", "kv_heads"), [(32, 8), (32, 4)])
@pytest.mark.parametrize("batch", [1, 3, 64])
def test_matches_float64_and_flashinfer(
    batch: int, heads: int, kv_heads: int, kv_dtype: torch.dtype
) -> None:
    kv, lengths, tables = _setup(batch, kv_heads, kv_dtype, 2000, seed=batch + kv_heads)
    index = _index(lengths, tables)
    q = _queries(batch, heads, kv_heads, seed=batch)
    sm_scale = HEAD_DIM**-0.5
    e4m3 = kv_dtype == torch.float8_e4m3fn
    decode_plan = pd.plan(batch, kv_heads, e4m3=e4m3)  # the engine's tiles
    out = torch.empty(q.shape, dtype=q.dtype, device=DEVICE)
    k_cache, v_cache = kv[:, LAYER, 0], kv[:, LAYER, 1]
    pd.paged_decode(q, k_cache, v_cache, *index, out, sm_scale, decode_plan)
    ref = _reference(q, kv, lengths, tables, sm_scale)
    _close(out, ref, "against float64")
    # Every split count gives the same result (a split past a short request's
    # pages weighs nothing), up to the order of the sums.
    for splits in (1, 8, 32):
        other = torch.empty_like(out)
        pd.paged_decode(q, k_cache, v_cache, *index, other, sm_scale, pd.DecodePlan(splits))
        _close(other, ref, f"{splits} splits")
    if e4m3:
        # V widened to fp16 in registers before the tensor cores, and not:
        # the plan's tiles either way (8 warps at 8-page tiles when widened).
        assert pd.widens(q.device)
        for widen in (True, False):
            other = torch.empty_like(out)
            wplan = pd.plan(batch, kv_heads, e4m3=True, widen_v=widen)
            pd.paged_decode(q, k_cache, v_cache, *index, other, sm_scale, wplan)
            _close(other, ref, f"{wplan}")

    import flashinfer

    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=DEVICE)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
    wrapper.plan(
        *index, heads, kv_heads, HEAD_DIM, PAGE, q_data_type=q.dtype, kv_data_type=kv_dtype
    )
    fi = wrapper.run(q.contiguous(), (k_cache, v_cache))
    _close(out, fi.double(), "against FlashInfer")


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_chunked_outputs_do_not_depend_on_the_batch(kv_dtype: torch.dtype) -> None:
    """Batch-invariant chunks (16 pages and up): 64 requests of up to 3000
    tokens decoded together (one split: the batch fills the GPU) and 8 of
    them alone (32 splits): each alone bitwise equal to its row in the
    batch, and both close to float64."""
    batch, heads, kv_heads = 64, 32, 8
    kv, lengths, tables = _setup(batch, kv_heads, kv_dtype, 3000, seed=11)
    q = _queries(batch, heads, kv_heads, seed=5)
    k_cache, v_cache = kv[:, LAYER, 0], kv[:, LAYER, 1]
    sm_scale = HEAD_DIM**-0.5
    together = torch.empty(q.shape, dtype=q.dtype, device=DEVICE)
    together_plan = pd.plan(batch, kv_heads, chunk_pages=16)
    assert together_plan.splits == 1
    index = _index(lengths, tables)
    pd.paged_decode(q, k_cache, v_cache, *index, together, sm_scale, together_plan)
    _close(together, _reference(q, kv, lengths, tables, sm_scale), "batch of 64")
    alone_plan = pd.plan(1, kv_heads, chunk_pages=16)
    assert alone_plan.splits == 32
    for r in range(8):
        alone = torch.empty((1, heads, HEAD_DIM), dtype=q.dtype, device=DEVICE)
        one = _index([lengths[r]], [tables[r]])
        pd.paged_decode(q[r : r + 1], k_cache, v_cache, *one, alone, sm_scale, alone_plan)
        assert torch.equal(alone[0], together[r]), f"request {r} ({lengths[r]} tokens)"


def test_scales_and_a_graph_replayed_after_the_requests_grew() -> None:
    """Captured for 4 requests, replayed when each has grown by a page or
    more: the split's pages are found on the device, so the replay equals an
    eager call on the new table. The checkpoint's K/V scales apply."""
    batch, heads, kv_heads = 4, 32, 8
    kv, lengths, tables = _setup(batch, kv_heads, torch.float8_e4m3fn, 3000, seed=7)
    short = [max(1, n - 40) for n in lengths]
    short_tables = [t[: -(-n // PAGE)] for n, t in zip(short, tables, strict=True)]
    q = _queries(batch, heads, kv_heads, seed=3)
    sm_scale, scales = HEAD_DIM**-0.5, (0.5, 2.0)
    decode_plan = pd.plan(batch, kv_heads)
    assert decode_plan.splits > 1
    scratch = pd.scratch_for(batch, heads, HEAD_DIM, decode_plan.partials, torch.device(DEVICE))
    k_cache, v_cache = kv[:, LAYER, 0], kv[:, LAYER, 1]
    # Fixed-size buffers the graph reads, as the engine's decode graphs hold them.
    capacity = sum(len(t) for t in tables)
    indptr = torch.zeros(batch + 1, dtype=torch.int32, device=DEVICE)
    indices = torch.zeros(capacity, dtype=torch.int32, device=DEVICE)
    last = torch.zeros(batch, dtype=torch.int32, device=DEVICE)

    def load(lens: list[int], tabs: list[torch.Tensor]) -> None:
        i, j, k = _index(lens, tabs)
        indptr.copy_(i)
        indices[: j.numel()].copy_(j)
        last.copy_(k)

    out = torch.empty(q.shape, dtype=q.dtype, device=DEVICE)

    def call() -> None:
        pd.paged_decode(q, k_cache, v_cache, indptr, indices, last, out, sm_scale,
                        decode_plan, scratch, k_scale=scales[0], v_scale=scales[1])  # fmt: skip

    load(short, short_tables)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    _close(out, _reference(q, kv, short, short_tables, sm_scale, scales), "short, eager")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        call()
    load(lengths, tables)
    graph.replay()
    torch.cuda.synchronize()
    replayed = out.clone()
    call()
    assert torch.equal(replayed, out)
    _close(out, _reference(q, kv, lengths, tables, sm_scale, scales), "grown, replayed")


def _runner(kernel: str, graph_bs: int, kv_cache_dtype: str, fused: bool = False) -> ModelRunner:
    return small_runner(
        graph_bs,
        "Qwen3ForCausalLM",
        kv_cache_dtype=kv_cache_dtype,
        decode_kernel=kernel,
        fuse_rope_kv_write=fused,
    )


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_a_model_on_the_triton_decode_kernel(kv_cache_dtype: str) -> None:
    """Prefill, chunks over a cached prefix, decode rows alone, first in a
    mixed batch and from a graph: the Triton kernel's logits against
    FlashInfer's (the same pages: identical writes, so only the attention
    differs), and the fused prologue with it."""
    runners = [
        _runner("flashinfer", 0, kv_cache_dtype),
        _runner("triton", 0, kv_cache_dtype),
        _runner("triton", 8, kv_cache_dtype),
        _runner("triton", 8, kv_cache_dtype, fused=True),
    ]
    free = [r.pool.allocator.num_free for r in runners]
    steps, taken = mixed_steps(runners)
    with torch.inference_mode():
        for i, specs in enumerate(steps):
            batch = build_forward_batch(specs, PAGE_SIZE, DEVICE)
            ref, *outs = (r.forward_logits(batch).float() for r in runners)
            scale = ref.abs().max().item()
            for j, got in enumerate(outs):
                worst = (got - ref).abs().max().item() / scale
                print(f"step {i}, runner {j + 1}: max {worst:.2e} of the largest logit")
                # bf16 pages: the same numbers up to the order of the sums; the
                # fused prologue on e4m3 pages rounds differently (see
                # tests/test_rope_kv_write_gpu.py).
                bound = 0.06 if j == 2 and kv_cache_dtype != "auto" else 0.02
                assert worst < bound, f"step {i}, runner {j + 1}: {worst:.2e}"
    for r, pages in zip(runners, taken, strict=True):
        r.pool.allocator.free(pages)
    assert [r.pool.allocator.num_free for r in runners] == free


@pytest.mark.parametrize("batch_size", [1, 3, 64])
def test_triton_decode_graph_equals_eager(batch_size: int) -> None:
    runner = _runner("triton", 64, "fp8_e4m3")
    free = runner.pool.allocator.num_free
    runner.pool.kv.copy_(torch.randn_like(runner.pool.kv, dtype=torch.float32).to(pd.E4M3))
    specs = decode_specs(runner, batch_size)
    assert_graph_equals_eager(runner, build_forward_batch(specs, PAGE_SIZE, DEVICE))
    for spec in specs:
        runner.pool.allocator.free(list(spec.page_table))
    assert runner.pool.allocator.num_free == free
