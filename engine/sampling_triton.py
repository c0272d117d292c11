"""Batched sampling on CUDA in a few Triton launches, without sorting the vocabulary.

Same draw as ``engine.sampling`` (the Gumbel-max trick over the tokens the
filters keep, noise from the counter-based hash of (seed, step, token)), so a
seeded row still draws the same token whatever batch it lands in. Thresholds
are compared in the scaled-logit domain ``y = x / T`` (``y >= t`` is
``p >= p_t`` for ``p = softmax(y)``), so no probabilities are written.

Every row is cut into ``CHUNK``-sized splits, one program each, so a batch of
one row still spreads over the GPU; the split count depends only on the
vocabulary, so a row's sums (and thresholds) never depend on its batch.

1. ``_stats_kernel`` (row x split): max, argmax and sum-exp of ``x`` (greedy
   token, logprob) and of ``y``; rows without filters also draw here.
2. ``_pivot_kernel`` (row x split, filtered rows): how many tokens, and how
   much mass, lie at or above ``PIVOTS`` values below the row's max.
3. ``_compact_kernel`` (row x split): from the counts, the highest pivot below
   which no kept token can lie; the tokens above it (few: the top-k, the
   nucleus, the min-p set plus a margin) are copied out, each split at its own
   offset (known from the counts, so the order is fixed).
4. ``_select_kernel`` (row): sorts a row's candidates, finds its thresholds as
   the torch sampler does on the sorted row, and draws among the kept ones.
5. Rows whose candidates do not fit (a flat nucleus, a huge top-k) fall back to
   an exact search over the whole row (``_search_kernel``) and a draw over the
   whole row (``_draw_kernel``); both exit at once for the other rows.
6. ``_finish_kernel`` (row): picks each row's token, and its logprob.

A batch without filters makes two launches, a filtered one seven.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple

import torch
import triton
import triton.language as tl

from engine.sampling_hash import _FMIX_C1, _FMIX_C2, _INDEX_SALT, _SEED_SALT, _STEP_SALT

if TYPE_CHECKING:
    from engine.sampling import SamplingBatch

CHUNK = 8192
"""Tokens per program in the row-parallel kernels (a multiple of every BLOCK)."""
BLOCK = 1024
PIVOT_BLOCK = 256
PIVOTS = 16
PIVOT_STEP = 0.05
"""Pivot j sits ``PIVOT_STEP * (j + 1)**2`` below the row's max of ``y``: fine
near the max, 12.8 nats deep at the last one."""
CAP = 4096
"""Most candidates a row may have; more and it takes the whole-row search."""
MASS_MARGIN = 1e-5
"""A top-p row's pivot must hold this much more mass than top_p, so that the
candidates hold the nucleus whatever the rounding of either sum."""
SEARCH_PIVOTS = 16
SEARCH_PASSES = 8
"""(SEARCH_PIVOTS + 1) ** SEARCH_PASSES > 2**32: enough to isolate one float32 value."""
SEARCH_BLOCK = 1024

GREEDY, DRAWN, CANDIDATES, SEARCH, WHOLE_ROW = 0, 1, 2, 3, 4
"""Row modes: argmax; drawn by ``_stats_kernel``; drawn among candidates; still
needs its threshold searched; drawn over the whole row with its threshold."""

C1 = tl.constexpr(_FMIX_C1)
C2 = tl.constexpr(_FMIX_C2)
INDEX_SALT = tl.constexpr(_INDEX_SALT)
SEED_SALT = tl.constexpr(_SEED_SALT)
STEP_SALT = tl.constexpr(_STEP_SALT)
M_GREEDY = tl.constexpr(GREEDY)
M_DRAWN = tl.constexpr(DRAWN)
M_CANDIDATES = tl.constexpr(CANDIDATES)
M_SEARCH = tl.constexpr(SEARCH)
M_WHOLE_ROW = tl.constexpr(WHOLE_ROW)


# The batch's row count changes from step to step: specialising on it (1, a
# multiple of 16, other), or on the alignment of the per-row parameters (rows
# of one tensor, ``SamplingBatch.build``: 16-byte aligned when the count is a
# multiple of 4), would compile a kernel again under the first request of each
# kind of batch (``engine.sampling.warm_up`` compiles every kernel at start-up).
_batch_jit = triton.jit(
    do_not_specialize=["rows"],
    do_not_specialize_on_alignment=[
        "temp_ptr", "topk_ptr", "topp_ptr", "minp_ptr", "seed_ptr", "step_ptr"
    ],
)  # fmt: skip


# --------------------------------------------------------------------------- helpers


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
def _row_key(seed_ptr, step_ptr, row):
    """``engine.sampling_hash._row_keys`` of one row, in uint32."""
    seed = tl.load(seed_ptr + row).to(tl.uint32)
    step = tl.load(step_ptr + row).to(tl.uint32)  # truncation: step mod 2**32
    s = _fmix32(seed ^ tl.full((), SEED_SALT, tl.uint32))
    return _fmix32((s ^ step) + tl.full((), STEP_SALT, tl.uint32))


@triton.jit
def _gumbel(key, offs):
    """The noise of tokens ``offs`` for a row of hash ``key`` (as ``_gumbel_noise``)."""
    h = _fmix32(key ^ _fmix32(offs.to(tl.uint32) + tl.full((), INDEX_SALT, tl.uint32)))
    # 23 hash bits -> u = (2j + 1) / 2**24, exact and strictly inside (0, 1).
    u = ((h >> 9) * 2 + 1).to(tl.float32) * (1.0 / 16777216.0)
    return -tl.log(-tl.log(u))


@triton.jit
def _load_y(x_ptr, row, stride, offs, inside, t):
    """Raw and scaled logits of ``offs`` (``-inf`` outside the row)."""
    x = tl.load(x_ptr + row.to(tl.int64) * stride + offs, mask=inside, other=float("-inf"))
    x = x.to(tl.float32)
    # IEEE division, as the torch sampler's ``x / T``.
    return x, tl.math.div_rn(x, t)


@triton.jit
def _temperature(temp_ptr, row):
    """(row is greedy, divisor): greedy rows divide by 1, as the torch sampler."""
    temp = tl.load(temp_ptr + row)
    greedy = temp <= 0.0
    return greedy, tl.where(greedy, 1.0, temp)


@triton.jit
def _sortable(x):
    """float32 -> int32 with the same order."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _unsortable(key):
    bits = tl.where(key < 0, key ^ 0x7FFFFFFF, key)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _online_lse(m, s, v):
    """Fold tile ``v`` into a running (max, sum of exp(. - max)); an all ``-inf``
    prefix has sum 0 (not exp(-inf - -inf))."""
    new = tl.maximum(m, tl.max(v, axis=0))
    safe = tl.where(new == float("-inf"), 0.0, new)
    s = s * tl.exp(m - safe) + tl.sum(tl.exp(v - safe), axis=0)
    return new, s


