"""Grammar-constrained decoding in the engine (xgrammar): the bitmask on the
logits against xgrammar's own, outputs of the random-weight tiny model that
follow their grammar, the same tokens with and without the overlap loop, and
requests without grammars untouched."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from engine.grammar import GrammarError, GrammarStep, apply_token_bitmask
from engine.llm import LLM
from protocol.sampling import GrammarSpec, InvalidSamplingParams, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "pet": {
            "type": "object",
            "properties": {
                "kind": {"enum": ["cat", "dog"]},
                "legs": {"type": "integer", "maximum": 8},
            },
            "required": ["kind"],
        },
    },
    "required": ["name", "age", "tags", "pet"],
}


def json_schema(schema: object) -> GrammarSpec:
    return GrammarSpec("json_schema", json.dumps(schema))


@pytest.fixture(scope="module")
def llm(model_dir: str) -> LLM:
    return LLM(model_dir, page_size=4, overlap=True)


def assert_pool_back(llm: LLM) -> None:
    sched = llm.engine.scheduler
    alloc = llm.engine.runner.pool.allocator
    assert not sched.running and not sched.waiting
    cached = sched.cache.cached_pages if sched.cache is not None else 0
    assert alloc.num_free + cached == alloc.capacity
    assert sched.cache is None or sched.cache.locked_pages == 0


def run_without_overlap(llm: LLM, prompt: list[int], params: SamplingParams) -> list[int]:
    llm.engine.add_request("alone", prompt, params)
    tokens = []
    while llm.engine.has_unfinished():
        tokens += [r.token_id for r in llm.engine.step()]
    return tokens


def test_bitmask_matches_xgrammar() -> None:
    xgr = pytest.importorskip("xgrammar")
    g = torch.Generator().manual_seed(0)
    vocab = 1000  # not a multiple of 32
    logits = torch.randn(5, vocab, generator=g)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, -(-vocab // 32)), generator=g).int()
    rows = [0, 2, 4]
    ours = logits.clone()
    apply_token_bitmask(ours, bitmask, torch.tensor(rows))
    ref = logits.clone()
    # xgrammar's bitmask has a row per logits row.
    full = torch.full((5, bitmask.shape[1]), -1, dtype=torch.int32)
    full[rows] = bitmask
    xgr.apply_token_bitmask_inplace(ref, full, indices=rows, vocab_size=vocab)
    assert torch.equal(torch.isinf(ref), ours == torch.finfo(ours.dtype).min)
    kept = ~torch.isinf(ref)
    assert torch.equal(ours[kept], logits[kept])
    assert torch.equal(ours[[1, 3]], logits[[1, 3]])


def test_json_schema_outputs_validate_and_overlap_matches(llm: LLM) -> None:
    spec = json_schema(SCHEMA)
    params = [
        SamplingParams(max_tokens=80, temperature=1.0, seed=s, grammar=spec) for s in range(8)
    ]
    prompts = [[5 + s, 40, 77, 9] for s in range(8)]
    outs = llm.generate(prompts, params)
    tok = llm.tokenizer
    for o in outs:
        assert o.finish_reason == "stop", tok.decode(o.token_ids)
        assert o.token_ids[-1] in llm.engine.model_config.eos_token_ids
        doc = json.loads(tok.decode(o.token_ids[:-1]))
        jsonschema.validate(doc, SCHEMA)
    assert len({tuple(o.token_ids) for o in outs}) > 1
    # The same draws without the overlap loop, and one request at a time.
    alone = [run_without_overlap(llm, p, sp) for p, sp in zip(prompts[:3], params[:3])]
    assert alone == [o.token_ids for o in outs[:3]]
    assert_pool_back(llm)


def test_other_kinds(llm: LLM) -> None:
    tok = llm.tokenizer
    cases = {
        GrammarSpec("json_object"): lambda s: isinstance(json.loads(s), dict),
        GrammarSpec("regex", r"(yes|no), [0-9]{2}"): lambda s: re.fullmatch(
            r"(yes|no), [0-9]{2}", s
        ),
        GrammarSpec("choice", json.dumps(["red", "green", 'a "blue"'])): lambda s: (
            s in ("red", "green", 'a "blue"')
        ),
        GrammarSpec("ebnf", 'root ::= "x" [0-9] [0-9] "!"'): lambda s: re.fullmatch(
            r"x[0-9]{2}!", s
        ),
    }
    for spec, check in cases.items():
        params = [
            SamplingParams(max_tokens=60, temperature=0.8, seed=s, grammar=spec) for s in range(3)
        ]
        for o in llm.generate([[7, 8, 9]] * 3, params):
            text = tok.decode(o.token_ids[:-1])
            # json_object may run out of tokens with a random model; the
            # others are short.
            if spec.kind != "json_object" or o.finish_reason == "stop":
                assert o.finish_reason == "stop" and check(text), (spec.kind, text)
    assert_pool_back(llm)


def test_grammar_and_plain_requests_in_one_batch(llm: LLM) -> None:
    plain = SamplingParams(max_tokens=12, temperature=0.7, seed=3)
    alone = llm.generate([[11, 12, 13]], plain)[0]
    spec = GrammarSpec("choice", json.dumps(["on", "off"]))
    mixed = llm.generate(
        [[11, 12, 13], [4, 5], [11, 12, 13]],
        [plain, SamplingParams(max_tokens=8, grammar=spec, seed=1), plain],
    )
    # Rows without a grammar draw exactly what they draw alone.
    assert mixed[0].token_ids == alone.token_ids == mixed[2].token_ids
    assert llm.tokenizer.decode(mixed[1].token_ids[:-1]) in ("on", "off")
    assert_pool_back(llm)


def test_no_grammar_work_without_grammar_requests(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, grammar=GrammarSpec("json_object")))

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("grammar work in a batch without grammars")

    monkeypatch.setattr(GrammarStep, "for_batch", forbidden)
    outs = llm.generate([[1, 2, 3], [4]], SamplingParams(max_tokens=6, seed=0))
    assert all(len(o.token_ids) == 6 for o in outs)
    assert not llm.engine._grammar_rids


def test_invalid_grammars_are_request_errors(llm: LLM) -> None:
    bad = [
        GrammarSpec("json_schema", "{not json"),
        GrammarSpec("json_schema", '{"type": "nope"}'),
        GrammarSpec("regex", "(unclosed"),
        GrammarSpec("ebnf", "root ::= undefined_rule"),
        GrammarSpec("choice", "[]"),
    ]
    for spec in bad:
        with pytest.raises(GrammarError) as e:
            llm.engine.add_request("bad", [1, 2], SamplingParams(grammar=spec))
        assert e.value.param == "grammar"
        assert spec.kind in str(e.value)
    assert not llm.engine.has_unfinished()
    with pytest.raises(InvalidSamplingParams, match="kind"):
        SamplingParams(grammar=GrammarSpec("yaml", ""))
    with pytest.raises(InvalidSamplingParams, match="ignore_eos"):
        SamplingParams(grammar=GrammarSpec("json_object"), ignore_eos=True)


def test_compiled_once(llm: LLM) -> None:
    backend = llm.engine.grammar_backend()
    spec = json_schema({"type": "object", "properties": {"k": {"enum": [1, 2]}}})
    first = backend.compile(spec)
    assert backend.compile(GrammarSpec(spec.kind, spec.spec)) is first


def test_replayed_first_token(llm: LLM) -> None:
    """A decode engine gets the first token with the KV, not from its own
    sampler: its matcher replays it before the first decode step, and the rest
    of the output is what one engine alone would have produced."""
    spec = json_schema(SCHEMA)
    params = SamplingParams(max_tokens=80, seed=11, grammar=spec)
    whole = llm.generate([[3, 4, 5]], params)[0]
    engine = llm.engine
    req = engine.build_request("replay", [3, 4, 5], params)
    req.fill_ids.append(whole.token_ids[0])  # as DecodeLoop._on_done does
    engine.scheduler.add(req)
    tokens = [whole.token_ids[0]]
    inflight = None
    while engine.has_unfinished() or inflight is not None:
        inflight, results = engine.overlap_step(inflight)
        tokens += [r.token_id for r in results]
    assert tokens == whole.token_ids
    assert_pool_back(llm)


@pytest.mark.gpu
def test_bitmask_on_cuda_matches_cpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(1)
    vocab = 128_256
    logits = torch.randn(64, vocab, generator=g)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (32, -(-vocab // 32)), generator=g).int()
    rows = torch.arange(0, 64, 2)
    cpu = logits.clone()
    apply_token_bitmask(cpu, bitmask, rows)
    for dtype in (torch.float32, torch.bfloat16):
        gpu = logits.to("cuda", dtype)
        apply_token_bitmask(gpu, bitmask.cuda(), rows.cuda())
        masked = gpu.cpu() == torch.finfo(dtype).min
        assert torch.equal(masked, cpu == torch.finfo(torch.float32).min)
