"""Decode attention over paged KV in Triton (``engine.attention.paged_decode``)
under Triton's interpreter (no GPU needed), against attention in float64 over
the same pages (e4m3 pages dequantized): every request's pages scattered over
a pool whose pages hold several layers, lengths from one token to past a
split, groups of 1, 4 and 6 query heads per KV head, one split and many
(more than a short request has pages), even and batch-invariant chunks, K/V
scales, queries and outputs as strided views. fp16 queries: the interpreter truncates float32 to bf16 where
the GPU rounds (bf16 runs in tests/test_paged_decode_gpu.py).

The interpreter must be chosen before triton is first imported, so these run
in a child process started with ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from triton_interp import interpreted, parent_only, run_interpreted

from engine.attention.paged_decode import WIDE_GROUP_REGISTERS, DecodePlan, group_rows, plan
from engine.kvcache.pool import KV_FP8, KVPool, KVPoolConfig

PAGE_SIZE, LAYERS, LAYER = 4, 3, 1
LENGTHS = [1, 4, 5, 23, 64]
"""Tokens per request: one, a full page, a page and one, many tiles."""


@parent_only
def test_kernel_under_the_interpreter() -> None:
    run_interpreted(__file__, timeout_s=900)


def _pages(lengths: list[int], num_pages: int, seed: int) -> list[list[int]]:
    """Distinct random pages per request (page 0 is the pool's scratch page)."""
    order = torch.randperm(num_pages - 1, generator=torch.Generator().manual_seed(seed)) + 1
    tables, used = [], 0
    for n in lengths:
        count = -(-n // PAGE_SIZE)
        tables.append(order[used : used + count].tolist())
        used += count
    return tables


def _index(lengths: list[int], tables: list[list[int]]) -> tuple[torch.Tensor, ...]:
    """FlashInfer's page table: indptr, indices, last_page_len (int32)."""
    indptr, indices, last = [0], [], []
    for n, table in zip(lengths, tables, strict=True):
        indices += table
        indptr.append(len(indices))
        last.append(n - (len(table) - 1) * PAGE_SIZE)

    def i32(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int32)

    return i32(indptr), i32(indices), i32(last)


def _reference(
    q: torch.Tensor,
    pool: KVPool,
    lengths: list[int],
    tables: list[list[int]],
    sm_scale: float,
    scales: tuple[float, float],
) -> torch.Tensor:
    """float64 attention of each request's query row over its tokens."""
    heads = q.shape[1]
    kv_heads = pool.config.num_kv_heads
    k_all, v_all = pool.k_layer(LAYER).double(), pool.v_layer(LAYER).double()
    out = []
    for b, (n, table) in enumerate(zip(lengths, tables, strict=True)):
        page = torch.tensor(table)
        k = k_all[page].reshape(-1, kv_heads, k_all.shape[-1])[:n] * scales[0]
        v = v_all[page].reshape(-1, kv_heads, v_all.shape[-1])[:n] * scales[1]
        k = k.repeat_interleave(heads // kv_heads, dim=1)  # [n, heads, D]
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].double(), k) * sm_scale
        out.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v))
    return torch.stack(out)


