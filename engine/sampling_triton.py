"""Batched sampling on CUDA without sorting the vocabulary.

Same draw as ``engine.sampling`` (the Gumbel-max trick over the tokens the
filters keep, noise from the counter-based hash of (seed, step, token)), so a
seeded row still draws the same token whatever batch it lands in. What changes
is how the filters' thresholds are found and how the noise is made:

- top-k thresholds come from the ``max_top_k`` largest scaled logits
  (``torch.topk``), not a sort of the row, and so does the top-p threshold of
  a row that also has a top-k (its nucleus lies within them: top-p is of the
  top-k mass). Without a top-k, the exact top-p threshold comes from a search
  over the whole row that measures the mass above 16 pivots per pass
  (``_nucleus_threshold``): eight passes isolate one float32 value, all in
  one launch with one program per row;
- thresholds are compared in the scaled-logit domain (``y >= thr`` is
  ``p >= p_thr`` for ``p = softmax(y)``), so no probabilities are written;
- noise, filter and argmax are one pass over the row (``_gumbel_argmax_kernel``)
  instead of a dozen int64 tensor ops over ``[B, V]``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from engine.sampling_hash import _FMIX_C1, _FMIX_C2, _INDEX_SALT, _row_keys

if TYPE_CHECKING:
    from engine.sampling import SamplingBatch

BLOCK = 4096
PIVOTS = 16
SEARCH_PASSES = 8
"""(PIVOTS + 1) ** SEARCH_PASSES > 2**32: enough to isolate one float32 value."""
SEARCH_BLOCK = 1024
C1 = tl.constexpr(_FMIX_C1)
C2 = tl.constexpr(_FMIX_C2)
SALT = tl.constexpr(_INDEX_SALT)


@triton.jit
def _fmix32(x):
    """murmur3's finaliser on uint32 (wrapping multiplies, logical shifts)."""
    x ^= x >> 16
    x *= tl.full((), C1, tl.uint32)
    x ^= x >> 13
    x *= tl.full((), C2, tl.uint32)
    x ^= x >> 16
    return x


@triton.jit
def _gumbel_argmax_kernel(
    x_ptr, stride, vocab, temp_ptr, thr_ptr, key_ptr, best_ptr, idx_ptr, BLOCK: tl.constexpr
):
    """One block of one row: the best ``x / T + noise`` among kept tokens and its
    index. Blocks of a row run in parallel; the caller reduces them."""
    row = tl.program_id(0)
    blk = tl.program_id(1)
    nblk = tl.num_programs(1)
    temp = tl.load(temp_ptr + row)
    thr = tl.load(thr_ptr + row)
    key = tl.load(key_ptr + row).to(tl.uint32)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    inside = offs < vocab
    x = tl.load(x_ptr + row * stride + offs, mask=inside, other=0.0)
    # IEEE division, as the thresholds' ``x / T`` was computed.
    y = tl.math.div_rn(x, temp)
    h = _fmix32(key ^ _fmix32(offs.to(tl.uint32) + tl.full((), SALT, tl.uint32)))
    # 23 hash bits -> u = (2j + 1) / 2**24, exact and strictly inside (0, 1).
    u = ((h >> 9) * 2 + 1).to(tl.float32) * (1.0 / 16777216.0)
    score = -tl.log(-tl.log(u)) + y
    score = tl.where(inside & (y >= thr), score, float("-inf"))
    m = tl.max(score, axis=0)
    idx = tl.min(tl.where(score == m, offs, vocab), axis=0)  # lowest index of the max
    tl.store(best_ptr + row * nblk + blk, m)
    tl.store(idx_ptr + row * nblk + blk, idx.to(tl.int64))