@triton.jit
def _argmax_tile(best, best_idx, v, offs, vocab):
    """Fold tile ``v`` into a running (max, lowest index of it): a later tile
    replaces the running one only when strictly larger."""
    m = tl.max(v, axis=0)
    idx = tl.min(tl.where(v == m, offs, vocab), axis=0)
    take = m > best
    return tl.where(take, m, best), tl.where(take, idx, best_idx)


@triton.jit
def _split_stats(pf_ptr, row, rows, nsplit, plane_m, plane_s, SP: tl.constexpr):
    """A row's (max, log-sum-exp) from its splits' partial (max, sum) planes."""
    s = tl.arange(0, SP)
    inside = s < nsplit
    base = row * nsplit + s
    plane = rows * nsplit
    m = tl.load(pf_ptr + plane_m * plane + base, mask=inside, other=float("-inf"))
    e = tl.load(pf_ptr + plane_s * plane + base, mask=inside, other=0.0)
    mx = tl.max(m, axis=0)
    safe = tl.where(mx == float("-inf"), 0.0, mx)
    return mx, safe + tl.log(tl.sum(e * tl.exp(m - safe), axis=0))


@triton.jit
def _split_argmax(pf_ptr, pi_ptr, row, rows, nsplit, plane_f, plane_i, SP: tl.constexpr):
    """A row's (max, lowest index of it) from its splits' partials; splits hold
    increasing indices, so the lowest index among the splits that reach it."""
    s = tl.arange(0, SP)
    inside = s < nsplit
    base = row * nsplit + s
    plane = rows * nsplit
    m = tl.load(pf_ptr + plane_f * plane + base, mask=inside, other=float("-inf"))
    i = tl.load(pi_ptr + plane_i * plane + base, mask=inside, other=2**30)
    mx = tl.max(m, axis=0)
    return mx, tl.min(tl.where(inside & (m == mx), i, 2**30), axis=0)


