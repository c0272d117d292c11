"""Decode attention over the paged KV pool in Triton (CUDA): one query row per
request, bf16/fp16 queries, pages in the model's dtype or in e4m3.

Decode attention is bound by the bytes of K and V it reads; e4m3 pages halve
them. Each program takes one request, one KV head and one chunk of the
request's pages at a time, and computes the attention of the KV head's whole
group of query heads (``G`` = query heads per KV head, padded to the matrix
units' 16 rows) over that chunk with an online softmax: ``S = Q K^T`` and ``O += P V``
on the tensor cores, K and V tiles of ``block_pages`` pages gathered through the
page table and widened in registers (e4m3 to fp16, exactly). So each K/V byte
is read once per step, by the one program of its head and chunk.

A request's pages fall into chunks, and the ``splits`` programs of a request
and KV head take its chunks in turn (chunk ``c`` to program ``c mod
splits``). A request of one chunk has its rows of the output written by the
program that computed them. Otherwise each chunk's partial result
(normalized) and log-sum-exp (base 2) go to scratch, and a second kernel
merges the chunks in order: ``out = sum_c w_c o_c / sum_c w_c`` with ``w_c =
2^(lse_c - max lse)``.

The chunks, two ways (``DecodePlan.chunk_pages``):

- 0: ``splits`` even chunks (the last ones may be shorter or missing). The
  split count depends on the batch size alone (``plan``: enough programs for
  the GPU), so a prompt's attention is summed in a different order alone and
  in a batch.
- N > 0: chunks of at least N pages (a multiple of the tile), at most
  ``MAX_SPLITS`` of them, fixed by the request's page count alone: the same sums in the
  same order at every batch size, so a request's output does not depend on
  the batch it runs in. The chunks are merged one at a time in chunk order
  (a running log-sum-exp, weights and weighted outputs, with fused
  multiply-adds written out), by the merge kernel from the partials or, at
  one split (the batch alone fills the GPU), by the program that computed
  them, which then needs no partials and no merge kernel: the same
  operations in the same order, so the same bits.

Over e4m3 pages V is the second operand of ``P V`` with its contraction
(the tokens) down its rows, across its contiguous bytes. Left to itself,
Triton stages the e4m3 tile in shared memory and reads that operand from it
one byte at a time (``ld.shared.b8``: there is no transposing matrix load of
bytes before sm_100), then widens it. Reading V as int16 pairs widened with
integer ops instead (16-bit transposing loads, twice the shared memory) was
slower at every batch size on the H200 (docs/benchmarks.md, Decode
attention). ``DecodePlan.widen_v`` widens each V tile to fp16 in registers
first, with the conversion instruction in inline PTX (opaque, so the
compiler cannot move the layout change ahead of it): the layout change then
moves fp16 values and the operand is read with 16-bit transposing matrix
loads (``ldmatrix.trans``), with fewer instructions and registers a tile
(docs/benchmarks.md, Decode attention; tests/test_triton_sm90.py checks the
byte loads are gone).

Either way nothing depends on the context at plan time, so a CUDA graph
captured for a batch size replays for every context: a chunk's pages are
computed on the device from the request's page count.

Scales: the scores are ``sm_scale * k_scale * q . k`` (``k_scale`` is the
checkpoint's K scale of an e4m3 pool, 1 otherwise), the output is multiplied
by ``v_scale``.

The page table is FlashInfer's (``indptr``, ``indices``, ``last_page_len``,
int32 on the device), the caches ``KVPool.k_layer`` / ``v_layer`` views
``[num_pages, page_size, kv_heads, head_dim]`` with any page stride (the pool's
spans every layer: offsets are 64-bit).
"""

from __future__ import annotations

from functools import cache
from typing import Any, NamedTuple

import torch

from engine.layers import pdl

E4M3 = torch.float8_e4m3fn
MAX_SPLITS = 32
"""Splits of one request's pages at batch 1 (a power of two); the merge
kernel's tile."""
PROGRAMS_PER_SM = 2
"""Programs a step aims for, per SM of the GPU, when splitting."""
H200_SMS = 132
WIDEN_V = True
"""``plan``'s default for ``DecodePlan.widen_v`` over e4m3 pages: on, faster
than the byte-wise reads of V at every measured batch size
(docs/benchmarks.md, Decode attention). Where the instruction is missing the
launch reads bytes whatever the plan (``widens``)."""
WIDE_GROUP_REGISTERS = 128
"""``plan``'s register cap for groups of more than 4 on widened 4-page tiles."""


