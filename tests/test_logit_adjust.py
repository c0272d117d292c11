"""Logit bias and penalties (``engine.logit_adjust``) and prompt logprobs
(``engine.prompt_logprobs``) in the engine, against straightforward
references: a Python loop over fixed logits for the penalties, a greedy
decode that runs the whole sequence through the model at every step, and one
forward over the whole prompt for the prompt logprobs."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from engine.forward_batch import ExtendSpec, build_forward_batch
from engine.llm import LLM
from engine.logit_adjust import TokenCounts
from engine.request import Request
from engine.sampling import SamplingBatch, sample
from protocol.sampling import SamplingParams

VOCAB = 40


def reference_adjust(
    logits: list[float], prompt: list[int], output: list[int], p: SamplingParams
) -> list[float]:
    """One row, the textbook way: repetition penalty on every token seen in
    prompt or output, then OpenAI's frequency and presence penalties on the
    output's counts, then the bias."""
    out = list(logits)
    counts = Counter(output)
    seen = set(prompt) | set(output)
    for v in range(len(out)):
        if v in seen and p.repetition_penalty != 1.0:
            out[v] = out[v] / p.repetition_penalty if out[v] > 0 else out[v] * p.repetition_penalty
        c = counts.get(v, 0)
        out[v] -= c * p.frequency_penalty + (1.0 if c > 0 else 0.0) * p.presence_penalty
    for token, bias in p.logit_bias:
        out[token] += bias
    return out


def _request(rid: str, prompt: list[int], output: list[int], p: SamplingParams) -> Request:
    req = Request(rid, prompt, p, seed=0, max_total_len=1000)
    req.fill_ids = prompt + output
    return req


def _rows(n: int, seed: int) -> list[tuple[list[int], list[int], SamplingParams]]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))]
        output = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 12))]
        kind = i % 4
        p = SamplingParams(
            temperature=0.0,
            presence_penalty=rng.uniform(-2, 2) if kind in (0, 1) else 0.0,
            frequency_penalty=rng.uniform(-2, 2) if kind in (0, 2) else 0.0,
            repetition_penalty=rng.uniform(0.5, 2) if kind in (1, 2) else 1.0,
            logit_bias={rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(kind)},
        )
        rows.append((prompt, output, p))
    return rows


def test_penalties_and_bias_equal_the_reference_on_fixed_logits() -> None:
    rows = _rows(12, seed=1)
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    counts = TokenCounts(VOCAB, "cpu")
    reqs = [_request(f"r{i}", pr, out, p) for i, (pr, out, p) in enumerate(rows)]
    adjust = counts.adjust(reqs)
    assert adjust is not None
    got = adjust.apply(logits)
    for i, (prompt, output, p) in enumerate(rows):
        want = reference_adjust(logits[i].tolist(), prompt, output, p)
        assert got[i].tolist() == pytest.approx(want, abs=1e-4), i
    # The input is left as it was (top logprobs are read from it afterwards).
    assert not torch.equal(got, logits)


def test_counts_follow_the_sampled_tokens() -> None:
    """Greedy rows: each sampled token is counted on the device by the
    sampler, so the next step's penalties include it without the host."""
    rows = _rows(8, seed=2)
    logits0 = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(3)) * 3
    counts = TokenCounts(VOCAB, "cpu")
    reqs = [_request(f"r{i}", pr, out, p) for i, (pr, out, p) in enumerate(rows)]
    outputs = [list(out) for _, out, _ in rows]
    for step in range(6):
        logits = logits0 + step * 0.01
        batch = SamplingBatch.build(
            [r.params for r in reqs], [0] * len(reqs), [step] * len(reqs), VOCAB, "cpu"
        )
        batch = batch._replace(adjust=counts.adjust(reqs))
        tokens = sample(logits, batch).token_ids.tolist()
        for i, (prompt, _, p) in enumerate(rows):
            want = reference_adjust(logits[i].tolist(), prompt, outputs[i], p)
            assert tokens[i] == max(range(VOCAB), key=lambda v: (want[v], -v)), (step, i)
            outputs[i].append(tokens[i])
        # Only the device knows the new tokens: the host's fill_ids stay behind.
    assert counts.in_use == sum(r.params.penalized for r in reqs)


def test_released_rows_are_refilled_for_their_next_owner() -> None:
    counts = TokenCounts(VOCAB, "cpu")
    p = SamplingParams(frequency_penalty=1.0)
    a = _request("a", [1, 2], [5, 5, 5], p)
    assert counts.adjust([a]) is not None
    slot = a.count_slot
    counts.release(a)
    b = _request("b", [3], [7], p)
    adjust = counts.adjust([b])
    assert adjust is not None and b.count_slot == slot
    x = adjust.apply(torch.zeros(1, VOCAB))
    assert x[0, 7].item() == -1.0 and x[0, 5].item() == 0.0
    # Growth keeps the counts of rows in use.
    many = [_request(f"m{i}", [1], [i], p) for i in range(20)]
    adjust = counts.adjust([b, *many])
    assert adjust is not None and counts.capacity >= 21
    x = adjust.apply(torch.zeros(21, VOCAB))
    assert x[0, 7].item() == -1.0
    assert [x[1 + i, i].item() for i in range(20)] == [-1.0] * 20


