"""Tests for engine.sampling: filters, reproducibility and the sampled distribution."""

from __future__ import annotations

import math

import pytest
import torch

from engine import sampling
from engine.sampling import SEED_LIMIT, SamplingBatch, fold_seed, sample
from protocol.sampling import SamplingParams


def build(params, seeds=None, steps=None, vocab_size=None, logits=None):
    n = len(params)
    if vocab_size is None:
        vocab_size = logits.shape[-1]
    seeds = list(range(n)) if seeds is None else seeds
    steps = [0] * n if steps is None else steps
    return SamplingBatch.build(params, seeds, steps, vocab_size, "cpu")


def logits_from_probs(probs, perm=None) -> torch.Tensor:
    """[V] logits whose softmax is ``probs``, optionally scattered to ``perm`` positions."""
    p = torch.tensor(probs, dtype=torch.float64)
    logits = p.log()
    if perm is not None:
        out = torch.empty_like(logits)
        out[torch.as_tensor(perm)] = logits
        logits = out
    return logits.to(torch.float32)


def reference_distribution(logits, temperature, top_k=-1, top_p=1.0, min_p=0.0):
    """Filtered, renormalised distribution of one row, computed independently in float64."""
    probs = torch.softmax(logits.to(torch.float64) / temperature, dim=-1)
    order = torch.argsort(probs, descending=True).tolist()
    kept = order if top_k <= 0 else order[:top_k]
    mass = sum(probs[i].item() for i in kept)
    nucleus, cum = [], 0.0
    for i in kept:
        nucleus.append(i)
        cum += probs[i].item() / mass
        if cum >= top_p:
            break
    top = probs[nucleus[0]].item()
    final = [i for i in nucleus if probs[i].item() >= min_p * top]
    out = torch.zeros_like(probs)
    out[final] = probs[final]
    return out / out.sum()


# --------------------------------------------------------------------------- build


def test_build_tensors_and_flags():
    vocab = 50
    params = [
        SamplingParams(temperature=0.7, top_k=-1),
        SamplingParams(temperature=1.0, top_k=0, top_p=0.9),
        SamplingParams(temperature=1.2, top_k=10, min_p=0.1),
        SamplingParams(temperature=1.0, top_k=500),
        SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.5),
        SamplingParams(temperature=0.9, top_k=1),
    ]
    batch = SamplingBatch.build(
        params, [1, 2, 3, 2**40 + 7, 5, 6], [0, 3, 9, 1, 2, 4], vocab, "cpu"
    )
    assert batch.temperature.dtype == torch.float32
    assert batch.top_k.dtype == torch.int64
    assert batch.top_p.dtype == torch.float32
    assert batch.min_p.dtype == torch.float32
    assert batch.seed.dtype == torch.int64
    assert batch.step.dtype == torch.int64
    assert batch.top_k.tolist() == [vocab, vocab, 10, vocab, 3, 1]
    # temperature 0 and top_k == 1 are both greedy.
    assert batch.temperature.tolist() == pytest.approx([0.7, 1.0, 1.2, 1.0, 0.0, 0.0])
    assert batch.step.tolist() == [0, 3, 9, 1, 2, 4]
    assert batch.seed.tolist()[:3] == [1, 2, 3]
    assert all(0 <= s < SEED_LIMIT for s in batch.seed.tolist())
    assert not batch.all_greedy
    assert batch.needs_top_k and batch.needs_top_p and batch.needs_min_p


def test_build_flags_ignore_greedy_rows():
    params = [SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.2), SamplingParams()]
    batch = build(params, vocab_size=100)
    assert not batch.all_greedy
    assert not (batch.needs_top_k or batch.needs_top_p or batch.needs_min_p)
    greedy = build([SamplingParams(temperature=0.0), SamplingParams(top_k=1)], vocab_size=100)
    assert greedy.all_greedy


def test_build_rejects_length_mismatch():
    with pytest.raises(ValueError):
        SamplingBatch.build([SamplingParams()], [1, 2], [0], 10, "cpu")
    with pytest.raises(ValueError):
        SamplingBatch.build([SamplingParams()], [1], [0, 0], 10, "cpu")