@triton.jit
def _filters(vocab, topk_ptr, topp_ptr, minp_ptr, row):
    k = tl.load(topk_ptr + row)
    top_p = tl.load(topp_ptr + row)
    min_p = tl.load(minp_ptr + row)
    return k, top_p, min_p, k < vocab, top_p < 1.0, min_p > 0.0


# --------------------------------------------------------------------------- kernels


@_batch_jit
def _stats_kernel(
    x_ptr, stride, vocab, rows, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, step_ptr,
    pf_ptr, pi_ptr,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, SCALED: tl.constexpr,
):  # fmt: skip
    """Partials of one split of one row: planes of ``pf`` are max and sum-exp of
    ``x``, of ``y``, and the best ``y + noise``; planes of ``pi`` are the argmax
    of ``x`` and of the draw. Only sampled rows without filters draw here (they
    keep every token)."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    nsplit = tl.num_programs(1)
    plane = rows * nsplit
    slot = row * nsplit + split
    greedy, t = _temperature(temp_ptr, row)
    k, top_p, min_p, has_k, has_p, has_m = _filters(vocab, topk_ptr, topp_ptr, minp_ptr, row)
    draw = ~greedy & ~(has_k | has_p | has_m)
    key = _row_key(seed_ptr, step_ptr, row)
    neg = tl.full((), float("-inf"), tl.float32)
    zero = tl.full((), 0.0, tl.float32)
    mx, sx, my, sy, best = neg, zero, neg, zero, neg
    ax = tl.full((), 0, tl.int32)
    best_idx = tl.full((), 0, tl.int32)
    for start in range(0, CHUNK, BLOCK):
        offs = split * CHUNK + start + tl.arange(0, BLOCK)
        inside = offs < vocab
        x, y = _load_y(x_ptr, row, stride, offs, inside, t)
        _unused1, ax = _argmax_tile(mx, ax, x, offs, vocab)
        mx, sx = _online_lse(mx, sx, x)
        if SCALED:
            my, sy = _online_lse(my, sy, y)
            if draw:
                score = tl.where(inside, y + _gumbel(key, offs), float("-inf"))
                best, best_idx = _argmax_tile(best, best_idx, score, offs, vocab)
    tl.store(pf_ptr + 0 * plane + slot, mx)
    tl.store(pf_ptr + 1 * plane + slot, sx)
    tl.store(pf_ptr + 2 * plane + slot, my)
    tl.store(pf_ptr + 3 * plane + slot, sy)
    tl.store(pf_ptr + 4 * plane + slot, best)
    tl.store(pi_ptr + 0 * plane + slot, ax)
    tl.store(pi_ptr + 1 * plane + slot, best_idx)


@_batch_jit
def _pivot_kernel(
    x_ptr, stride, vocab, rows, temp_ptr, topk_ptr, topp_ptr, minp_ptr, pf_ptr, rs_ptr,
    piv_ptr, cnt_ptr, mass_ptr,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, P: tl.constexpr, SP: tl.constexpr,
    STEP: tl.constexpr, MASS: tl.constexpr,
):  # fmt: skip
    """Count (and, with ``MASS``, the softmax mass of) one split's tokens at or
    above each of a filtered row's pivots. Split 0 also stores the row's max and
    log-sum-exp of ``y`` and the pivots, for the kernels after it (which must
    compare against these very values)."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    nsplit = tl.num_programs(1)
    greedy, t = _temperature(temp_ptr, row)
    k, top_p, min_p, has_k, has_p, has_m = _filters(vocab, topk_ptr, topp_ptr, minp_ptr, row)
    if ~greedy & (has_k | has_p | has_m):
        my, lse = _split_stats(pf_ptr, row, rows, nsplit, 2, 3, SP)
        j = tl.arange(0, P)
        depth = (j + 1).to(tl.float32)
        piv = my - STEP * (depth * depth)
        if split == 0:
            tl.store(rs_ptr + 2 * row, my)
            tl.store(rs_ptr + 2 * row + 1, lse)
            tl.store(piv_ptr + row * P + j, piv)
        cnt = tl.zeros((P,), tl.int32)
        mass = tl.zeros((P,), tl.float32)
        for start in range(0, CHUNK, BLOCK):
            offs = split * CHUNK + start + tl.arange(0, BLOCK)
            inside = offs < vocab
            _unused2, y = _load_y(x_ptr, row, stride, offs, inside, t)
            above = inside[:, None] & (y[:, None] >= piv[None, :])
            cnt += tl.sum(above.to(tl.int32), axis=0)
            if MASS:
                e = tl.exp(y - lse)
                mass += tl.sum(tl.where(above, e[:, None], 0.0), axis=0)
        slot = (row * nsplit + split) * P + j
        tl.store(cnt_ptr + slot, cnt)
        tl.store(mass_ptr + slot, mass)