def test_no_adjustment_no_work() -> None:
    counts = TokenCounts(VOCAB, "cpu")
    plain = [_request(f"r{i}", [1], [], SamplingParams()) for i in range(4)]
    assert counts.adjust(plain) is None
    assert counts.counts is None


def test_logprobs_stay_those_of_the_raw_logits() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(5))
    p = SamplingParams(temperature=0.0, logit_bias={3: 100.0})
    reqs = [_request("a", [1], [], p), _request("b", [1], [], SamplingParams(temperature=0.0))]
    batch = SamplingBatch.build([r.params for r in reqs], [0, 0], [0, 0], VOCAB, "cpu")
    out = sample(logits, batch._replace(adjust=TokenCounts(VOCAB, "cpu").adjust(reqs)))
    assert out.token_ids.tolist()[0] == 3
    raw = logits.log_softmax(-1)
    assert out.logprobs.tolist() == pytest.approx([raw[0, 3].item(), raw[1].max().item()], abs=1e-6)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias=[(1, 1.0), (1, 2.0)]), "logit_bias"),
        (dict(logit_bias={1: float("inf")}), "logit_bias"),
        (dict(presence_penalty=float("nan")), "presence_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(prompt_logprobs=21), "prompt_logprobs"),
        (dict(seed=2**63), "seed"),
    ],
)
def test_invalid_adjustments(kwargs: dict, param: str) -> None:
    from protocol.sampling import InvalidSamplingParams

    with pytest.raises(InvalidSamplingParams) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


# -- through the engine ---------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(model_dir: str) -> LLM:
    return LLM(model_dir, device="cpu", page_size=4, num_pages=256, context_length=256)


def _greedy_reference(llm: LLM, prompt: list[int], p: SamplingParams, n: int) -> list[int]:
    """Greedy decoding that runs the whole sequence through the model at every
    step and applies ``reference_adjust`` to the last logits."""
    runner, ps = llm.engine.runner, llm.engine.config.page_size
    out: list[int] = []
    for _ in range(n):
        ids = prompt + out
        pages = runner.pool.allocator.alloc(-(-len(ids) // ps))
        assert pages is not None
        try:
            fb = build_forward_batch([ExtendSpec(ids, 0, pages, "last")], ps, "cpu")
            logits = runner.forward_logits(fb)[0].float().tolist()
        finally:
            runner.pool.allocator.free(pages)
        row = reference_adjust(logits, prompt, out, p)
        out.append(max(range(len(row)), key=lambda v: (row[v], -v)))
    return out


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(presence_penalty=1.5),
        SamplingParams(frequency_penalty=2.0),
        SamplingParams(repetition_penalty=1.8),
        SamplingParams(frequency_penalty=-2.0, logit_bias={7: 3.0}),
    ],
    ids=["presence", "frequency", "repetition", "negative+bias"],
)
def test_engine_greedy_equals_the_step_by_step_reference(llm: LLM, params: SamplingParams) -> None:
    prompt = llm.tokenizer.encode("the cat sat on the mat and the cat sat on the")
    p = msgspec_replace(params, temperature=0.0, max_tokens=16, ignore_eos=True)
    got = llm.generate([prompt], p)[0].token_ids
    want = _greedy_reference(llm, prompt, p, 16)
    assert got == want
    plain = llm.generate(
        [prompt],
        msgspec_replace(
            p, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, logit_bias=()
        ),
    )
    assert plain[0].token_ids != got, "the penalty changed nothing: the test proves nothing"


def msgspec_replace(p: SamplingParams, **kw: object) -> SamplingParams:
    import msgspec

    return msgspec.structs.replace(p, **kw)


def test_logit_bias_forces_and_bans_in_the_engine(llm: LLM) -> None:
    prompt = llm.tokenizer.encode("Once upon a time")
    forced = llm.generate(
        [prompt] * 3,
        [
            SamplingParams(max_tokens=10, seed=s, logit_bias={77: 100}, ignore_eos=True)
            for s in range(3)
        ],
    )
    assert all(o.token_ids == [77] * 10 for o in forced)
    free = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    banned = Counter(free.token_ids).most_common(1)[0][0]
    out = llm.generate(
        [prompt] * 4,
        [
            SamplingParams(
                max_tokens=24, temperature=0.8, seed=s, ignore_eos=True, logit_bias={banned: -100}
            )
            for s in range(4)
        ],
    )
    assert all(banned not in o.token_ids for o in out)