def test_fold_seed():
    assert fold_seed(0) == 0
    assert fold_seed(12345) == 12345
    assert fold_seed(SEED_LIMIT - 1) == SEED_LIMIT - 1
    big = [SEED_LIMIT, SEED_LIMIT + 1, 2**32, 2**32 + 1, 2**64 + 3, 10**30]
    folded = [fold_seed(s) for s in big]
    assert all(0 <= f < SEED_LIMIT for f in folded)
    assert len(set(folded)) == len(big)
    assert folded == [fold_seed(s) for s in big]
    with pytest.raises(ValueError):
        fold_seed(-1)


def test_tensor_hash_matches_integer_reference():
    # Values across the whole 32-bit range, including ones whose products overflow int64.
    gen = torch.Generator().manual_seed(10)
    x = torch.cat(
        [
            torch.tensor([0, 1, 2**16 - 1, 2**16, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1]),
            torch.randint(0, 2**32, (2000,), generator=gen, dtype=torch.int64),
        ]
    )
    expected = [sampling._fmix32_int(v) for v in x.tolist()]
    assert sampling._fmix32(x).tolist() == expected
    assert sampling._fmix32_(x.clone(), torch.empty_like(x)).tolist() == expected
    assert sampling._fmix32(x).unique().numel() == x.unique().numel()  # a bijection


def test_noise_depends_only_on_seed_step_and_index():
    seed = torch.tensor([0, 5, 5, 2**31 - 1])
    step = torch.tensor([0, 0, 1, 123456])
    wide = sampling._gumbel_noise(seed, step, 1000)
    narrow = sampling._gumbel_noise(seed, step, 300)
    assert torch.equal(wide[:, :300], narrow)  # vocab size does not matter
    assert torch.equal(sampling._gumbel_noise(seed.flip(0), step.flip(0), 300), narrow.flip(0))
    assert torch.isfinite(wide).all()
    assert not torch.equal(wide[1], wide[2])  # step matters
    # Standard Gumbel: mean ~ 0.5772, variance ~ pi^2 / 6.
    assert wide.mean().item() == pytest.approx(0.5772, abs=0.05)
    assert wide.var().item() == pytest.approx(math.pi**2 / 6, abs=0.1)


# --------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_temperature_zero_is_argmax(dtype):
    torch.manual_seed(0)
    logits = (torch.randn(16, 300) * 3).to(dtype)
    batch = build([SamplingParams(temperature=0.0)] * 16, logits=logits)
    assert batch.all_greedy
    out = sample(logits, batch)
    assert out.token_ids.dtype == torch.int64
    assert torch.equal(out.token_ids, logits.float().argmax(dim=-1))


def test_greedy_ties_take_lowest_index():
    logits = torch.zeros(2, 10)
    logits[0, [3, 7]] = 5.0
    logits[1, [9, 2, 4]] = 1.0
    out = sample(logits, build([SamplingParams(temperature=0.0)] * 2, logits=logits))
    assert out.token_ids.tolist() == [3, 2]


def test_top_k_one_equals_greedy():
    torch.manual_seed(1)
    logits = torch.randn(32, 200)
    expected = logits.argmax(dim=-1)
    # Through build (top_k == 1 is treated as greedy) ...
    params = [SamplingParams(temperature=1.5, top_k=1)] * 32
    out = sample(logits, build(params, steps=list(range(32)), logits=logits))
    assert torch.equal(out.token_ids, expected)
    # ... and through the sampling path with top_k == 1 and a positive temperature.
    batch = build([SamplingParams(temperature=1.5)] * 32, steps=list(range(32)), logits=logits)
    batch = batch._replace(top_k=torch.ones(32, dtype=torch.int64), needs_top_k=True)
    assert not batch.all_greedy
    for step in range(20):
        out = sample(logits, batch._replace(step=torch.full((32,), step, dtype=torch.int64)))
        assert torch.equal(out.token_ids, expected)


# --------------------------------------------------------------------------- filters