class DecodePlan(NamedTuple):
    """How a batch's attention is split and tiled."""

    splits: int
    """Programs per request and KV head (1 to ``MAX_SPLITS``)."""
    block_pages: int = 4
    """Pages per K/V tile (16-token pages: 64 tokens)."""
    warps: int = 4
    stages: int = 2
    chunk_pages: int = 0
    """0: a request's pages in ``splits`` even chunks; N: in chunks of at
    least N pages whatever the batch (batch-invariant sums)."""
    early_v: bool = False
    """Load a tile's V before its scores are computed, so that K and V are in
    flight together (more bytes in flight a program, more registers)."""
    widen_v: bool = False
    """Over e4m3 pages, widen each V tile to fp16 before the layout change to
    the tensor cores' operand (module doc). Ignored over other pages and
    where the instruction is missing (``widens``)."""
    registers: int = 0
    """A cap on the registers a thread of the split kernel takes (Triton's
    ``maxnreg``; what the compiler cannot keep under it spills), so that
    more programs fit an SM; 0: the compiler's choice."""
    heads_first: bool = False
    """Place a request's KV heads' programs next to each other (the launch
    grid's fastest axis the heads, not the requests). In the pool's pages
    (``[page, token, head, dim]``) a head's row of a token is ``head_dim``
    elements and the next token's row of that head lies one token's rows of
    every head further on; programs of one request's heads running together
    read the rows of the same tokens at about the same time, a contiguous
    span between them, as pages with the heads outermost would give one
    program. The same programs compute the same numbers either way."""

    @property
    def partials(self) -> int:
        """Scratch rows per request and query head: the most chunks a request
        can have (0: none, at one split: a request is one chunk, or its one
        program merges its chunks itself)."""
        if self.splits == 1:
            return 0  # one program a request and head: it merges its chunks itself
        return MAX_SPLITS if self.chunk_pages else self.splits


def plan(
    batch_size: int,
    num_kv_heads: int,
    block_pages: int | None = None,
    sms: int = H200_SMS,
    chunk_pages: int = 0,
    e4m3: bool = False,
    widen_v: bool | None = None,
    group: int = 1,
) -> DecodePlan:
    """Splits for ``batch_size`` requests: a power of two giving enough
    programs to fill a GPU of ``sms`` SMs (``PROGRAMS_PER_SM`` each), at most
    ``MAX_SPLITS``; one where the batch alone fills it.

    Tiles (``block_pages`` None), the best of sweeps on an H200 and an H100
    (Llama-3.1-8B's heads, 1024-token contexts): split, 4-page tiles on 4
    warps; where the batch alone fills the GPU, 8-page tiles on 8 warps over
    bf16 pages. Over e4m3 pages V is loaded with K, and widened to fp16
    before the tensor cores where ``widen_v`` (None: ``WIDEN_V``): then
    4-page tiles on 4 warps at every batch size (128 registers and 38 KiB
    of shared memory a program, so four programs share an SM where 8-page
    tiles fit two); read byte-wise instead, 8-page tiles take 4 warps (the
    registers of the byte-wise layout change). Batch-invariant chunks keep
    one tile at every batch size (a tile is a step of the sums).

    ``group``: query heads per KV head. Groups of more than 4 (Qwen3-MoE's
    8) on the widened 4-page tiles take more registers from Triton 3.6 than
    four programs an SM leave; capped at ``WIDE_GROUP_REGISTERS`` they keep
    four with nothing spilled. Llama's groups of 4 fit uncapped, and a cap
    there spills (docs/benchmarks.md, Decode attention)."""
    programs = batch_size * num_kv_heads
    splits = 1
    while splits < MAX_SPLITS and programs * splits < PROGRAMS_PER_SM * sms:
        splits *= 2
    widen_v = e4m3 and (WIDEN_V if widen_v is None else widen_v)
    if block_pages is None:
        block_pages = 8 if splits == 1 and not chunk_pages and not widen_v else 4
    warps = 8 if block_pages >= 8 and (widen_v or not e4m3) else 4
    wide = widen_v and block_pages == 4 and group > 4  # 4-page tiles take 4 warps
    return DecodePlan(
        splits,
        block_pages,
        warps,
        chunk_pages=chunk_pages,
        early_v=e4m3,
        widen_v=widen_v,
        registers=WIDE_GROUP_REGISTERS if wide else 0,
    )


