"""The CUDA sampler (``engine.sampling_triton``) against the same properties as
the torch sampler, plus exact agreement with it on the same logits and noise."""

from __future__ import annotations

import pytest
import test_sampling
import torch
from test_sampling import (  # noqa: F401 (collected here again, on CUDA)
    test_empirical_frequencies_over_seeds,
    test_empirical_frequencies_over_steps,
    test_filters_keep_ties_at_the_boundary,
    test_greedy_ties_take_lowest_index,
    test_logprobs_are_raw_log_softmax,
    test_low_temperature_concentrates,
    test_min_p_filter,
    test_mixed_greedy_and_sampled_rows,
    test_same_seed_and_step_independent_of_batch,
    test_same_seed_and_step_under_different_filter_flags,
    test_temperature_zero_is_argmax,
    test_top_k_never_leaves_top_k,
    test_top_k_one_equals_greedy,
    test_top_p_applies_to_top_k_mass,
    test_top_p_stays_in_nucleus,
)

from engine.sampling import SampleOutput, SamplingBatch, sample_torch
from protocol.sampling import SamplingParams

pytestmark = pytest.mark.gpu

TENSOR_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seed", "step")


def _on(batch: SamplingBatch, device: str) -> SamplingBatch:
    return batch._replace(**{f: getattr(batch, f).to(device) for f in TENSOR_FIELDS})


@pytest.fixture(autouse=True)
def cuda_sampler(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch sampler's tests call ``sample``: route it through the CUDA one."""
    from engine.sampling_triton import sample_cuda

    def on_cuda(logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
        ids, logprobs = sample_cuda(logits.to("cuda"), _on(batch, "cuda"))
        return SampleOutput(ids.cpu(), logprobs.cpu())

    monkeypatch.setattr(test_sampling, "sample", on_cuda)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=0.7, top_k=50, top_p=0.95),
        SamplingParams(temperature=1.1, top_k=3000),
        SamplingParams(temperature=1.0, min_p=0.05),
        # Flat: the nucleus reaches far past the candidates (bisection path).
        SamplingParams(temperature=4.0, top_p=0.9),
    ],
    ids=["temperature", "top_p", "top_k_top_p", "large_top_k", "min_p", "flat_top_p"],
)
def test_cuda_sampler_draws_what_the_torch_sampler_draws(params: SamplingParams) -> None:
    from engine.sampling_triton import sample_cuda

    rows, vocab = 64, 128256
    gen = torch.Generator(device="cuda").manual_seed(5)
    logits = torch.randn(rows, vocab, device="cuda", generator=gen) * 3.0
    batch = SamplingBatch.build([params] * rows, list(range(rows)), [9] * rows, vocab, "cuda")
    got = SampleOutput(*sample_cuda(logits, batch))
    ref = sample_torch(logits, batch)
    same = (got.token_ids == ref.token_ids).float().mean().item()
    # Same noise, same kept set: only a threshold tie decided by rounding may differ.
    assert same >= 0.98, f"{same:.1%} of rows agree"
    torch.testing.assert_close(got.logprobs, ref.logprobs)


def test_cuda_sampler_mixed_batch_rows_independent_of_batch_size() -> None:
    """Every kind of row in one batch of 256; each row draws the torch sampler's
    token, and the same token alone (a batch of one runs the same splits)."""
    from engine.sampling_triton import sample_cuda

    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=0.8, top_k=50),
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=0.7, top_k=50, top_p=0.9),
        SamplingParams(temperature=1.0, min_p=0.05),
        SamplingParams(temperature=4.0, top_p=0.9),  # the whole-row search
        SamplingParams(temperature=1.0, top_k=6000),  # more candidates than fit
    ]
    rows, vocab = 256, 128256
    params = [kinds[i % len(kinds)] for i in range(rows)]
    gen = torch.Generator(device="cuda").manual_seed(11)
    logits = torch.randn(rows, vocab, device="cuda", generator=gen) * 3.0
    batch = SamplingBatch.build(params, list(range(rows)), [4] * rows, vocab, "cuda")
    ids, logprobs = sample_cuda(logits, batch)
    ref = sample_torch(logits, batch)
    same = (ids == ref.token_ids).float().mean().item()
    assert same >= 0.98, f"{same:.1%} of rows agree"
    torch.testing.assert_close(logprobs, ref.logprobs)
    for r in range(0, rows, 37):
        one = SamplingBatch.build([params[r]], [r], [4], vocab, "cuda")
        assert sample_cuda(logits[r : r + 1], one)[0].item() == ids[r].item()


def _compiled() -> dict[str, int]:
    """How many binaries each sampling and grammar-mask kernel holds."""
    from triton.runtime.jit import JITFunction

    from engine import grammar_triton, sampling_triton

    counts = {}
    for module in (sampling_triton, grammar_triton):
        for name, fn in vars(module).items():
            if isinstance(fn, JITFunction) and name.endswith("_kernel"):
                counts[name] = sum(len(c[0]) for c in fn.device_caches.values())
    return counts


def test_warm_up_leaves_no_kernel_to_compile_for_any_batch() -> None:
    """After the start-up warm-up (``sampling.warm_up``, ``grammar.warm_up``,
    which the runner calls), batches of any size and any kind of row, with a
    grammar mask, compile nothing: a first request at the OpenAI defaults, or
    with a json_schema, does not wait for Triton."""
    from engine import grammar, sampling

    vocab = 32000
    device = torch.device("cuda")
    sampling.warm_up(vocab, device)
    grammar.warm_up(vocab, device)
    before = _compiled()
    assert len(before) == 8 and all(before.values()), before
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(),
        SamplingParams(temperature=0.7, top_p=0.95),
        SamplingParams(temperature=0.8, top_k=40),
        SamplingParams(temperature=1.0, min_p=0.05),
        SamplingParams(temperature=0.7, top_k=50, top_p=0.9),
    ]
    gen = torch.Generator(device="cuda").manual_seed(3)
    for rows in (1, 2, 3, 16, 17, 64):
        for mixed in (False, True):
            params = [kinds[(i if mixed else rows) % len(kinds)] for i in range(rows)]
            logits = torch.randn(rows, vocab, device="cuda", generator=gen)
            words = -(-vocab // 32)
            packed = torch.full((rows * (1 + words),), -1, dtype=torch.int32, device="cuda")
            packed[:rows] = torch.arange(rows, dtype=torch.int32)
            grammar.apply_packed_bitmask(logits, packed, rows)
            batch = SamplingBatch.build(params, list(range(rows)), [0] * rows, vocab, "cuda")
            sampling.sample(logits, batch)
    torch.cuda.synchronize()
    assert _compiled() == before