def test_top_k_never_leaves_top_k():
    torch.manual_seed(2)
    vocab, rows, k = 100, 64, 5
    logits = torch.randn(rows, vocab) * 0.5  # flat: many tokens are plausible
    allowed = logits.topk(k, dim=-1).indices
    seen = torch.zeros(rows, vocab, dtype=torch.bool)
    for step in range(40):
        batch = build(
            [SamplingParams(temperature=1.0, top_k=k)] * rows,
            seeds=[1000 + r for r in range(rows)],
            steps=[step] * rows,
            logits=logits,
        )
        ids = sample(logits, batch).token_ids
        assert (ids[:, None] == allowed).any(dim=-1).all(), f"left the top-{k} at step {step}"
        seen[torch.arange(rows), ids] = True
    # It really samples: most rows visit every one of their k allowed tokens.
    assert seen.sum(dim=-1).float().mean() > k - 0.5


def test_top_p_stays_in_nucleus():
    vocab = 40
    probs = [0.5, 0.3, 0.1, 0.05] + [0.05 / (vocab - 4)] * (vocab - 4)
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(3))
    row = logits_from_probs(probs, perm)
    nucleus = {int(perm[0]), int(perm[1])}  # 0.5 + 0.3 >= 0.75 while 0.5 alone is not
    rows = 2000
    logits = row.expand(rows, vocab)
    batch = build(
        [SamplingParams(temperature=1.0, top_p=0.75)] * rows,
        seeds=[7] * rows,
        steps=list(range(rows)),
        logits=logits,
    )
    ids = sample(logits, batch).token_ids.tolist()
    assert set(ids) == nucleus
    # Renormalised nucleus: 0.5 / 0.8 = 0.625 for the top token.
    assert ids.count(int(perm[0])) / rows == pytest.approx(0.625, abs=0.04)
    # A top_p below the top probability keeps only the top token.
    batch = batch._replace(top_p=torch.full((rows,), 0.4))
    assert set(sample(logits, batch).token_ids.tolist()) == {int(perm[0])}


def test_top_p_applies_to_top_k_mass():
    # After top_k=2 the distribution is (0.6, 0.4) of the original 0.3 / 0.2 pair;
    # top_p=0.55 then keeps only the first token (without top-k it would need more).
    probs = [0.3, 0.2, 0.18, 0.17, 0.15]
    logits = logits_from_probs(probs).expand(500, 5)
    batch = build(
        [SamplingParams(top_k=2, top_p=0.55)] * 500, steps=list(range(500)), logits=logits
    )
    assert set(sample(logits, batch).token_ids.tolist()) == {0}
    batch = build([SamplingParams(top_p=0.55)] * 500, steps=list(range(500)), logits=logits)
    assert set(sample(logits, batch).token_ids.tolist()) == {0, 1, 2}


def test_min_p_filter():
    probs = [0.4, 0.3, 0.15, 0.1, 0.05]
    perm = [4, 0, 2, 1, 3]
    logits = logits_from_probs(probs, perm).expand(3000, 5)
    # min_p * max = 0.12: keeps 0.4, 0.3 and 0.15.
    batch = build(
        [SamplingParams(min_p=0.3)] * 3000, seeds=[11] * 3000, steps=range(3000), logits=logits
    )
    ids = sample(logits, batch).token_ids
    assert set(ids.tolist()) == {4, 0, 2}
    freq = torch.bincount(ids, minlength=5).double() / 3000
    expected = torch.tensor([0.3, 0.0, 0.15, 0.0, 0.4], dtype=torch.float64) / 0.85
    assert (freq - expected).abs().max() < 0.04
    # min_p = 1 keeps only the most probable token.
    batch = batch._replace(min_p=torch.ones(3000))
    assert set(sample(logits, batch).token_ids.tolist()) == {4}


def test_filters_keep_ties_at_the_boundary():
    # Ties with the last kept token are kept (thresholds compare probabilities), which
    # makes the result independent of the order of tied tokens.
    logits = torch.tensor([[3.0, 1.0, 3.0, 0.0, 3.0]]).expand(600, 5)
    batch = build([SamplingParams(top_k=2)] * 600, steps=range(600), logits=logits)
    ids = sample(logits, batch).token_ids
    counts = torch.bincount(ids, minlength=5)
    assert counts[[1, 3]].sum() == 0
    assert (counts[[0, 2, 4]] > 150).all()


