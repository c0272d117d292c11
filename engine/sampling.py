"""Batched token sampling: greedy, temperature, top-k, top-p and min-p.

The whole batch is sampled with a handful of tensor ops on the logits' device;
there is no Python loop over requests and no ``torch.Generator``.

Randomness comes from a counter-based hash: the uniform number used for vocab
entry ``v`` of a request is a pure function of ``(seed, step, v)``. A request's
token therefore depends only on its seed, the index of the token in its output
and its logits - never on which other requests share the batch or on its row.

The draw is the Gumbel-max trick: ``argmax(logits / T + G)`` over the tokens the
filters keep, with ``G = -log(-log(u))``. This picks token ``i`` with
probability equal to its renormalised filtered probability.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from engine.host_copy import to_device
from protocol.sampling import SamplingParams

if TYPE_CHECKING:
    from engine.logit_adjust import LogitAdjust

__all__ = ["SEED_LIMIT", "SampleOutput", "SamplingBatch", "fold_seed", "sample", "sample_torch"]

from engine.sampling_hash import (  # noqa: E402, F401 (the tests reach the hash through here)
    SEED_LIMIT,
    _fmix32,
    _fmix32_,
    _fmix32_int,
    _gumbel_noise,
    fold_seed,
)

# --------------------------------------------------------------------------- batch


class SamplingBatch(NamedTuple):
    """Per-row sampling parameters of a batch, as tensors on the sampling device."""

    temperature: torch.Tensor
    """[B] float32; 0 means greedy for that row."""
    top_k: torch.Tensor
    """[B] int64 in [1, vocab_size]; vocab_size when disabled."""
    top_p: torch.Tensor
    """[B] float32 in (0, 1]."""
    min_p: torch.Tensor
    """[B] float32 in [0, 1]."""
    seed: torch.Tensor
    """[B] int64 in [0, 2**31)."""
    step: torch.Tensor
    """[B] int64: index of the token being sampled in the request's output (0 first)."""
    all_greedy: bool
    needs_top_k: bool
    needs_top_p: bool
    needs_min_p: bool
    max_top_k: int = 0
    """Largest top-k of the sampled rows that have one (0: none); known on the
    host, so the CUDA sampler sizes its candidates without a sync."""
    needs_nucleus_search: bool = False
    """Some sampled row has a top-p but no top-k (its nucleus is not bounded by
    a top-k's candidates)."""
    logits_mask: Callable[[torch.Tensor], None] | None = None
    """Masks the logits in place before anything else (grammar rows; see
    ``engine.grammar.GrammarStep``); None for a batch without grammars."""
    adjust: LogitAdjust | None = None
    """Logit bias and penalties of the batch's rows (``engine.logit_adjust``),
    applied after the mask; None when no row has any."""

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        steps: Sequence[int],
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingBatch:
        """Gather per-request parameters into tensors on ``device``.

        ``seeds[i]`` is request i's effective seed (any non-negative int; it is
        folded into ``[0, 2**31)`` with :func:`fold_seed`). ``steps[i]`` is the
        index in the request's output of the token being sampled. Requests whose
        params are greedy (temperature 0 or top_k 1) get temperature 0. The
        ``needs_*`` flags only look at the sampled (non-greedy) rows.
        """
        n = len(params)
        if len(seeds) != n or len(steps) != n:
            raise ValueError(
                f"params, seeds and steps must have one entry per request, "
                f"got {n}, {len(seeds)}, {len(steps)}"
            )
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        temperature: list[float] = []
        top_k: list[int] = []
        top_p: list[float] = []
        min_p: list[float] = []
        needs_top_k = needs_top_p = needs_min_p = False
        all_greedy = True
        max_top_k = 0
        needs_nucleus_search = False
        for p in params:
            greedy = p.greedy
            k = p.top_k if 0 < p.top_k < vocab_size else vocab_size
            temperature.append(0.0 if greedy else float(p.temperature))
            top_k.append(k)
            top_p.append(float(p.top_p))
            min_p.append(float(p.min_p))
            if not greedy:
                all_greedy = False
                if k < vocab_size:
                    needs_top_k = True
                    max_top_k = max(max_top_k, k)
                needs_top_p |= p.top_p < 1.0
                needs_nucleus_search |= p.top_p < 1.0 and k >= vocab_size
                needs_min_p |= p.min_p > 0.0
        step_list = [int(s) for s in steps]
        if any(s < 0 for s in step_list):
            raise ValueError("steps must be >= 0")
        # Two copies (float and int rows), queued from pinned memory.
        floats = to_device(torch.tensor([temperature, top_p, min_p], dtype=torch.float32), device)
        ints = to_device(
            torch.tensor([top_k, [fold_seed(s) for s in seeds], step_list], dtype=torch.int64),
            device,
        )
        return cls(
            temperature=floats[0],
            top_k=ints[0],
            top_p=floats[1],
            min_p=floats[2],
            seed=ints[1],
            step=ints[2],
            all_greedy=all_greedy,
            needs_top_k=needs_top_k,
            needs_top_p=needs_top_p,
            needs_min_p=needs_min_p,
            max_top_k=max_top_k,
            needs_nucleus_search=needs_nucleus_search,
        )


class SampleOutput(NamedTuple):
    token_ids: torch.Tensor
    """[B] int64."""
    logprobs: torch.Tensor
    """[B] float32: log-softmax of the raw (untempered, unfiltered) logits at the chosen token."""


# --------------------------------------------------------------------------- sampling