@interpreted
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 2, 32), (2, 2, 16), (12, 2, 32)])
@pytest.mark.parametrize("kv_dtype", [torch.float16, KV_FP8])
@pytest.mark.parametrize(
    ("splits", "block_pages", "chunk_pages", "early_v", "heads_first"),
    [(1, 2, 0, False, False), (4, 1, 0, True, True), (32, 2, 0, False, False),
     (1, 2, 2, True, True), (4, 1, 3, False, False), (32, 2, 1, True, True)],
)  # fmt: skip
def test_matches_float64_attention_over_the_same_pages(
    heads: int,
    kv_heads: int,
    head_dim: int,
    kv_dtype: torch.dtype,
    splits: int,
    block_pages: int,
    chunk_pages: int,
    early_v: bool,
    heads_first: bool,
) -> None:
    from engine.attention.paged_decode import paged_decode

    g = torch.Generator().manual_seed(heads + head_dim + splits)
    num_pages = sum(-(-n // PAGE_SIZE) for n in LENGTHS) + 5
    pool = KVPool(KVPoolConfig(num_pages, PAGE_SIZE, LAYERS, kv_heads, head_dim, dtype=kv_dtype))
    pool.kv.copy_((torch.randn(pool.kv.shape, generator=g) * 2).to(kv_dtype))
    tables = _pages(LENGTHS, num_pages, seed=splits)
    indptr, indices, last = _index(LENGTHS, tables)
    batch = len(LENGTHS)
    # q a view into a fused QKV projection's output; out strided likewise.
    qkv = torch.randn(batch, heads + 2 * kv_heads, head_dim, generator=g).to(torch.float16)
    q = qkv[:, :heads]
    out_buf = torch.full((batch, heads + 3, head_dim), 7.0, dtype=torch.float16)
    out = out_buf[:, 1 : heads + 1]
    scales = (0.5, 2.0) if kv_dtype == KV_FP8 else (1.0, 1.0)
    sm_scale = 1 / math.sqrt(head_dim)
    decode_plan = DecodePlan(
        splits, block_pages, chunk_pages=chunk_pages, early_v=early_v, heads_first=heads_first
    )
    paged_decode(q, pool.k_layer(LAYER), pool.v_layer(LAYER), indptr, indices, last, out,
                 sm_scale, decode_plan, k_scale=scales[0], v_scale=scales[1])  # fmt: skip
    ref = _reference(q, pool, LENGTHS, tables, sm_scale, scales)
    # Probabilities rounded to fp16 (2^-11) for the second product, sums in float32.
    err = (out.double() - ref).abs()
    assert err.max().item() < 4e-3 * ref.abs().max().item(), err.max().item()
    assert (err.norm() / ref.norm()).item() < 1.5e-3
    # The rows around the output's view are untouched.
    assert (out_buf[:, 0] == 7).all() and (out_buf[:, heads + 1 :] == 7).all()


@interpreted
@pytest.mark.parametrize("kv_dtype", [torch.float16, KV_FP8])
def test_pages_with_heads_outermost_read_through_their_strides(kv_dtype: torch.dtype) -> None:
    """The same K/V stored heads outermost within a page (each head's tokens
    in one run, as ``bench_attention``'s ``HND`` times it) and passed as a
    ``[page, tokens, heads, dim]`` view: the same output, to the bit; and
    so with the programs of a request's heads placed together."""
    from engine.attention.paged_decode import paged_decode

    heads, kv_heads, d = 8, 2, 32
    g = torch.Generator().manual_seed(3)
    num_pages = sum(-(-n // PAGE_SIZE) for n in LENGTHS) + 2
    pool = KVPool(KVPoolConfig(num_pages, PAGE_SIZE, LAYERS, kv_heads, d, dtype=kv_dtype))
    pool.kv.copy_((torch.randn(pool.kv.shape, generator=g) * 2).to(kv_dtype))
    k, v = pool.k_layer(LAYER), pool.v_layer(LAYER)
    # [page, heads, tokens, dim] storage holding the same values.
    k_hnd, v_hnd = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (k, v))
    assert k_hnd.stride(1) == d and k_hnd.stride(2) == PAGE_SIZE * d
    tables = _pages(LENGTHS, num_pages, seed=1)
    indptr, indices, last = _index(LENGTHS, tables)
    q = torch.randn(len(LENGTHS), heads, d, generator=g).to(torch.float16)
    outs = []
    for cache, heads_first in (((k, v), False), ((k_hnd, v_hnd), False), ((k, v), True)):
        out = torch.empty_like(q)
        decode_plan = DecodePlan(4, 2, heads_first=heads_first)
        paged_decode(q, *cache, indptr, indices, last, out, d**-0.5, decode_plan)
        outs.append(out)
    # The grid's order (DecodePlan.heads_first) moves no bit either.
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    ref = _reference(q, pool, LENGTHS, tables, d**-0.5, (1.0, 1.0))
    assert ((outs[1].double() - ref).norm() / ref.norm()).item() < 1.5e-3


@interpreted
def test_a_longer_context_replays_with_the_same_plan() -> None:
    """A split's pages are found on the device: the plan chosen for a batch
    size serves contexts of any length (as a CUDA graph replays it), and
    one token of difference in the length shows in the output."""
    from engine.attention.paged_decode import paged_decode

    g = torch.Generator().manual_seed(0)
    pool = KVPool(KVPoolConfig(40, PAGE_SIZE, LAYERS, 1, 16, dtype=torch.float16))
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=g).to(torch.float16))
    q = torch.randn(1, 4, 16, generator=g).to(torch.float16)
    decode_plan = plan(1, 1)
    assert decode_plan.splits == 32
    outs = []
    for n in (3, 100, 101):
        tables = [list(range(1, 1 + -(-n // PAGE_SIZE)))]
        out = torch.empty_like(q)
        paged_decode(q, pool.k_layer(LAYER), pool.v_layer(LAYER), *_index([n], tables), out,
                     0.25, decode_plan)  # fmt: skip
        ref = _reference(q, pool, [n], tables, 0.25, (1.0, 1.0))
        assert (out.double() - ref).abs().max().item() < 4e-3 * ref.abs().max().item()
        outs.append(out)
    assert not torch.equal(outs[1], outs[2])


@interpreted
def test_chunked_sums_do_not_depend_on_the_batch() -> None:
    """Six requests (1 to 150 tokens) decoded in one batch at 1 and 4
    splits, and each alone at 32 (the plans of a large, a middle and a
    single-request batch): with chunks fixed by each request's length the
    outputs are bitwise equal; with even chunks of the plan's splits they
    are not (float32 outputs, so a last-bit difference shows)."""
    from engine.attention.paged_decode import paged_decode

    lengths = [1, 4, 5, 23, 64, 150]
    g = torch.Generator().manual_seed(5)
    num_pages = sum(-(-n // PAGE_SIZE) for n in lengths) + 3
    pool = KVPool(KVPoolConfig(num_pages, PAGE_SIZE, LAYERS, 2, 32, dtype=torch.float16))
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=g).to(torch.float16))
    tables = _pages(lengths, num_pages, seed=2)
    q = torch.randn(len(lengths), 8, 32, generator=g).to(torch.float16)
    k, v = pool.k_layer(LAYER), pool.v_layer(LAYER)
    ref = _reference(q, pool, lengths, tables, 0.2, (1.0, 1.0))

    def decode(rows: list[int], splits: int, chunk_pages: int) -> torch.Tensor:
        out = torch.empty(len(rows), 8, 32)
        index = _index([lengths[r] for r in rows], [tables[r] for r in rows])
        plan = DecodePlan(splits, 2, chunk_pages=chunk_pages)
        paged_decode(q[rows], k, v, *index, out, 0.2, plan)
        return out

    for chunk_pages in (0, 4):
        batched = [decode(list(range(len(lengths))), splits, chunk_pages) for splits in (1, 4)]
        alone = torch.cat([decode([r], 32, chunk_pages) for r in range(len(lengths))])
        for out in (*batched, alone):
            assert (out.double() - ref).abs().max().item() < 4e-3 * ref.abs().max().item()
        same = [
            torch.equal(alone[r], batched[0][r]) and torch.equal(alone[r], batched[1][r])
            for r in range(len(lengths))
        ]
        if chunk_pages:
            assert all(same), same
        else:  # one page, or one split at every plan: the same sums
            assert same[:2] == [True, True] and not all(same[2:]), same


def test_plans_fill_the_gpu_and_groups_pad_to_the_matrix_units() -> None:
    assert [plan(b, 8).splits for b in (1, 2, 4, 8, 16, 32, 33, 256)] == [32, 32, 16, 8, 4, 2, 1, 1]
    assert plan(1, 1).splits == 32  # at most MAX_SPLITS
    assert [plan(b, 8, sms=16).splits for b in (1, 2, 4, 8)] == [4, 2, 1, 1]  # a smaller GPU
    assert (plan(4, 8, block_pages=8).warps, plan(4, 8).warps) == (8, 4)
    # Tiles: 8 pages on 8 warps where the batch fills the GPU; over e4m3
    # pages V with K, widened by default (WIDEN_V) on 4-page tiles at every
    # batch, and 8-page tiles on 4 warps where it is read byte-wise;
    # batch-invariant chunks keep 4-page tiles at any batch.
    assert [plan(b, 8).block_pages for b in (1, 32, 33, 256)] == [4, 4, 8, 8]
    assert plan(256, 8) == DecodePlan(1, 8, 8, 2)
    assert plan(256, 8, e4m3=True) == DecodePlan(1, 4, 4, 2, early_v=True, widen_v=True)
    assert plan(33, 8, e4m3=True) == plan(256, 8, e4m3=True)
    assert plan(256, 8, e4m3=True, widen_v=False) == DecodePlan(1, 8, 4, 2, early_v=True)
    assert plan(1, 8, e4m3=True) == DecodePlan(32, 4, 4, 2, early_v=True, widen_v=True)
    assert plan(256, 8, widen_v=True) == plan(256, 8)  # bf16 pages: nothing to widen
    # Groups of more than 4 on the widened tiles are capped at 128 registers
    # a thread (four programs an SM); groups of 4, bf16 pages, byte-wise V
    # and 8-page tiles are not.
    wide = WIDE_GROUP_REGISTERS
    assert [plan(b, 4, e4m3=True, group=8).registers for b in (1, 64, 256)] == [wide] * 3
    assert plan(64, 4, e4m3=True, group=8)._replace(registers=0) == plan(64, 4, e4m3=True)
    assert plan(64, 8, e4m3=True, group=4).registers == 0
    assert plan(64, 4, group=8).registers == 0
    assert plan(64, 4, e4m3=True, widen_v=False, group=8).registers == 0
    assert plan(64, 4, e4m3=True, block_pages=8, group=8).registers == 0
    assert [group_rows(h, 8) for h in (8, 32, 64, 256)] == [16, 16, 16, 32]
    assert group_rows(48, 8) == 16  # a group of 6
    # Scratch rows per request and head: none for one split (batch-invariant
    # chunks too: one program merges them), one per split, or the most
    # chunks a request can have.
    assert [DecodePlan(1).partials, DecodePlan(4).partials] == [0, 4]
    assert plan(256, 8, chunk_pages=16) == DecodePlan(1, 4, 4, 2, 16)
    assert plan(256, 8, chunk_pages=16).partials == 0
    assert plan(4, 8, chunk_pages=16).partials == 32


def test_graphs_share_one_split_scratch() -> None:
    """Captured largest first, every size's plan takes a prefix of one
    buffer (none without partials); a size that needs more later gets a new
    buffer and the old one stays, since graphs captured on it read it."""
    from engine.attention.paged_decode import SharedScratch

    shared = SharedScratch(64, "cpu")
    assert shared.take(256, 32, plan(256, 8)) is None  # one split: no partials
    first = shared.take(8, 32, plan(8, 8))  # 8 splits: 8 x 32 x 8 rows
    assert first is not None and first.o.shape == (2048, 64) and first.lse.shape == (2048,)
    again = shared.take(1, 32, plan(1, 8))  # 32 splits: 1024 rows, the same buffer
    assert again is not None and again.o.data_ptr() == first.o.data_ptr()
    assert len(shared.buffers) == 1
    chunked = shared.take(4, 32, plan(4, 8, chunk_pages=16))  # 32 partials: 4096 rows
    assert chunked is not None and chunked.o.shape == (4096, 64)
    assert len(shared.buffers) == 2 and shared.buffers[0].o.data_ptr() == first.o.data_ptr()


def test_refuses_what_it_cannot_take() -> None:
    from engine.attention.paged_decode import check

    pool = KVPool(KVPoolConfig(4, PAGE_SIZE, 1, 2, 32, dtype=torch.float16))
    q = torch.zeros(1, 4, 32, dtype=torch.float16)
    check(q, pool.k_layer(0), 2)  # accepted
    with pytest.raises(ValueError, match="bf16/fp16"):
        check(q.float(), pool.k_layer(0), 2)
    with pytest.raises(ValueError, match="do not group"):
        check(torch.zeros(1, 3, 32, dtype=torch.float16), pool.k_layer(0), 2)
    with pytest.raises(ValueError, match="pages must be"):
        check(q.bfloat16(), pool.k_layer(0), 2)
    odd = KVPool(KVPoolConfig(4, PAGE_SIZE, 1, 2, 48, dtype=torch.float16))
    with pytest.raises(ValueError, match="power of two"):
        check(torch.zeros(1, 4, 48, dtype=torch.float16), odd.k_layer(0), 2)
    three = KVPool(KVPoolConfig(4, 3, 1, 2, 32, dtype=torch.float16))
    with pytest.raises(ValueError, match="page_size"):
        check(q, three.k_layer(0), 2)
    from engine.attention.paged_decode import paged_decode

    ints = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="splits must be in"):
        paged_decode(q, pool.k_layer(0), pool.v_layer(0), ints, ints, ints[:1], q.clone(), 1.0,
                     DecodePlan(64))  # fmt: skip
    with pytest.raises(ValueError, match="chunk_pages must be >= 0"):
        paged_decode(q, pool.k_layer(0), pool.v_layer(0), ints, ints, ints[:1], q.clone(), 1.0,
                     DecodePlan(1, chunk_pages=-1))  # fmt: skip


def test_the_triton_decode_kernel_needs_flashinfer_attention_and_is_auto_there() -> None:
    from engine.config import EngineConfig
    from engine.model_config import ModelConfig

    raw = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "vocab_size": 128,
    }
    mc = ModelConfig.from_dict(raw, dtype=torch.float32)
    cfg = EngineConfig(load_format="dummy", device="cpu", decode_kernel="triton")
    with pytest.raises(ValueError, match="decode_kernel 'triton' needs attention_backend"):
        cfg.resolve(mc)
    assert EngineConfig(load_format="dummy", device="cpu").resolve(mc).decode_kernel == "flashinfer"
    with pytest.raises(ValueError, match="unknown decode_kernel"):
        EngineConfig(decode_kernel="cutlass")
    # Pages or heads the kernel cannot take are refused before anything loads.
    on_flashinfer = EngineConfig(
        load_format="dummy", device="cpu", attention_backend="flashinfer", decode_kernel="triton"
    )
    with pytest.raises(ValueError, match="'triton': page_size must be a power of two, got 12"):
        replace(on_flashinfer, page_size=12).resolve(mc)
    odd = ModelConfig.from_dict({**raw, "head_dim": 48}, dtype=torch.float32)
    with pytest.raises(ValueError, match="'triton': head_dim must be a power of two"):
        on_flashinfer.resolve(odd)
    assert on_flashinfer.resolve(mc).decode_kernel == "triton"
    # auto: Triton on e4m3 pages with flashinfer attention where the shape
    # allows; FlashInfer's on pages of the model's dtype.
    auto = replace(on_flashinfer, decode_kernel="auto")
    assert EngineConfig().decode_kernel == "auto"
    assert auto.resolve(mc).decode_kernel == "flashinfer"
    e4m3 = replace(auto, kv_cache_dtype="fp8_e4m3")
    assert e4m3.resolve(mc).decode_kernel == "triton"
    assert e4m3.resolve(odd).decode_kernel == "flashinfer"
    assert replace(e4m3, page_size=12).resolve(mc).decode_kernel == "flashinfer"
    assert replace(e4m3, attention_backend="torch_native").resolve(mc).decode_kernel == "flashinfer"