@_batch_jit
def _compact_kernel(
    x_ptr, stride, vocab, rows, temp_ptr, topk_ptr, topp_ptr, minp_ptr, rs_ptr, piv_ptr,
    cnt_ptr, mass_ptr, mode_ptr, cut_ptr, n_ptr, cy_ptr, ci_ptr,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, P: tl.constexpr, SP: tl.constexpr,
    CAP: tl.constexpr, MASS: tl.constexpr, MARGIN: tl.constexpr,
):  # fmt: skip
    """Each filtered row's cutoff: the highest pivot that provably has every kept
    token above it. Top-k keeps nothing below a pivot with k tokens above it;
    top-p without top-k nothing below one with top_p of the mass above it;
    min-p nothing below ``max + log(min_p)``. (A row with top-k and top-p needs
    its whole top-k: the nucleus is of the top-k mass.) The tokens at or above
    the cutoff are copied to the row's candidates, each split's at the offset
    the earlier splits' counts leave. Split 0 stores each row's mode."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    nsplit = tl.num_programs(1)
    greedy, t = _temperature(temp_ptr, row)
    k, top_p, min_p, has_k, has_p, has_m = _filters(vocab, topk_ptr, topp_ptr, minp_ptr, row)
    filtered = has_k | has_p | has_m
    if greedy | ~filtered:
        if split == 0:
            tl.store(mode_ptr + row, tl.where(greedy, M_GREEDY, M_DRAWN))
    else:
        my = tl.load(rs_ptr + 2 * row)
        j = tl.arange(0, P)
        s = tl.arange(0, SP)
        piv = tl.load(piv_ptr + row * P + j)
        part = (row * nsplit + s[:, None]) * P + j[None, :]
        in_split = (s[:, None] < nsplit) & (j[None, :] < P)
        counts = tl.load(cnt_ptr + part, mask=in_split, other=0)
        total = tl.sum(counts, axis=0)
        jk = tl.min(tl.where(total >= k, j, P), axis=0)
        jk = tl.where(has_k, jk, P)
        jp = tl.full((), P, tl.int32)
        if MASS:
            mass = tl.sum(tl.load(mass_ptr + part, mask=in_split, other=0.0), axis=0)
            jp = tl.min(tl.where(mass >= top_p + MARGIN, j, P), axis=0)
            jp = tl.where(has_p & ~has_k, jp, P)
        jm = tl.min(tl.where(piv <= my + tl.log(min_p), j, P), axis=0)
        jm = tl.where(has_m, jm, P)
        jstar = tl.where(has_k & has_p, jk, tl.minimum(jk, tl.minimum(jp, jm)))
        n = tl.sum(tl.where(j == jstar, total, 0), axis=0)
        cut = tl.max(tl.where(j == jstar, piv, float("-inf")), axis=0)
        fits = (jstar < P) & (n <= CAP)
        if split == 0:
            tl.store(mode_ptr + row, tl.where(fits, M_CANDIDATES, M_SEARCH))
            tl.store(cut_ptr + row, cut)
            tl.store(n_ptr + row, n)
        if fits:
            before = tl.sum(tl.where((s[:, None] < split) & (j[None, :] == jstar), counts, 0))
            for start in range(0, CHUNK, BLOCK):
                offs = split * CHUNK + start + tl.arange(0, BLOCK)
                inside = offs < vocab
                _unused3, y = _load_y(x_ptr, row, stride, offs, inside, t)
                keep = inside & (y >= cut)
                pos = before + tl.cumsum(keep.to(tl.int32), axis=0) - 1
                tl.store(cy_ptr + row * CAP + pos, y, mask=keep)
                tl.store(ci_ptr + row * CAP + pos, offs, mask=keep)
                before += tl.sum(keep.to(tl.int32), axis=0)


@triton.jit
def _select(
    row, vocab, seed_ptr, step_ptr, k, top_p, min_p, has_k, has_p, has_m, my, lse, cut, n,
    cy_ptr, ci_ptr, mode_ptr, tok_ptr, CAP: tl.constexpr, N: tl.constexpr,
):  # fmt: skip
    """Thresholds of one row from its ``n <= N`` sorted candidates, as the torch
    sampler computes them on its sorted row, then the draw among the kept ones."""
    pos = tl.arange(0, N)
    valid = pos < n
    y = tl.load(cy_ptr + row * CAP + pos, mask=valid, other=float("-inf"))
    idx = tl.load(ci_ptr + row * CAP + pos, mask=valid, other=0)
    # Sort (value, index) pairs packed in an int64, largest value first.
    packed = (_sortable(y).to(tl.int64) << 32) | idx.to(tl.int64)
    packed = tl.sort(packed, dim=0, descending=True)
    ys = _unsortable((packed >> 32).to(tl.int32))
    p = tl.where(valid, tl.exp(ys - lse), 0.0).to(tl.float64)
    neg = float("-inf")
    # Top-k: the k-th largest value (a row whose k exceeds n has it below the cutoff).
    t_k = tl.max(tl.where(pos == k - 1, ys, neg), axis=0)
    t_k = tl.where(has_k & (k <= n), t_k, neg)
    # Top-p: the tokens whose predecessors' mass is still short of top_p of the
    # top-k mass (the whole row's, 1, without a top-k).
    in_k = valid & (pos < k)
    p_k = tl.where(in_k, p, 0.0)
    before = tl.cumsum(p_k, axis=0) - p_k
    held = tl.sum(p_k, axis=0)
    target = top_p.to(tl.float64) * tl.where(has_k, held, 1.0)
    count = tl.maximum(tl.sum((in_k & (before < target)).to(tl.int32), axis=0), 1)
    t_p = tl.max(tl.where(pos == count - 1, ys, neg), axis=0)
    # Without a top-k, candidates short of the target put the threshold below the
    # cutoff (then another filter's is above it, or the row is searched).
    t_p = tl.where(has_p & (has_k | (held >= target)), t_p, neg)
    t_m = tl.where(has_m, my + tl.log(min_p), neg)
    thr = tl.maximum(t_k, tl.maximum(t_p, t_m))
    if thr >= cut:
        # Every kept token is a candidate: draw among them.
        key = _row_key(seed_ptr, step_ptr, row)
        token = (packed & 0xFFFFFFFF).to(tl.int32)
        score = tl.where(valid & (ys >= thr), ys + _gumbel(key, token), neg)
        best = tl.max(score, axis=0)
        tl.store(tok_ptr + row, tl.min(tl.where(score == best, token, vocab), axis=0))
    else:
        tl.store(mode_ptr + row, M_SEARCH)


@_batch_jit
def _select_kernel(
    vocab, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, step_ptr, rs_ptr, mode_ptr,
    cut_ptr, n_ptr, cy_ptr, ci_ptr, tok_ptr, CAP: tl.constexpr,
):  # fmt: skip
    """One program per row; the sort is sized to the row's candidates."""
    row = tl.program_id(0)
    if tl.load(mode_ptr + row) == M_CANDIDATES:
        k, top_p, min_p, has_k, has_p, has_m = _filters(vocab, topk_ptr, topp_ptr, minp_ptr, row)
        my = tl.load(rs_ptr + 2 * row)
        lse = tl.load(rs_ptr + 2 * row + 1)
        cut = tl.load(cut_ptr + row)
        n = tl.load(n_ptr + row)
        if n <= 256:
            _select(
                row, vocab, seed_ptr, step_ptr, k, top_p, min_p, has_k, has_p, has_m, my,
                lse, cut, n, cy_ptr, ci_ptr, mode_ptr, tok_ptr, CAP, 256,
            )  # fmt: skip
        elif n <= 1024:
            _select(
                row, vocab, seed_ptr, step_ptr, k, top_p, min_p, has_k, has_p, has_m, my,
                lse, cut, n, cy_ptr, ci_ptr, mode_ptr, tok_ptr, CAP, 1024,
            )  # fmt: skip
        else:
            _select(
                row, vocab, seed_ptr, step_ptr, k, top_p, min_p, has_k, has_p, has_m, my,
                lse, cut, n, cy_ptr, ci_ptr, mode_ptr, tok_ptr, CAP, CAP,
            )  # fmt: skip