def _keep_mask(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor | None:
    """[B, V] bool of the tokens that survive top-k, then top-p, then min-p.

    Each filter becomes a per-row probability threshold, and a token is kept
    when its probability reaches every threshold. Thresholds are values taken
    from ``probs`` itself, so the comparisons are exact; tokens tied with the
    last kept one are kept too. A disabled filter has threshold 0, so a row's
    result does not depend on which filters the rest of the batch needs.
    The most probable token always survives.
    """
    vocab_size = probs.shape[-1]
    keep: torch.Tensor | None = None
    if batch.needs_top_k or batch.needs_top_p:
        sorted_probs = probs.sort(dim=-1, descending=True).values
        k = batch.top_k.to(probs.device).clamp(1, vocab_size)[:, None]
        if batch.needs_top_k:
            keep = probs >= sorted_probs.gather(-1, k - 1)
        if batch.needs_top_p:
            top_p = batch.top_p.to(probs.device)[:, None]
            positions = torch.arange(vocab_size, device=probs.device)[None, :]
            in_top_k = sorted_probs.masked_fill(positions >= k, 0.0)
            cumulative = in_top_k.cumsum(dim=-1)
            # Mass strictly before each sorted position; a token is in the nucleus
            # when the tokens ahead of it do not yet reach top_p of the top-k mass.
            before = torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], dim=-1)
            in_nucleus = before < top_p * cumulative[:, -1:]
            count = torch.minimum(in_nucleus.sum(dim=-1, keepdim=True).clamp_min(1), k)
            threshold = sorted_probs.gather(-1, count - 1)
            threshold = threshold.masked_fill(top_p >= 1.0, 0.0)
            keep_p = probs >= threshold
            keep = keep_p if keep is None else keep.logical_and_(keep_p)
    if batch.needs_min_p:
        min_p = batch.min_p.to(probs.device)[:, None]
        keep_m = probs >= min_p * probs.amax(dim=-1, keepdim=True)
        keep = keep_m if keep is None else keep.logical_and_(keep_m)
    return keep


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
    """Sample one token per row of ``logits`` ([B, V], any float dtype).

    Computation is in float32 on ``logits.device``. Greedy rows (temperature 0)
    take ``argmax`` of the raw logits (ties go to the lowest index). Other rows
    divide by their temperature, softmax, filter with top-k, top-p (relative to
    the top-k mass) and min-p, and draw from the renormalised result with noise
    that depends only on (seed, step, token index).
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    rows, vocab_size = logits.shape
    if batch.temperature.shape[0] != rows:
        raise ValueError(f"batch has {batch.temperature.shape[0]} rows, logits have {rows}")
    if batch.logits_mask is not None:
        batch.logits_mask(logits)
    adjusted = logits if batch.adjust is None else batch.adjust.apply(logits)
    if logits.is_cuda and _cuda_sampler() is not None:
        out = SampleOutput(*_cuda_sampler()(adjusted, batch))
    else:
        out = sample_torch(adjusted, batch)
    if batch.adjust is not None:
        batch.adjust.record(out.token_ids)
        # Logprobs stay the model's: of the logits before bias and penalties.
        x = logits.to(torch.float32)
        chosen = x.gather(-1, out.token_ids[:, None]).squeeze(-1)
        out = out._replace(logprobs=chosen - torch.logsumexp(x, dim=-1))
    return out


@functools.cache
def _cuda_sampler() -> (
    Callable[[torch.Tensor, SamplingBatch], tuple[torch.Tensor, torch.Tensor]] | None
):
    """The Triton sampler (same draws, no vocabulary sort) where Triton imports."""
    if importlib.util.find_spec("triton") is None:
        return None
    from engine.sampling_triton import sample_cuda

    return sample_cuda


def warm_up(vocab_size: int, device: torch.device) -> None:
    """Compile the CUDA sampler's kernels now, for every kind of row (greedy;
    drawn at a temperature; filtered by top-k, by top-p), rather than under
    the first request of each kind: the OpenAI defaults (temperature 1) and
    the common top-p are not the greedy rows a start-up forward samples."""
    if device.type != "cuda" or _cuda_sampler() is None:
        return
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(),
        SamplingParams(top_k=2),
        SamplingParams(top_p=0.9),
    ]
    for k, params in enumerate(kinds):
        rows = SamplingBatch.build([params], [k], [0], vocab_size, device)
        sample(torch.zeros(1, vocab_size, device=device), rows)


def sample_torch(logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
    """``sample`` in plain tensor ops (any device; the reference)."""
    rows, vocab_size = logits.shape
    device = logits.device
    x = logits.to(torch.float32)

    greedy_ids = x.argmax(dim=-1)
    if batch.all_greedy:
        token_ids = greedy_ids
    else:
        temperature = batch.temperature.to(device)
        is_greedy = temperature <= 0.0
        # Greedy rows are overwritten at the end; divide them by 1 to stay finite.
        scaled = x / torch.where(is_greedy, 1.0, temperature)[:, None]
        keep = None
        if batch.needs_top_k or batch.needs_top_p or batch.needs_min_p:
            keep = _keep_mask(torch.softmax(scaled, dim=-1), batch)
        scores = _gumbel_noise(batch.seed.to(device), batch.step.to(device), vocab_size)
        scores.add_(scaled)
        if keep is not None:
            scores.masked_fill_(~keep, float("-inf"))
        token_ids = torch.where(is_greedy, greedy_ids, scores.argmax(dim=-1))

    chosen = x.gather(-1, token_ids[:, None]).squeeze(-1)
    logprobs = chosen - torch.logsumexp(x, dim=-1)
    return SampleOutput(token_ids=token_ids, logprobs=logprobs)