def _direct_prompt_logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, V] log-softmax of one forward over the whole prompt: row
    ``i`` is the distribution of token ``i + 1``."""
    runner, ps = llm.engine.runner, llm.engine.config.page_size
    pages = runner.pool.allocator.alloc(-(-len(ids) // ps))
    assert pages is not None
    try:
        fb = build_forward_batch([ExtendSpec(ids, 0, pages, "all")], ps, "cpu")
        return runner.forward_logits(fb).float().log_softmax(-1)[:-1]
    finally:
        runner.pool.allocator.free(pages)


@pytest.mark.parametrize("overlap", [False, True])
def test_prompt_logprobs_across_chunks_equal_one_forward(
    model_dir: str, llm: LLM, overlap: bool
) -> None:
    """Chunks of 8 (and 5 requests at once, one of them again after its
    prefix is cached) give the logprobs of one forward over each prompt."""
    chunked = LLM(
        model_dir,
        device="cpu",
        page_size=4,
        num_pages=256,
        context_length=256,
        chunk_size=8,
        max_num_batched_tokens=16,
        overlap=overlap,
    )
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 2, 9, 37, 61)]
    prompts.append(prompts[-1])  # cached now: must still be scored
    params = [
        SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=k) for k in (0, 1, 2, 5, 0, 3)
    ]
    outs = chunked.generate(prompts, params)
    for ids, p, o in zip(prompts, params, outs):
        assert o.prompt_logprobs is not None and o.prompt_top_logprobs is not None
        assert len(o.prompt_logprobs) == len(ids) and o.prompt_logprobs[0] is None
        ref = _direct_prompt_logprobs(llm, ids)
        want = [ref[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
        assert o.prompt_logprobs[1:] == pytest.approx(want, abs=1e-4)
        for i, top in enumerate(o.prompt_top_logprobs[1:]):
            assert top is not None and len(top) == p.prompt_logprobs
            values = ref[i].topk(p.prompt_logprobs or 1).values.tolist()
            assert [lp for _, lp in top] == pytest.approx(values[: len(top)], abs=1e-4)
        assert (
            o.token_ids
            == llm.generate([ids], msgspec_replace(p, prompt_logprobs=None))[0].token_ids
        )
    assert chunked.engine.scheduler.num_free_pages == chunked.engine.runner.pool.allocator.capacity


@pytest.mark.gpu
def test_cuda_sampler_takes_the_adjustments() -> None:
    """On CUDA (the Triton sampler) the adjusted logits and the device counts
    are those of the CPU: greedy rows draw the same tokens step after step
    (each step's penalties include the tokens the device counted), sampled
    rows (same noise) nearly all the same."""
    vocab = 5000
    rows = _rows(16, seed=9)
    rows += [(pr, out, msgspec_replace(p, temperature=0.9)) for pr, out, p in _rows(16, seed=10)]
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(1)) * 2
    tokens: dict[str, list[list[int]]] = {}
    cells: dict[str, torch.Tensor] = {}
    for device in ("cpu", "cuda"):
        counts = TokenCounts(vocab, device)
        reqs = [_request(f"r{i}", pr, out, p) for i, (pr, out, p) in enumerate(rows)]
        tokens[device] = []
        for step in range(4):
            batch = SamplingBatch.build(
                [r.params for r in reqs], list(range(len(reqs))), [step] * len(reqs), vocab, device
            )
            batch = batch._replace(adjust=counts.adjust(reqs))
            tokens[device].append(sample(logits.to(device), batch).token_ids.tolist())
        assert counts.counts is not None
        cells[device] = counts.counts[[r.count_slot for r in reqs if r.count_slot >= 0]].cpu()
    greedy = [i for i, (_, _, p) in enumerate(rows) if p.temperature == 0]
    for step in range(4):
        assert [tokens["cuda"][step][i] for i in greedy] == [tokens["cpu"][step][i] for i in greedy]
    same = sum(a == b for s in range(4) for a, b in zip(tokens["cuda"][s], tokens["cpu"][s]))
    assert same >= 0.9 * 4 * len(rows)
    if same == 4 * len(rows):
        assert torch.equal(cells["cuda"], cells["cpu"])


def test_a_request_with_a_token_scores_no_prompt() -> None:
    """A decode worker's copy of a request prefilled elsewhere (its first
    token came with the KV), or one retracted after its first token, does not
    score its prompt again: it may start from a cached prefix and takes the
    logits of its last token only."""
    from engine.prompt_logprobs import SCORE_CHUNK, chunk_limit, logits_mode

    p = SamplingParams(prompt_logprobs=1)
    fresh = _request("a", [1, 2, 3], [], p)
    assert fresh.scores_prompt and chunk_limit(fresh) == SCORE_CHUNK
    assert logits_mode(fresh, 0, last=False) == "all"
    prefilled = _request("b", [1, 2, 3], [9], p)
    assert not prefilled.scores_prompt and chunk_limit(prefilled) > SCORE_CHUNK
    assert logits_mode(prefilled, 0, last=False) == "none"
    assert logits_mode(prefilled, 3, last=True) == "last"