@triton.jit
def _measure(x_ptr, stride, vocab, row, t, lse, piv, MASS: tl.constexpr, P: tl.constexpr,
             BLOCK: tl.constexpr):  # fmt: skip
    """Per pivot (an int32 float image): the mass (or count) of the row's tokens
    at or above it, summed in float64 in one fixed order."""
    acc = tl.zeros((P,), tl.float64)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < vocab
        _unused4, y = _load_y(x_ptr, row, stride, offs, inside, t)
        w = tl.where(inside, tl.exp(y - lse), 0.0) if MASS else inside.to(tl.float32)
        above = _sortable(y)[:, None] >= piv[None, :]
        acc += tl.sum(tl.where(above, w[:, None], 0.0), axis=0).to(tl.float64)
    return acc


@triton.jit
def _search(x_ptr, stride, vocab, row, t, lse, lo, hi, target, MASS: tl.constexpr,
            P: tl.constexpr, PASSES: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """The largest float image ``v`` in ``[lo, hi)`` whose tokens at or above it
    reach ``target`` (mass, or count): each pass measures ``P`` evenly spaced
    pivots of the bracket and keeps the sub-bracket where the target is crossed.
    ``lo`` must reach it and ``hi`` not; the result is a value of the row (the
    measure only changes at them)."""
    j = (tl.arange(0, P) + 1).to(tl.int64)
    for _ in range(PASSES):
        # Pivots lie between two float32 images, so they fit in int32 (the
        # product that places them does not).
        pivots = lo + (hi - lo) * j // (P + 1)
        acc = _measure(x_ptr, stride, vocab, row, t, lse, pivots.to(tl.int32), MASS, P, BLOCK)
        reached = acc >= target
        n = tl.sum(reached.to(tl.int32), axis=0)
        new_lo = tl.max(tl.where(reached, pivots, lo), axis=0)
        new_hi = tl.min(tl.where(reached, hi, pivots), axis=0)
        lo = tl.where(n > 0, new_lo, lo)
        hi = tl.where(n < P, new_hi, hi)
    return lo


@_batch_jit
def _search_kernel(
    x_ptr, stride, vocab, temp_ptr, topk_ptr, topp_ptr, minp_ptr, rs_ptr, mode_ptr, thr_ptr,
    P: tl.constexpr, PASSES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Exact thresholds over the whole row, for the rows whose candidates did
    not hold their kept tokens: the k-th largest value by counting, then the
    top-p threshold by mass within the top-k (its mass: the tokens above the
    k-th value, plus as many copies of it as fill k)."""
    row = tl.program_id(0)
    if tl.load(mode_ptr + row) == M_SEARCH:
        _unused5, t = _temperature(temp_ptr, row)
        k, top_p, min_p, has_k, has_p, has_m = _filters(vocab, topk_ptr, topp_ptr, minp_ptr, row)
        my = tl.load(rs_ptr + 2 * row)
        lse = tl.load(rs_ptr + 2 * row + 1)
        neg = float("-inf")
        # Every token is at or above -inf; none is above the max.
        lo = _sortable(tl.full((), neg, tl.float32)).to(tl.int64)
        hi = _sortable(my).to(tl.int64) + 1
        thr = tl.full((), neg, tl.float32)
        held = tl.full((), 1.0, tl.float64)
        if has_k:
            lo = _search(x_ptr, stride, vocab, row, t, lse, lo, hi, k.to(tl.float64), False,
                         P, PASSES, BLOCK)  # fmt: skip
            thr = _unsortable(lo.to(tl.int32))
            # Mass and count strictly above the k-th value (pivot: its next image).
            above = (lo + 1).to(tl.int32) + tl.zeros((P,), tl.int32)
            m_gt = tl.max(_measure(x_ptr, stride, vocab, row, t, lse, above, True, P, BLOCK))
            n_gt = tl.max(_measure(x_ptr, stride, vocab, row, t, lse, above, False, P, BLOCK))
            held = m_gt + (k.to(tl.float64) - n_gt) * tl.exp(thr - lse).to(tl.float64)
        if has_p:
            lo = _search(x_ptr, stride, vocab, row, t, lse, lo, hi, top_p.to(tl.float64) * held,
                         True, P, PASSES, BLOCK)  # fmt: skip
            thr = tl.maximum(thr, _unsortable(lo.to(tl.int32)))
        thr = tl.maximum(thr, tl.where(has_m, my + tl.log(min_p), neg))
        tl.store(thr_ptr + row, thr)
        tl.store(mode_ptr + row, M_WHOLE_ROW)


@_batch_jit
def _draw_kernel(
    x_ptr, stride, vocab, rows, temp_ptr, seed_ptr, step_ptr, mode_ptr, thr_ptr, pf_ptr, pi_ptr,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One split's best ``y + noise`` among the tokens at or above a searched
    row's threshold (into the planes ``_stats_kernel`` draws into)."""
    row = tl.program_id(0)
    if tl.load(mode_ptr + row) == M_WHOLE_ROW:
        split = tl.program_id(1)
        nsplit = tl.num_programs(1)
        _unused6, t = _temperature(temp_ptr, row)
        thr = tl.load(thr_ptr + row)
        key = _row_key(seed_ptr, step_ptr, row)
        best = tl.full((), float("-inf"), tl.float32)
        best_idx = tl.full((), 0, tl.int32)
        for start in range(0, CHUNK, BLOCK):
            offs = split * CHUNK + start + tl.arange(0, BLOCK)
            inside = offs < vocab
            _unused7, y = _load_y(x_ptr, row, stride, offs, inside, t)
            score = tl.where(inside & (y >= thr), y + _gumbel(key, offs), float("-inf"))
            best, best_idx = _argmax_tile(best, best_idx, score, offs, vocab)
        slot = row * nsplit + split
        tl.store(pf_ptr + 4 * rows * nsplit + slot, best)
        tl.store(pi_ptr + rows * nsplit + slot, best_idx)


@_batch_jit
def _finish_kernel(
    x_ptr, stride, rows, nsplit, temp_ptr, pf_ptr, pi_ptr, mode_ptr, ctok_ptr, tok_ptr, lp_ptr,
    SP: tl.constexpr, SCALED: tl.constexpr, MODES: tl.constexpr,
):  # fmt: skip
    """Each row's token (argmax, candidates' draw or the splits' best draw) and
    its logprob under the raw logits."""
    row = tl.program_id(0)
    _unused8, greedy_id = _split_argmax(pf_ptr, pi_ptr, row, rows, nsplit, 0, 0, SP)
    _unused9, lse = _split_stats(pf_ptr, row, rows, nsplit, 0, 1, SP)
    token = greedy_id
    if SCALED:
        greedy, _ = _temperature(temp_ptr, row)
        mode = tl.where(greedy, M_GREEDY, M_DRAWN)
        if MODES:
            mode = tl.load(mode_ptr + row)
        if mode == M_CANDIDATES:
            token = tl.load(ctok_ptr + row)
        elif mode != M_GREEDY:
            token = _split_argmax(pf_ptr, pi_ptr, row, rows, nsplit, 4, 1, SP)[1]
    x = tl.load(x_ptr + row.to(tl.int64) * stride + token).to(tl.float32)
    tl.store(tok_ptr + row, token.to(tl.int64))
    tl.store(lp_ptr + row, x - lse)


# --------------------------------------------------------------------------- host


class _Workspace(NamedTuple):
    """Scratch of one (device, rows, splits) shape; the kernels write every entry
    before reading it, and a stream runs one call at a time, so it is reused."""

    pf: torch.Tensor
    pi: torch.Tensor
    rs: torch.Tensor
    piv: torch.Tensor
    cnt: torch.Tensor
    mass: torch.Tensor
    mode: torch.Tensor
    cut: torch.Tensor
    n: torch.Tensor
    thr: torch.Tensor
    ctok: torch.Tensor
    cy: torch.Tensor
    ci: torch.Tensor


@functools.lru_cache(maxsize=8)
def _workspace(device: torch.device, rows: int, nsplit: int) -> _Workspace:
    f32, i32 = torch.float32, torch.int32

    def new(*shape: int, dtype: torch.dtype = f32) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device=device)

    return _Workspace(
        pf=new(5, rows, nsplit),
        pi=new(2, rows, nsplit, dtype=i32),
        rs=new(rows, 2),
        piv=new(rows, PIVOTS),
        cnt=new(rows, nsplit, PIVOTS, dtype=i32),
        mass=new(rows, nsplit, PIVOTS),
        mode=new(rows, dtype=i32),
        cut=new(rows),
        n=new(rows, dtype=i32),
        thr=new(rows),
        ctok=new(rows, dtype=i32),
        cy=new(rows, CAP),
        ci=new(rows, CAP, dtype=i32),
    )


def sample_cuda(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """``engine.sampling.sample`` for CUDA logits: (token ids, logprobs)."""
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    rows, vocab = x.shape
    device = x.device
    temp, top_k, top_p, min_p, seed, step = (
        t.to(device)
        for t in (batch.temperature, batch.top_k, batch.top_p, batch.min_p, batch.seed, batch.step)
    )
    nsplit = triton.cdiv(vocab, CHUNK)
    sp = triton.next_power_of_2(nsplit)
    ws = _workspace(device, rows, nsplit)
    token_ids = torch.empty(rows, dtype=torch.int64, device=device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=device)
    scaled = not batch.all_greedy
    filtered = scaled and (batch.needs_top_k or batch.needs_top_p or batch.needs_min_p)
    mass = batch.needs_nucleus_search
    stride = x.stride(0)
    split_grid = (rows, nsplit)
    _stats_kernel[split_grid](
        x, stride, vocab, rows, temp, top_k, top_p, min_p, seed, step, ws.pf, ws.pi,
        CHUNK=CHUNK, BLOCK=BLOCK, SCALED=scaled,
    )  # fmt: skip
    if filtered:
        _pivot_kernel[split_grid](
            x, stride, vocab, rows, temp, top_k, top_p, min_p, ws.pf, ws.rs, ws.piv, ws.cnt,
            ws.mass, CHUNK=CHUNK, BLOCK=PIVOT_BLOCK, P=PIVOTS, SP=sp, STEP=PIVOT_STEP, MASS=mass,
        )  # fmt: skip
        _compact_kernel[split_grid](
            x, stride, vocab, rows, temp, top_k, top_p, min_p, ws.rs, ws.piv, ws.cnt, ws.mass,
            ws.mode, ws.cut, ws.n, ws.cy, ws.ci,
            CHUNK=CHUNK, BLOCK=BLOCK, P=PIVOTS, SP=sp, CAP=CAP, MASS=mass, MARGIN=MASS_MARGIN,
        )  # fmt: skip
        _select_kernel[(rows,)](
            vocab, temp, top_k, top_p, min_p, seed, step, ws.rs, ws.mode, ws.cut, ws.n, ws.cy,
            ws.ci, ws.ctok, CAP=CAP, num_warps=8,
        )  # fmt: skip
        _search_kernel[(rows,)](
            x, stride, vocab, temp, top_k, top_p, min_p, ws.rs, ws.mode, ws.thr,
            P=SEARCH_PIVOTS, PASSES=SEARCH_PASSES, BLOCK=SEARCH_BLOCK, num_warps=8,
        )  # fmt: skip
        _draw_kernel[split_grid](
            x, stride, vocab, rows, temp, seed, step, ws.mode, ws.thr, ws.pf, ws.pi,
            CHUNK=CHUNK, BLOCK=BLOCK,
        )  # fmt: skip
    _finish_kernel[(rows,)](
        x, stride, rows, nsplit, temp, ws.pf, ws.pi, ws.mode, ws.ctok, token_ids, logprobs,
        SP=sp, SCALED=scaled, MODES=filtered,
    )  # fmt: skip
    return token_ids, logprobs