# --------------------------------------------------------------------------- reproducibility


def test_same_seed_and_step_independent_of_batch():
    torch.manual_seed(4)
    vocab = 500
    target = torch.randn(vocab) * 0.3
    target_params = SamplingParams(temperature=0.9, top_k=200, top_p=0.95)
    for seed, step in [(0, 0), (1, 0), (123, 5), (2**31 - 1, 77), (99, 1000)]:
        alone = sample(
            target[None], build([target_params], seeds=[seed], steps=[step], vocab_size=vocab)
        ).token_ids.item()
        for size in (2, 5, 9):
            for pos in (0, size // 2, size - 1):
                others = torch.randn(size, vocab) * 2
                others[pos] = target
                params = [
                    SamplingParams(temperature=0.0),
                    SamplingParams(temperature=1.3, min_p=0.2),
                    SamplingParams(temperature=0.5, top_p=0.5),
                    SamplingParams(temperature=2.0, top_k=3),
                ] * 3
                params = params[:size]
                seeds = [seed + 1 + i for i in range(size)]
                steps = [step + i for i in range(size)]
                params[pos], seeds[pos], steps[pos] = target_params, seed, step
                batch = build(params, seeds=seeds, steps=steps, vocab_size=vocab)
                got = sample(others, batch).token_ids[pos].item()
                assert got == alone, (seed, step, size, pos)


def test_same_seed_and_step_under_different_filter_flags():
    # The row's own params are unchanged; only whether the batch needs each filter differs.
    torch.manual_seed(5)
    logits = torch.randn(1, 300) * 0.2
    row = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0)
    filtered = SamplingParams(temperature=1.0, top_p=0.3, top_k=4, min_p=0.5)
    for step in range(50):
        alone = sample(logits, build([row], seeds=[42], steps=[step], logits=logits))
        pair = sample(
            torch.cat([torch.randn(1, 300), logits]),
            build([filtered, row], seeds=[1, 42], steps=[0, step], vocab_size=300),
        )
        assert pair.token_ids[1].item() == alone.token_ids.item()


def test_different_seeds_give_different_tokens():
    vocab, rows = 1000, 400
    logits = torch.zeros(rows, vocab)  # uniform
    batch = build([SamplingParams()] * rows, seeds=list(range(rows)), logits=logits)
    ids = sample(logits, batch).token_ids
    # 400 uniform draws over 1000 tokens: about 330 distinct values expected.
    assert len(set(ids.tolist())) > 280
    # Same seed, many steps also varies.
    batch = build([SamplingParams()] * rows, seeds=[5] * rows, steps=range(rows), logits=logits)
    assert len(set(sample(logits, batch).token_ids.tolist())) > 280
    # Seeds differ -> streams differ across many steps.
    streams = []
    for seed in (3, 4):
        b = build([SamplingParams()] * 100, seeds=[seed] * 100, steps=range(100), vocab_size=vocab)
        streams.append(sample(logits[:100], b).token_ids)
    assert (streams[0] != streams[1]).sum() > 90
    # And the same seed repeats itself exactly.
    b = build([SamplingParams()] * 100, seeds=[3] * 100, steps=range(100), vocab_size=vocab)
    assert torch.equal(sample(logits[:100], b).token_ids, streams[0])


# --------------------------------------------------------------------------- distribution