@triton.jit
def _nucleus_kernel(
    y_ptr, stride, vocab, lse_ptr, lo_ptr, hi_ptr, target_ptr, todo_ptr, out_ptr,
    PIVOTS: tl.constexpr, PASSES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """The whole search for one row in one program: each pass measures the
    softmax mass of the row's tokens at or above ``PIVOTS`` evenly spaced
    pivots of the bracket ``[lo, hi)`` (in the order-preserving integer image
    of float32) and keeps the sub-bracket where the mass crosses ``target``.
    The row is re-read every pass; a batch's rows (32 MB at 64 x 128k) stay in
    L2 between passes. One program per row sums in one fixed order, so a row
    always gets the same threshold."""
    row = tl.program_id(0)
    lo = tl.load(lo_ptr + row)
    hi = tl.load(hi_ptr + row)
    if tl.load(todo_ptr + row) != 0:
        lse = tl.load(lse_ptr + row)
        target = tl.load(target_ptr + row)
        j = (tl.arange(0, PIVOTS) + 1).to(tl.int64)
        for _ in range(PASSES):
            # Pivots lie between two float32 images, so they fit in int32 (the
            # product that places them does not).
            pivots = lo + (hi - lo) * j // (PIVOTS + 1)
            piv32 = pivots.to(tl.int32)
            # Blocks' sums add up in float64: the mass near a top-p of 0.99 must
            # be right to a few parts in 1e7, and a row has 100k+ terms.
            acc = tl.zeros((PIVOTS,), tl.float64)
            for start in range(0, vocab, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                y = tl.load(y_ptr + row * stride + offs, mask=offs < vocab, other=float("-inf"))
                e = tl.exp(y - lse)
                bits = y.to(tl.int32, bitcast=True)
                key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
                block = tl.sum(tl.where(key[:, None] >= piv32[None, :], e[:, None], 0.0), axis=0)
                acc += block.to(tl.float64)
            # The mass falls as the pivot rises: the first n pivots reach the target.
            reached = acc >= target
            n = tl.sum(reached.to(tl.int32), axis=0)
            new_lo = tl.max(tl.where(reached, pivots, lo), axis=0)
            new_hi = tl.min(tl.where(reached, hi, pivots), axis=0)
            lo = tl.where(n > 0, new_lo, lo)
            hi = tl.where(n < PIVOTS, new_hi, hi)
    tl.store(out_ptr + row, lo)


def _sortable(x: torch.Tensor) -> torch.Tensor:
    """float32 -> int64 with the same order (the kernel's integer image)."""
    bits = x.contiguous().view(torch.int32)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)


def _unsortable(key: torch.Tensor) -> torch.Tensor:
    bits = key.to(torch.int32)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).view(torch.float32)


def _nucleus_threshold(y: torch.Tensor, target: torch.Tensor, todo: torch.Tensor) -> torch.Tensor:
    """[B] float32: for rows marked ``todo``, the largest value ``t`` of the row with
    ``sum(softmax(y)[y >= t]) >= target`` (the exact top-p threshold).

    A search over the integer images of the row's values: each pass measures
    the mass above ``PIVOTS`` evenly spaced pivots of the bracket ``[lo, hi)``
    at once, which shrinks it ``PIVOTS + 1`` times; ``SEARCH_PASSES`` passes
    bring any float32 bracket down to one value, which is then a value of the
    row (the mass only changes at them). One launch does every pass
    (``_nucleus_kernel``)."""
    rows, vocab = y.shape
    y = y.contiguous()
    lse = torch.logsumexp(y, dim=-1)
    # mass(y >= min) = 1 >= target; mass(y >= anything above the max) = 0.
    lo = _sortable(y.amin(dim=-1))
    hi = _sortable(y.amax(dim=-1)) + 1
    out = torch.empty_like(lo)
    _nucleus_kernel[(rows,)](
        y, y.stride(0), vocab, lse, lo, hi, target.to(torch.float64).contiguous(),
        todo.to(torch.int32), out,
        PIVOTS=PIVOTS, PASSES=SEARCH_PASSES, BLOCK=SEARCH_BLOCK, num_warps=8,
    )  # fmt: skip
    return _unsortable(out)


