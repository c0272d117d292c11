"""The CUDA sampler's Triton kernels under Triton's interpreter (no GPU needed):
on the same logits and noise they must draw the torch sampler's very tokens.

The interpreter must be chosen before triton is first imported, and for the
whole process, so these tests run in a child process started with
``TRITON_INTERPRET=1`` (``test_kernels_under_the_interpreter``); there the
sampler's sizes are shrunk so that small rows still span several splits and
tiles, and take both the candidate path and the whole-row search."""

from __future__ import annotations

import pytest
import torch
from triton_interp import INTERPRETED, interpreted, parent_only, run_interpreted

from engine.sampling import SamplingBatch, sample_torch
from protocol.sampling import SamplingParams

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # log(min_p 0)


@parent_only
def test_kernels_under_the_interpreter() -> None:
    run_interpreted(__file__, timeout_s=900)


if INTERPRETED:
    import engine.sampling_triton as ST

    # Several splits of two tiles each, and candidates that overflow when wide.
    ST.CHUNK, ST.BLOCK, ST.PIVOT_BLOCK, ST.SEARCH_BLOCK, ST.CAP = 128, 64, 64, 128, 64

VOCAB = 320


@pytest.fixture(autouse=True)
def fresh_workspace() -> None:
    if INTERPRETED:
        ST._workspace.cache_clear()


def _batch(params: list[SamplingParams], seeds: list[int] | None = None) -> SamplingBatch:
    n = len(params)
    seeds = list(range(100, 100 + n)) if seeds is None else seeds
    return SamplingBatch.build(params, seeds, [5] * n, VOCAB, "cpu")


def _modes(rows: int) -> list[int]:
    return ST._workspace(torch.device("cpu"), rows, -(-VOCAB // ST.CHUNK)).mode.tolist()


def _check(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    ids, logprobs = ST.sample_cuda(logits, batch)
    ref = sample_torch(logits, batch)
    assert ids.tolist() == ref.token_ids.tolist()
    torch.testing.assert_close(logprobs, ref.logprobs)
    return ids, logprobs


def _logits(rows: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=gen) * scale


CASES = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature": SamplingParams(temperature=0.8),
    "top_k": SamplingParams(temperature=0.8, top_k=7),
    "top_k_1": SamplingParams(temperature=0.8, top_k=1),
    "top_k_vocab": SamplingParams(temperature=0.8, top_k=VOCAB + 5),
    "top_p": SamplingParams(temperature=0.8, top_p=0.9),
    "top_p_tiny": SamplingParams(temperature=0.8, top_p=1e-6),
    "top_p_one": SamplingParams(temperature=0.8, top_p=1.0, top_k=20),
    "top_k_top_p": SamplingParams(temperature=0.7, top_k=12, top_p=0.8),
    "min_p": SamplingParams(temperature=1.0, min_p=0.05),
    "min_p_top_p": SamplingParams(temperature=1.0, min_p=0.2, top_p=0.95),
    # Wide: more candidates than CAP, so the exact whole-row search.
    "flat_top_p": SamplingParams(temperature=4.0, top_p=0.9),
    "large_top_k": SamplingParams(temperature=1.0, top_k=150),
    "large_top_k_top_p": SamplingParams(temperature=1.5, top_k=200, top_p=0.7),
    "flat_min_p": SamplingParams(temperature=5.0, min_p=0.3),
}


@interpreted
@pytest.mark.parametrize("name", list(CASES))
def test_same_tokens_as_torch_sampler(name: str) -> None:
    rows = 6
    _check(_logits(rows, seed=len(name)), _batch([CASES[name]] * rows))


@interpreted
def test_both_paths_are_taken() -> None:
    """Peaked rows draw among candidates; flat ones need the whole-row search."""
    rows = 4
    logits = _logits(rows, seed=1)
    _check(logits, _batch([CASES["top_k_top_p"], CASES["flat_top_p"]] * 2))
    assert _modes(rows) == [ST.CANDIDATES, ST.WHOLE_ROW] * 2


@interpreted
def test_ties_and_masked_tokens() -> None:
    """Values on a coarse grid tie at every threshold; -inf tokens are never drawn."""
    rows = 8
    logits = (_logits(rows, seed=2, scale=2.0) * 2).round() / 2
    logits[:, ::3] = float("-inf")
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=1.0, top_k=9, top_p=0.6),
        SamplingParams(temperature=1.0, min_p=0.3),
        SamplingParams(temperature=3.0, top_k=120),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=2.0, top_p=0.99),
    ]
    ids, _ = _check(logits, _batch(params))
    assert torch.isfinite(logits.gather(1, ids[:, None])).all()


@interpreted
def test_mixed_batch_and_batch_independence() -> None:
    """Every kind of row in one batch; a seeded row draws the same token alone,
    in another batch, at another row."""
    params = list(CASES.values())
    rows = len(params)
    logits = _logits(rows, seed=3)
    ids, _ = _check(logits, _batch(params))
    for r in (2, 5, 8, 11):
        alone, _ = ST.sample_cuda(logits[r : r + 1], _batch([params[r]], seeds=[100 + r]))
        assert alone.item() == ids[r].item()
    order = torch.arange(rows).flip(0)
    flipped, _ = ST.sample_cuda(
        logits[order], _batch([params[i] for i in order], seeds=[100 + int(i) for i in order])
    )
    assert flipped.flip(0).tolist() == ids.tolist()


@interpreted
def test_strided_and_bf16_logits() -> None:
    rows = 4
    params = [CASES["top_k_top_p"], CASES["min_p"], CASES["temperature"], CASES["greedy"]]
    wide = _logits(rows, seed=4).repeat(1, 2)
    _check(wide[:, :VOCAB], _batch(params))  # rows with a stride of 2 * VOCAB
    _check(_logits(rows, seed=5).to(torch.bfloat16), _batch(params))


@interpreted
def test_steps_and_seeds_change_the_draw() -> None:
    rows = 16
    logits = torch.zeros(rows, VOCAB)  # uniform: the token is the noise's argmax
    batch = _batch([SamplingParams(temperature=1.0, top_k=100)] * rows)
    ids, _ = _check(logits, batch)
    assert len(set(ids.tolist())) > rows // 2