def _check_frequencies(ids: torch.Tensor, expected: torch.Tensor, max_abs: float) -> None:
    n = ids.numel()
    counts = torch.bincount(ids, minlength=expected.numel()).double()
    # Filtered-out tokens are never drawn.
    assert counts[expected == 0].sum().item() == 0
    freq = counts / n
    assert (freq - expected).abs().max().item() < max_abs, (freq, expected)
    support = expected > 0
    exp_counts = expected[support] * n
    chi2 = ((counts[support] - exp_counts) ** 2 / exp_counts).sum().item()
    dof = int(support.sum()) - 1
    # Wilson-Hilferty approximation of the 0.9999 chi-square quantile.
    z = 3.719
    limit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < limit, (chi2, limit)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [
        (1.0, -1, 1.0, 0.0),
        (0.7, 7, 0.9, 0.05),
        (1.5, 5, 1.0, 0.0),
        (0.8, -1, 0.8, 0.0),
        (1.2, -1, 1.0, 0.12),
    ],
)
def test_empirical_frequencies_over_steps(temperature, top_k, top_p, min_p):
    torch.manual_seed(6)
    vocab, n = 12, 20000
    row = torch.randn(vocab) * 1.2
    expected = reference_distribution(row, temperature, top_k, top_p, min_p)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    logits = row.expand(n, vocab)
    batch = build([params] * n, seeds=[2024] * n, steps=range(n), logits=logits)
    _check_frequencies(sample(logits, batch).token_ids, expected, max_abs=0.015)


def test_empirical_frequencies_over_seeds():
    torch.manual_seed(7)
    vocab, n = 30, 20000
    row = torch.randn(vocab)
    expected = reference_distribution(row, 1.0)
    logits = row.expand(n, vocab)
    batch = build([SamplingParams()] * n, seeds=range(n), steps=[17] * n, logits=logits)
    _check_frequencies(sample(logits, batch).token_ids, expected, max_abs=0.01)


def test_low_temperature_concentrates():
    logits = torch.tensor([[1.0, 1.5, 0.9, 1.4]]).expand(2000, 4)
    batch = build([SamplingParams(temperature=0.05)] * 2000, steps=range(2000), logits=logits)
    ids = sample(logits, batch).token_ids
    # exp(0.1 / 0.05) ~ 7.4: token 1 wins ~88% against token 3.
    assert (ids == 1).float().mean() > 0.8
    assert set(ids.tolist()) <= {1, 3}


# --------------------------------------------------------------------------- mixed / logprobs


def test_mixed_greedy_and_sampled_rows():
    torch.manual_seed(8)
    rows, vocab = 10, 64
    logits = torch.randn(rows, vocab) * 0.3
    params = [
        SamplingParams(temperature=0.0) if r % 2 == 0 else SamplingParams(temperature=1.0)
        for r in range(rows)
    ]
    greedy_rows = torch.arange(0, rows, 2)
    sampled_rows = torch.arange(1, rows, 2)
    argmax = logits.argmax(dim=-1)
    draws = []
    for step in range(30):
        batch = build(params, seeds=list(range(rows)), steps=[step] * rows, logits=logits)
        assert not batch.all_greedy
        ids = sample(logits, batch).token_ids
        assert torch.equal(ids[greedy_rows], argmax[greedy_rows])
        draws.append(ids[sampled_rows])
    draws = torch.stack(draws)  # [steps, sampled rows]
    for col in range(draws.shape[1]):
        assert len(set(draws[:, col].tolist())) > 5  # sampled rows really sample
    assert (draws != argmax[sampled_rows]).any(dim=0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_raw_log_softmax(dtype):
    torch.manual_seed(9)
    rows, vocab = 12, 256
    logits = (torch.randn(rows, vocab) * 2).to(dtype)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.5, top_k=10),
        SamplingParams(temperature=2.0, top_p=0.7),
        SamplingParams(temperature=1.0, min_p=0.1),
    ] * 3
    batch = build(params, seeds=range(rows), steps=range(rows), logits=logits)
    out = sample(logits, batch)
    assert out.logprobs.dtype == torch.float32
    assert out.logprobs.shape == (rows,)
    reference = torch.log_softmax(logits.float(), dim=-1)
    expected = reference.gather(-1, out.token_ids[:, None]).squeeze(-1)
    torch.testing.assert_close(out.logprobs, expected, rtol=1e-5, atol=1e-5)
    # Untempered: differs from the tempered log-softmax on the rows with T != 1.
    tempered = torch.log_softmax(logits.float() / 0.5, dim=-1)[1, out.token_ids[1]]
    assert not torch.isclose(out.logprobs[1], tempered)


def test_rejects_mismatched_rows():
    logits = torch.randn(3, 10)
    with pytest.raises(ValueError):
        sample(logits, build([SamplingParams()] * 2, vocab_size=10))