def _thresholds(y: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[B] float32: a row keeps the tokens with ``y >= threshold``."""
    rows, vocab = y.shape
    device = y.device
    neg_inf = torch.full((rows,), float("-inf"), device=device)
    thr = neg_inf
    top_k = batch.top_k.to(device)
    has_k = top_k < vocab
    top_p = batch.top_p.to(device)
    if batch.needs_top_k:
        # The max_top_k largest values hold every row's top-k, and so the whole
        # top-p nucleus of a row that has a top-k (top-p is of the top-k mass).
        # (A batch assembled by hand may not know its largest top-k: all of it.)
        c = min(vocab, batch.max_top_k or vocab)
        vals = y.topk(c, dim=-1).values  # sorted, descending
        k = top_k.clamp(1, c)[:, None]
        thr = torch.where(has_k, vals.gather(-1, k - 1).squeeze(-1), neg_inf)
        if batch.needs_top_p:
            thr_p = _top_p_within(vals, k, y, top_p)
            thr = torch.maximum(thr, torch.where(has_k, thr_p, neg_inf))
    if batch.needs_nucleus_search:
        todo = ~has_k & (top_p < 1.0)
        thr_p = _nucleus_threshold(y, top_p, todo)
        thr = torch.where(todo, torch.maximum(thr, thr_p), thr)
    if batch.needs_min_p:
        min_p = batch.min_p.to(device)
        thr = torch.maximum(thr, y.amax(dim=-1) + min_p.log())  # log(0) = -inf: no filter
    return thr.contiguous()


def _top_p_within(
    vals: torch.Tensor, k: torch.Tensor, y: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Top-p thresholds of rows with a top-k, from their sorted largest values."""
    c = vals.shape[1]
    probs = (vals - torch.logsumexp(y, dim=-1)[:, None]).exp()
    positions = torch.arange(c, device=y.device)[None, :]
    cum = probs.masked_fill(positions >= k, 0.0).cumsum(dim=-1)
    target = top_p * cum[:, -1]
    # Count the tokens whose predecessors' mass is still short of the target.
    count = ((cum - probs < target[:, None]) & (positions < k)).sum(-1, keepdim=True)
    thr = vals.gather(-1, count.clamp(1, c) - 1).squeeze(-1)
    return torch.where(top_p >= 1.0, float("-inf"), thr)


def sample_cuda(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """``engine.sampling.sample`` for CUDA logits: (token ids, logprobs)."""
    x = logits.to(torch.float32).contiguous()
    rows, vocab = x.shape
    device = x.device
    greedy_ids = x.argmax(dim=-1)
    if batch.all_greedy:
        token_ids = greedy_ids
    else:
        temperature = batch.temperature.to(device)
        is_greedy = temperature <= 0.0
        temperature = torch.where(is_greedy, 1.0, temperature).contiguous()
        if batch.needs_top_k or batch.needs_top_p or batch.needs_min_p:
            y = x / temperature[:, None]
            thr = _thresholds(y, batch)
        else:
            thr = torch.full((rows,), float("-inf"), device=device)
        keys = _row_keys(batch.seed.to(device), batch.step.to(device)).contiguous()
        blocks = triton.cdiv(vocab, BLOCK)
        best = torch.empty(rows, blocks, dtype=torch.float32, device=device)
        idx = torch.empty(rows, blocks, dtype=torch.int64, device=device)
        _gumbel_argmax_kernel[(rows, blocks)](
            x, x.stride(0), vocab, temperature, thr, keys, best, idx, BLOCK=BLOCK
        )
        # The first block holding the row's best score has its lowest index.
        drawn = idx.gather(-1, best.argmax(dim=-1, keepdim=True)).squeeze(-1)
        token_ids = torch.where(is_greedy, greedy_ids, drawn)
    chosen = x.gather(-1, token_ids[:, None]).squeeze(-1)
    logprobs = chosen - torch.logsumexp(x, dim=-1)
    return token_ids, logprobs