def group_rows(num_heads: int, num_kv_heads: int) -> int:
    """Query rows of a program: the group, padded to 16 (a power of two)."""
    group = num_heads // num_kv_heads
    return max(16, 1 << (group - 1).bit_length())


@cache
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    prologue = pdl.prologue()

    @triton.jit
    def widen_e4m3(x):
        # Four e4m3 values (one 32-bit register, the first in the low byte) to
        # four fp16, two instructions of two. Not pure: the compiler may then
        # neither move nor merge it, so the value widened here is what the
        # layout change to the tensor cores' operand receives.
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi;\n"
            " mov.b32 {lo, hi}, $2;\n"
            " cvt.rn.f16x2.e4m3x2 $0, lo;\n"
            " cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r",
            [x.to(tl.uint8, bitcast=True)],
            dtype=tl.float16,
            is_pure=False,
            pack=4,
        )

    # The split count is an argument, not a constant: one binary serves every
    # batch size's plan.
    @triton.jit(do_not_specialize=["stride_qb", "stride_ob", "splits", "partials"])
    def split_attend(q, k, v, indptr, indices, last_len, out, part_o, part_lse,
                     stride_qb, stride_qh, stride_kp, stride_kt, stride_kh,
                     stride_vp, stride_vt, stride_vh, stride_ob, stride_oh,
                     qk_scale, v_scale, splits, partials,
                     G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                     PAGE: tl.constexpr, BLOCK_PAGES: tl.constexpr, CHUNK_PAGES: tl.constexpr,
                     MAX_CHUNKS: tl.constexpr, COMPUTE: tl.constexpr,
                     EARLY_V: tl.constexpr, WIDEN_V: tl.constexpr = False,
                     HEADS_FIRST: tl.constexpr = False,
                     PDL: tl.constexpr = False):  # fmt: skip
        if PDL:  # engine.layers.pdl; a constant: nothing at all when off
            prologue()
        if HEADS_FIRST:  # the grid (kv_heads, batch, splits): DecodePlan.heads_first
            h = tl.program_id(0)
            b = tl.program_id(1)
            kv_heads = tl.num_programs(0)
        else:  # (batch, kv_heads, splits)
            b = tl.program_id(0)
            h = tl.program_id(1)
            kv_heads = tl.num_programs(1)
        s = tl.program_id(2)
        BLOCK_N: tl.constexpr = BLOCK_PAGES * PAGE
        first = tl.load(indptr + b)
        n_pages = tl.load(indptr + b + 1) - first
        seq = (n_pages - 1) * PAGE + tl.load(last_len + b)
        # Pages per chunk (DecodePlan.chunk_pages); the merge finds the same.
        if CHUNK_PAGES == 0:
            chunk = tl.cdiv(n_pages, splits)
        else:
            chunk = tl.maximum(tl.cdiv(n_pages, MAX_CHUNKS), CHUNK_PAGES)
            chunk = tl.cdiv(chunk, BLOCK_PAGES) * BLOCK_PAGES
        n_chunks = tl.cdiv(n_pages, chunk)

        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        heads = h * G + g
        g_ok = g < G
        qv = tl.load(q + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                     mask=g_ok[:, None], other=0.0).to(COMPUTE)  # fmt: skip
        t = tl.arange(0, BLOCK_N)
        # Batch-invariant chunks at one split: this program has all of a
        # request's chunks and merges them itself, step by step in chunk
        # order as the merge kernel does from the partials, so the bits are
        # the same at every split count (the running merge is in chunked
        # binaries only: CHUNK_PAGES is a constant).
        best = tl.full([G_PAD], float("-inf"), tl.float32)
        wsum = tl.zeros([G_PAD], tl.float32)
        osum = tl.zeros([G_PAD, D], tl.float32)
        for c in range(s, n_chunks, splits):
            lo = c * chunk
            hi = tl.minimum(lo + chunk, n_pages)
            m = tl.full([G_PAD], float("-inf"), tl.float32)
            den = tl.zeros([G_PAD], tl.float32)
            acc = tl.zeros([G_PAD, D], tl.float32)
            for p0 in range(lo, hi, BLOCK_PAGES):
                page_i = p0 + t // PAGE
                slot = t % PAGE
                ok = (page_i < hi) & (page_i * PAGE + slot < seq)
                page = tl.load(indices + first + page_i, mask=page_i < hi, other=0).to(tl.int64)
                kt = tl.load(k + page[:, None] * stride_kp + slot[:, None] * stride_kt
                             + h * stride_kh + d[None, :], mask=ok[:, None], other=0.0)  # fmt: skip
                if EARLY_V:
                    vt = tl.load(v + page[:, None] * stride_vp + slot[:, None] * stride_vt
                                 + h * stride_vh + d[None, :], mask=ok[:, None], other=0.0)  # fmt: skip
                scores = tl.dot(qv, tl.trans(kt.to(COMPUTE))) * qk_scale  # [G_PAD, BLOCK_N], log2
                scores = tl.where(ok[None, :], scores, float("-inf"))
                # A chunk's first tile holds a token (every chunk starts inside
                # the request's pages, a page holds one at least): m is finite
                # from here on, and no exp2(-inf - -inf).
                m_new = tl.maximum(m, tl.max(scores, axis=1))
                alpha = tl.exp2(m - m_new)
                p = tl.exp2(scores - m_new[:, None])
                den = den * alpha + tl.sum(p, axis=1)
                if not EARLY_V:
                    vt = tl.load(v + page[:, None] * stride_vp + slot[:, None] * stride_vt
                                 + h * stride_vh + d[None, :], mask=ok[:, None], other=0.0)  # fmt: skip
                if WIDEN_V:  # a constant; the interpreter never sees widen_e4m3
                    vt = widen_e4m3(vt)
                acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE), vt.to(COMPUTE))
                m = m_new
            if n_chunks == 1:
                o = acc / den[:, None] * v_scale
                tl.store(out + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                         o.to(out.dtype.element_ty), mask=g_ok[:, None])  # fmt: skip
            else:
                o = acc / den[:, None]  # normalized, with its log-sum-exp (base 2)
                lse = m + tl.log2(den)
                if CHUNK_PAGES > 0:  # noqa: SIM102 (a constant: chunked binaries only)
                    if splits == 1:
                        # The merge kernel's step, the same operations in the
                        # same order (fused multiply-adds written out): the
                        # running merge of the chunks so far, scaled to the
                        # largest log-sum-exp. Written out in both kernels:
                        # Triton's interpreter does not see a kernel's
                        # closure, so a shared helper would not run there.
                        top = tl.maximum(best, lse)
                        keep = tl.exp2(best - top)
                        w = tl.exp2(lse - top)
                        wsum = tl.fma(wsum, keep, w)
                        osum = tl.fma(osum, keep[:, None], o * w[:, None])
                        best = top
                if (splits > 1) | (CHUNK_PAGES == 0):
                    # Partials [batch, heads, partials, (D)].
                    row = (b * kv_heads * G + heads) * partials + c
                    tl.store(part_o + row[:, None] * D + d[None, :], o, mask=g_ok[:, None])
                    tl.store(part_lse + row, lse, mask=g_ok)
        if CHUNK_PAGES > 0:  # noqa: SIM102 (a constant: the block is in chunked binaries only)
            if splits == 1 and n_chunks > 1:
                o = osum / wsum[:, None] * v_scale
                tl.store(out + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                         o.to(out.dtype.element_ty), mask=g_ok[:, None])  # fmt: skip

    @triton.jit(do_not_specialize=["stride_ob", "splits", "partials"])
    def merge(indptr, part_o, part_lse, out, stride_ob, stride_oh, v_scale, H, splits, partials,
              D: tl.constexpr, S_PAD: tl.constexpr, BLOCK_PAGES: tl.constexpr,
              CHUNK_PAGES: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
        if PDL:  # engine.layers.pdl; a constant: nothing at all when off
            prologue()
        b = tl.program_id(0)
        hq = tl.program_id(1)
        n_pages = tl.load(indptr + b + 1) - tl.load(indptr + b)
        if CHUNK_PAGES == 0:
            chunk = tl.cdiv(n_pages, splits)
        else:
            chunk = tl.maximum(tl.cdiv(n_pages, S_PAD), CHUNK_PAGES)
            chunk = tl.cdiv(chunk, BLOCK_PAGES) * BLOCK_PAGES
        n_chunks = tl.cdiv(n_pages, chunk)
        # Where a request is one chunk, split_attend wrote its rows.
        if CHUNK_PAGES == 0:
            if n_chunks > 1:
                s = tl.arange(0, S_PAD)
                d = tl.arange(0, D)
                ok = s < n_chunks
                row = (b * H + hq) * partials + s
                lse = tl.load(part_lse + row, mask=ok, other=float("-inf"))
                w = tl.exp2(lse - tl.max(lse, axis=0))  # chunks hold pages: the max is finite
                o = tl.load(part_o + row[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
                o = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0) * v_scale
                tl.store(out + b * stride_ob + hq * stride_oh + d, o.to(out.dtype.element_ty))
        elif n_chunks > 1:
            # Batch-invariant chunks: a running merge in chunk order, as
            # split_attend does at one split, unrolled.
            one = tl.arange(0, 1)
            d = tl.arange(0, D)
            best = tl.full([1], float("-inf"), tl.float32)
            wsum = tl.zeros([1], tl.float32)
            osum = tl.zeros([1, D], tl.float32)
            for c in tl.static_range(S_PAD):
                row = (b * H + hq) * partials + c + one
                ok = c + one < n_chunks
                lse = tl.load(part_lse + row, mask=ok, other=float("-inf"))
                o = tl.load(part_o + row[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
                # split_attend's step, its result kept for real chunks only (a
                # select, not a branch, so the loads run ahead of the steps).
                live = c < n_chunks
                top = tl.maximum(best, lse)
                keep = tl.exp2(best - top)
                w = tl.exp2(lse - top)
                wsum = tl.where(live, tl.fma(wsum, keep, w), wsum)
                osum = tl.where(live, tl.fma(osum, keep[:, None], o * w[:, None]), osum)
                best = tl.where(live, top, best)
            o = osum / wsum[:, None] * v_scale
            tl.store(out + b * stride_ob + hq * stride_oh + one[:, None] * 0 + d[None, :],
                     o.to(out.dtype.element_ty))  # fmt: skip

    return split_attend, merge


class Scratch(NamedTuple):
    """The splits' partial outputs ``[rows, D]`` and log-sum-exps ``[rows]``
    (float32; rows = batch x query heads x splits)."""

    o: torch.Tensor
    lse: torch.Tensor


def scratch_for(
    batch_size: int, num_heads: int, head_dim: int, partials: int, device: torch.device
) -> Scratch | None:
    """Scratch for ``partials`` rows per request and query head
    (``DecodePlan.partials``); None for none."""
    if not partials:
        return None
    rows = batch_size * num_heads * partials
    return Scratch(
        torch.empty(rows, head_dim, dtype=torch.float32, device=device),
        torch.empty(rows, dtype=torch.float32, device=device),
    )


class SharedScratch:
    """Split scratch that many CUDA graphs share: each graph's kernels read
    and write a prefix of one buffer, which is safe because the graphs replay
    one after another on one stream, and each consumes its partials within
    the same layer. Sizes captured largest first make one buffer; a larger
    request later gets a new one, and the older stay alive for the graphs
    that hold their addresses."""

    def __init__(self, head_dim: int, device: torch.device | str) -> None:
        self.head_dim = head_dim
        self.device = device
        self.buffers: list[Scratch] = []

    def take(self, batch_size: int, num_heads: int, decode_plan: DecodePlan) -> Scratch | None:
        """The scratch of one graph's plan (None where it has no partials)."""
        rows = batch_size * num_heads * decode_plan.partials
        if not rows:
            return None
        if not self.buffers or self.buffers[-1].lse.numel() < rows:
            whole = scratch_for(rows, 1, self.head_dim, 1, self.device)
            assert whole is not None
            self.buffers.append(whole)
        whole = self.buffers[-1]
        return Scratch(whole.o[:rows], whole.lse[:rows])


def shape_refusal(head_dim: int, page_size: int) -> str | None:
    """Why the kernel cannot take a model's heads or pages, or None (checked
    when an engine's config is resolved, and on every call)."""
    if head_dim & (head_dim - 1) or head_dim < 16:
        return f"head_dim must be a power of two >= 16, got {head_dim}"
    if page_size & (page_size - 1):
        return f"page_size must be a power of two, got {page_size}"
    return None


def check(q: torch.Tensor, k_cache: torch.Tensor, num_kv_heads: int) -> None:
    """Refuse, with the reason, what the kernel does not take."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    if q.dtype not in (torch.bfloat16, torch.float16) or q.stride(-1) != 1:
        raise ValueError(f"queries must be bf16/fp16 with contiguous rows, got {q.dtype}")
    reason = shape_refusal(head_dim, k_cache.shape[1])
    if reason:
        raise ValueError(reason)
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    if k_cache.dtype not in (q.dtype, E4M3) or k_cache.stride(-1) != 1:
        raise ValueError(f"pages must be {q.dtype} or e4m3 with contiguous rows")


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    indptr: torch.Tensor,
    indices: torch.Tensor,
    last_page_len: torch.Tensor,
    out: torch.Tensor,
    sm_scale: float,
    decode_plan: DecodePlan,
    scratch: Scratch | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of ``q`` ``[batch, heads, head_dim]`` (one row per request)
    over its pages, into ``out`` (same shape; rows may be strided). Where the
    plan has partials (``DecodePlan.partials``) ``scratch`` (``scratch_for``)
    holds them; None allocates it."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    check(q, k_cache, num_kv_heads)
    group = num_heads // num_kv_heads
    splits, partials = decode_plan.splits, decode_plan.partials
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits must be in [1, {MAX_SPLITS}], got {splits}")
    if decode_plan.chunk_pages < 0:
        raise ValueError(f"chunk_pages must be >= 0, got {decode_plan.chunk_pages}")
    if decode_plan.registers and not 24 <= decode_plan.registers <= 255:
        raise ValueError(f"registers must be 0 or in [24, 255], got {decode_plan.registers}")
    if partials and scratch is None:
        scratch = scratch_for(batch, num_heads, head_dim, partials, q.device)
    parts = scratch or Scratch(out, out)
    compute = _compute_dtype(q.dtype, k_cache.dtype)
    split_attend, merge = _kernels()
    launch = pdl.launch_options(q.device)
    log2e = 1.4426950408889634
    grid = (num_kv_heads, batch) if decode_plan.heads_first else (batch, num_kv_heads)
    split_attend[(*grid, splits)](
        q, k_cache, v_cache, indptr, indices, last_page_len, out, parts.o, parts.lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        sm_scale * k_scale * log2e, v_scale, splits, partials,
        G=group, G_PAD=group_rows(num_heads, num_kv_heads), D=head_dim,
        PAGE=k_cache.shape[1], BLOCK_PAGES=decode_plan.block_pages,
        CHUNK_PAGES=decode_plan.chunk_pages, MAX_CHUNKS=MAX_SPLITS, COMPUTE=compute,
        EARLY_V=decode_plan.early_v, HEADS_FIRST=decode_plan.heads_first,
        WIDEN_V=decode_plan.widen_v and k_cache.dtype == E4M3 and widens(q.device),
        num_warps=decode_plan.warps, num_stages=decode_plan.stages,
        **launch, **({"maxnreg": decode_plan.registers} if decode_plan.registers and q.is_cuda else {}),
    )  # fmt: skip
    if partials:
        merge[(batch, num_heads)](
            indptr, parts.o, parts.lse, out, out.stride(0), out.stride(1), v_scale, num_heads,
            splits, partials, D=head_dim, S_PAD=MAX_SPLITS,
            # The tile matters to the chunks only: one merge binary for even ones.
            BLOCK_PAGES=decode_plan.block_pages if decode_plan.chunk_pages else 1,
            CHUNK_PAGES=decode_plan.chunk_pages, num_warps=4, **launch,
        )  # fmt: skip
    return out


def widens(device: torch.device) -> bool:
    """Whether ``DecodePlan.widen_v`` applies on ``device``: NVIDIA GPUs with
    the e4m3 conversion instruction (compute capability 8.9 and later), not
    under Triton's interpreter (which runs no PTX)."""
    capability = pdl.compiled_capability(device)
    return capability is not None and capability >= (8, 9)


def _compute_dtype(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> Any:
    """The tensor cores' operand type: fp16 over e4m3 pages (e4m3 widens to
    fp16 exactly in one instruction; the queries and probabilities fit its
    range), the queries' type otherwise."""
    import triton.language as tl

    if kv_dtype == E4M3 or q_dtype == torch.float16:
        return tl.float16
    return tl.bfloat16
