"""A layer's query/key prologue and its KV write in one Triton kernel (CUDA).

Between the QKV projection and attention a layer runs, apart: the q and k
RMSNorms (Qwen3), the rotary embedding of q and k, the K/V scales of an e4m3
pool (multiplying q by the K scale, dividing K and V by theirs), the cast to
the pool's dtype and the append into the pages: two to nine element-wise
kernels per layer, each moving a few kilobytes at decode batch sizes, where a
kernel's launch costs more than its bytes. Here one launch does all of it: q
rows are rewritten in place (normed, rotated, scaled), k rows normed, rotated,
scaled and written to their page slot, v rows scaled and written beside them.

Each program takes ``ROWS`` (token, head) rows of one kind, q or k/v: the q
programs come first, then the k/v ones. A row's page slot is found as
FlashInfer's append finds it, from the same index (``AppendIndex``): the
token's request ``b``, its position ``p``, and the page
``indices[indptr[b] + p // page_size]`` at slot ``p % page_size``; so padded
CUDA-graph rows go where FlashInfer's append sent them (the scratch page 0).

Numbers, as the separate kernels give them: the norm in float32 rounded to
the model's dtype before its weight (as HF transformers does), the rotation
in float32 from the float32 cos/sin table (``RotaryEmbedding.table``), the
scale, then one rounding to the pool's dtype (e4m3 after clamping to its
range, as ``KVPool.stored``).
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from engine.layers import pdl

if TYPE_CHECKING:
    from engine.kvcache.pool import KVPool

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)


class AppendIndex(NamedTuple):
    """Where a forward's new K/V rows go, as FlashInfer's page-append kernel
    reads it (int32, on the device): each new token's request and position,
    and the page table the attention plan was made from."""

    batch_indices: torch.Tensor
    positions: torch.Tensor
    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor


class QKPrologue(NamedTuple):
    """What a layer does to q and k between its projection and attention."""

    positions: torch.Tensor
    """The tokens' positions, as the rotary table is indexed ``[n]``."""
    table: torch.Tensor
    """float32 ``[max_positions, head_dim]``: cos in the first half, sin in the second."""
    q_norm: torch.Tensor | None
    """The q RMSNorm's weight ``[head_dim]`` (None: no q/k norms)."""
    k_norm: torch.Tensor | None
    eps: float
    kv_scales: tuple[float, float] | None
    """``(k_scale, v_scale)`` of an e4m3 pool from the checkpoint: q is
    multiplied by the K scale, K and V divided by theirs (None: 1, 1)."""


ROWS_SMALL, ROWS_LARGE = 4, 16
"""(token, head) rows per program: few at decode sizes, so the rows of a
one-token step spread over programs; more for long prompts."""
LARGE_FROM_ROWS = 4096


def row_block(n: int, num_heads: int) -> int:
    """Rows per program for a forward of ``n`` tokens."""
    return ROWS_LARGE if n * num_heads >= LARGE_FROM_ROWS else ROWS_SMALL


@cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    prologue = pdl.prologue()

    # Not specialized: the token count and the index tensors (views at any
    # offset of one copied buffer) change from forward to forward, and a
    # specialization on their value or alignment would compile the kernel
    # again while requests wait; the q and k/v branches below assign the
    # strides and head counts to one variable, so they must not become
    # constants of different types either.
    @triton.jit(
        do_not_specialize=[
            "stride_q_tok", "stride_q_head", "stride_k_tok", "stride_k_head",
            "rope_pos", "batch_indices", "positions", "indptr", "indices",
            "n_tokens", "num_heads", "num_kv_heads",
        ]
    )  # fmt: skip
    def rope_kv_write_kernel(
        q,
        k,
        v,
        stride_q_tok,
        stride_q_head,
        stride_k_tok,
        stride_k_head,
        stride_v_tok,
        stride_v_head,
        rope_pos,
        table,
        q_norm,
        k_norm,
        batch_indices,
        positions,
        indptr,
        indices,
        k_cache,
        v_cache,
        stride_page,
        stride_slot,
        stride_head,
        page_size,
        n_tokens,
        num_heads,
        num_kv_heads,
        eps,
        q_mult,
        k_mult,
        v_mult,
        HEAD_DIM: tl.constexpr,
        ROWS: tl.constexpr,
        HAS_NORM: tl.constexpr,
        TO_FP8: tl.constexpr,
        FP8_LIMIT: tl.constexpr,
        WRITE_BACK: tl.constexpr = False,
        PDL: tl.constexpr = False,
    ):
        if PDL:  # engine.layers.pdl; a constant: nothing at all when off
            prologue()
        HALF: tl.constexpr = HEAD_DIM // 2
        pid = tl.program_id(0)
        q_programs = tl.cdiv(n_tokens * num_heads, ROWS)
        is_q = pid < q_programs
        # The row kind decides the source, the head count, the norm and the scale.
        if is_q:
            first = pid * ROWS
            heads = num_heads
            src = q
            s_tok = stride_q_tok
            s_head = stride_q_head
            weight = q_norm
            mult = q_mult
        else:
            first = (pid - q_programs) * ROWS
            heads = num_kv_heads
            src = k
            s_tok = stride_k_tok
            s_head = stride_k_head
            weight = k_norm
            mult = k_mult
        rows = first + tl.arange(0, ROWS)
        live = rows < n_tokens * heads
        token = tl.where(live, rows // heads, 0).to(tl.int64)
        head = (rows % heads).to(tl.int64)
        lo = tl.arange(0, HALF)
        at = src + token[:, None] * s_tok + head[:, None] * s_head + lo[None, :]
        x1 = tl.load(at, mask=live[:, None], other=0.0)
        x2 = tl.load(at + HALF, mask=live[:, None], other=0.0)
        dtype = x1.dtype
        x1 = x1.to(tl.float32)
        x2 = x2.to(tl.float32)
        if HAS_NORM:
            mean_sq = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM
            r = tl.math.rsqrt(mean_sq + eps)[:, None]
            w1 = tl.load(weight + lo).to(tl.float32)[None, :]
            w2 = tl.load(weight + HALF + lo).to(tl.float32)[None, :]
            x1 = ((x1 * r).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
            x2 = ((x2 * r).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
        pos = tl.load(rope_pos + token, mask=live, other=0).to(tl.int64)
        cos = tl.load(table + pos[:, None] * HEAD_DIM + lo[None, :], mask=live[:, None], other=0.0)
        sin = tl.load(
            table + pos[:, None] * HEAD_DIM + HALF + lo[None, :], mask=live[:, None], other=0.0
        )
        y1 = (x1 * cos - x2 * sin) * mult
        y2 = (x2 * cos + x1 * sin) * mult
        if is_q:
            tl.store(at, y1.to(dtype), mask=live[:, None])
            tl.store(at + HALF, y2.to(dtype), mask=live[:, None])
        else:
            req = tl.load(batch_indices + token, mask=live, other=0)
            p = tl.load(positions + token, mask=live, other=0)
            start = tl.load(indptr + req, mask=live, other=0)
            page = tl.load(indices + start + p // page_size, mask=live, other=0).to(tl.int64)
            slot = (p % page_size).to(tl.int64)
            base = page * stride_page + slot * stride_slot + head * stride_head
            dst = base[:, None] + lo[None, :]
            vd = tl.arange(0, HEAD_DIM)
            vals = tl.load(
                v + token[:, None] * stride_v_tok + head[:, None] * stride_v_head + vd[None, :],
                mask=live[:, None],
                other=0.0,
            ).to(tl.float32)
            vals = vals * v_mult
            if TO_FP8:
                y1 = tl.clamp(y1, -FP8_LIMIT, FP8_LIMIT)
                y2 = tl.clamp(y2, -FP8_LIMIT, FP8_LIMIT)
                vals = tl.clamp(vals, -FP8_LIMIT, FP8_LIMIT)
            out_dtype = k_cache.dtype.element_ty
            k1, k2, v1 = y1.to(out_dtype), y2.to(out_dtype), vals.to(out_dtype)
            tl.store(k_cache + dst, k1, mask=live[:, None])
            tl.store(k_cache + dst + HALF, k2, mask=live[:, None])
            tl.store(v_cache + base[:, None] + vd[None, :], v1, mask=live[:, None])
            if WRITE_BACK:
                # The rows as the pages now hold them, back in the source's
                # dtype (exact: e4m3 values are bf16/fp16 ones), over the
                # rows they came from; each row is this program's alone. The
                # e4m3 values are computed in float32 rather than widened
                # from k1, k2, v1: Triton 3.6 for sm_90 widens the half-row
                # e4m3 tensors k1 and k2 wrongly (some elements from the
                # wrong bytes; tests/test_rope_kv_write_gpu.py).
                if TO_FP8:
                    # Each float32 value (within +-FP8_LIMIT) to the nearest
                    # e4m3 value, ties to even, as the cast rounds: scaled by
                    # 2^(3 - e), e its exponent (at least the smallest
                    # normal's, -6), to a number under 16 whose integer part
                    # keeps 3 fraction bits; rounded to an integer by adding
                    # and taking away 1.5 x 2^23 (float32's own rounding, ties
                    # to even); scaled back. The scales are powers of two, so
                    # only that one rounding happens. Written out three times:
                    # Triton's interpreter does not see a kernel's closure.
                    e1 = tl.maximum(((y1.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
                    e2 = tl.maximum(((y2.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
                    ev = tl.maximum(((vals.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
                    # 2^(3 - e) and 2^(e - 3) from their exponent fields.
                    up1 = ((130 - e1) << 23).to(tl.int32).to(tl.float32, bitcast=True)
                    up2 = ((130 - e2) << 23).to(tl.int32).to(tl.float32, bitcast=True)
                    upv = ((130 - ev) << 23).to(tl.int32).to(tl.float32, bitcast=True)
                    down1 = ((e1 + 124) << 23).to(tl.int32).to(tl.float32, bitcast=True)
                    down2 = ((e2 + 124) << 23).to(tl.int32).to(tl.float32, bitcast=True)
                    downv = ((ev + 124) << 23).to(tl.int32).to(tl.float32, bitcast=True)
                    r1 = (y1 * up1 + 12582912.0 - 12582912.0) * down1
                    r2 = (y2 * up2 + 12582912.0 - 12582912.0) * down2
                    rv = (vals * upv + 12582912.0 - 12582912.0) * downv
                else:
                    r1, r2, rv = k1, k2, v1
                tl.store(at, r1.to(dtype), mask=live[:, None])
                tl.store(at + HALF, r2.to(dtype), mask=live[:, None])
                v_rows = v + token[:, None] * stride_v_tok + head[:, None] * stride_v_head
                tl.store(v_rows + vd[None, :], rv.to(dtype), mask=live[:, None])

    return rope_kv_write_kernel


def supports(head_dim: int) -> bool:
    """Whether the kernel takes this head size (a power of two, 16 to 256)."""
    return 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0


def rope_kv_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pre: QKPrologue,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    index: AppendIndex,
    write_back: bool = False,
) -> None:
    """Rewrite ``q`` ``[n, heads, d]`` in place (normed, rotated, times the K
    scale) and write ``k`` (normed, rotated, over its scale) and ``v`` (over
    its scale) ``[n, kv_heads, d]`` into the pages ``k_cache``/``v_cache``
    ``[pages, page_size, kv_heads, d]`` (one layer's views; K and V share their
    strides) at the slots ``index`` gives. Every last dim is contiguous.
    ``write_back``: ``k`` and ``v`` rewritten in place too, to the values the
    pages hold (rounded to the pages' dtype once, then widened), for an
    attention that reads them from there (``fresh_index``)."""
    n, num_heads, d = q.shape
    num_kv_heads = k.shape[1]
    if not supports(d):
        raise ValueError(f"head_dim {d} is not a power of two in [16, 256]")
    if (pre.q_norm is None) != (pre.k_norm is None):
        raise ValueError("the q and k norms come together or not at all")
    for t in (q, k, v, k_cache, v_cache):
        assert t.stride(-1) == 1, "rows must have a contiguous last dim"
    assert k_cache.stride() == v_cache.stride(), "K and V pages must share their strides"
    if n == 0:
        return
    ks, vs = pre.kv_scales or (1.0, 1.0)
    rows = row_block(n, num_heads)
    programs = -(-n * num_heads // rows) + -(-n * num_kv_heads // rows)
    weight = pre.q_norm if pre.q_norm is not None else pre.table  # unread without norms
    _kernel()[(programs,)](
        q, k, v,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        pre.positions, pre.table,
        weight, pre.k_norm if pre.k_norm is not None else weight,
        index.batch_indices, index.positions, index.indptr, index.indices,
        k_cache, v_cache,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_cache.shape[1], n, num_heads, num_kv_heads,
        float(pre.eps), float(ks), 1.0 / ks, 1.0 / vs,
        HEAD_DIM=d, ROWS=rows, HAS_NORM=pre.q_norm is not None,
        TO_FP8=k_cache.dtype == torch.float8_e4m3fn, FP8_LIMIT=FP8_MAX, WRITE_BACK=write_back,
        num_warps=4 if rows == ROWS_LARGE else 1,
        **pdl.launch_options(q.device),
    )  # fmt: skip


def warm_up(pool: KVPool, num_heads: int, qk_norm: bool, dtype: torch.dtype) -> list[int]:
    """Compile the kernel's variants for this model (one-token rows and long
    prompts' row blocks) before requests come: a worker without decode graphs
    would otherwise compile the small one under its first short prompt. Every
    row goes to the reserved scratch page 0; returns the row blocks run."""
    device, d = pool.kv.device, pool.config.head_dim
    kv_heads = pool.config.num_kv_heads
    table = torch.zeros(1, d, dtype=torch.float32, device=device)
    norm = torch.ones(d, dtype=dtype, device=device) if qk_norm else None
    ran = []
    for n in (1, -(-LARGE_FROM_ROWS // num_heads)):
        qkv = torch.zeros(n, (num_heads + 2 * kv_heads) * d, dtype=dtype, device=device)
        q, k, v = qkv.split([num_heads * d, kv_heads * d, kv_heads * d], dim=-1)
        zeros = torch.zeros(n, dtype=torch.int32, device=device)
        one_request = torch.zeros(2, dtype=torch.int32, device=device)  # indptr [0, 0]: page 0
        index = AppendIndex(zeros, zeros, one_request, one_request[:1], one_request[:1])
        pre = QKPrologue(zeros.long(), table, norm, norm, 1e-6, None)
        rope_kv_write(
            q.view(n, num_heads, d), k.view(n, kv_heads, d), v.view(n, kv_heads, d),
            pre, pool.k_layer(0), pool.v_layer(0), index,
        )  # fmt: skip
        ran.append(row_block(n, num_heads))
    return ran
