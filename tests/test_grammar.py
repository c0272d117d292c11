"""Grammar-constrained decoding in the engine (xgrammar): the bitmask on the
logits against xgrammar's own, outputs of the random-weight tiny model that
follow their grammar, the same tokens with and without the overlap loop,
requests without grammars untouched, and the batched mask (one xgrammar call
for the batch's tokens, one for its bitmask, one kernel on the logits) against
one matcher call per row and token with the mask applied bit by bit."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch

from engine.grammar import (
    GrammarError,
    GrammarStep,
    MaskBuffer,
    apply_packed_bitmask,
    apply_token_bitmask,
)
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
    return LLM(model_dir, page_size=4, overlap=True, kv_cache_memory_gb=0.25)


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


def allowed_bits(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[R, vocab]`` bool of the tokens a bitmask allows (bytes unpacked
    little-end first: bit ``t % 32`` of word ``t // 32`` on a little-endian host)."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
    return torch.from_numpy(bits[:, :vocab].astype(bool))


def serial_mask(step: GrammarStep, logits: torch.Tensor) -> None:
    """The mask of ``step`` with one matcher call per row and token, applied
    row by row (the reference for the batched ``GrammarStep.__call__``)."""
    tokens: list[int] = []
    if any(i is not None for i in step.in_flight):
        assert step.in_flight_out is not None
        tokens = step.in_flight_out.to_host().token_ids
    vocab = logits.shape[-1]
    bitmask = torch.full((len(step.rows), -(-vocab // 32)), -1, dtype=torch.int32)
    for k, (req, src) in enumerate(zip(step.requests, step.in_flight)):
        grammar = req.grammar
        assert grammar is not None
        out = req.output_ids
        while grammar.num_accepted < req.num_output + req.pending - 1:
            i = grammar.num_accepted
            grammar.matcher.accept_token(out[i] if i < len(out) else tokens[src])
            grammar.num_accepted += 1
        if not grammar.matcher.is_terminated():
            grammar.matcher.fill_next_token_bitmask(bitmask, k)
    allowed = allowed_bits(bitmask, vocab)
    for k, row in enumerate(step.rows):
        logits[row, ~allowed[k].to(logits.device)] = torch.finfo(logits.dtype).min


def test_batched_step_matches_serial_reference(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mixed batches under the overlap loop (in-flight tokens) and one step at
    a time: the same tokens and logprobs as the per-row reference."""
    specs = [
        json_schema(SCHEMA),
        GrammarSpec("regex", r"(yes|no), [0-9]{2}"),
        GrammarSpec("choice", json.dumps(["red", "green"])),
        None,
        GrammarSpec("json_object"),
    ]
    prompts = [[3 + s, 8, 21] for s in range(10)]
    params = [
        SamplingParams(
            max_tokens=40,
            temperature=[0.0, 1.0, 0.7][s % 3],
            seed=s,
            grammar=specs[s % 5],
            ignore_eos=specs[s % 5] is None,
        )
        for s in range(10)
    ]
    batched = llm.generate(prompts, params)
    alone = run_without_overlap(llm, prompts[0], params[0])
    monkeypatch.setattr(GrammarStep, "__call__", serial_mask)
    serial = llm.generate(prompts, params)
    assert [o.token_ids for o in batched] == [o.token_ids for o in serial]
    assert [o.logprobs for o in batched] == [o.logprobs for o in serial]
    assert alone == serial[0].token_ids
    assert any(o.finish_reason == "stop" for o in batched)
    assert_pool_back(llm)


def test_batched_accept_replays_like_serial(llm: LLM) -> None:
    """Matchers owed different numbers of tokens (a replay, a recompute after
    a retraction) end where token-by-token acceptance leaves them, and so do
    their masks; a token that does not fit is counted and skipped."""
    spec = json_schema(SCHEMA)
    out = llm.generate([[9, 9, 2]], SamplingParams(max_tokens=60, seed=4, grammar=spec))[0]
    toks = out.token_ids[:-1]
    backend = llm.engine.grammar_backend()
    owed = [toks[:0], toks[:1], toks[:3], toks[:9], toks[:5] + [-1 % backend.vocab_size]]
    fast = [backend.request_grammar(spec) for _ in owed]
    slow = [backend.request_grammar(spec) for _ in owed]
    backend.accept(fast, owed)
    for g, t in zip(slow, owed):
        for tok in t:
            g.accepted(g.matcher.accept_token(tok), tok)
    assert [g.num_accepted for g in fast] == [len(t) for t in owed]
    assert [g.rejected for g in fast] == [False] * 4 + [True]
    words = -(-backend.vocab_size // 32)
    mine = torch.zeros(len(owed), words, dtype=torch.int32)
    backend.fill(fast, mine)
    ref = torch.full_like(mine, -1)
    for k, g in enumerate(slow):
        g.matcher.fill_next_token_bitmask(ref, k)
    assert torch.equal(mine, ref)


def packed_case(
    rows: list[int], vocab: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(max(rows) + 2, vocab, generator=g)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), -(-vocab // 32)), generator=g).int()
    packed = torch.cat([torch.tensor(rows, dtype=torch.int32), bitmask.flatten()])
    return logits, bitmask, packed


def test_packed_mask_matches_xgrammar() -> None:
    xgr = pytest.importorskip("xgrammar")
    rows = [4, 0, 2]
    vocab = 1000
    logits, bitmask, packed = packed_case(rows, vocab, 2)
    for dtype in (torch.float32, torch.bfloat16):
        ours = logits.clone().to(dtype)
        apply_packed_bitmask(ours, packed, len(rows))
        ref = logits.clone()
        full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)
        full[rows] = bitmask
        xgr.apply_token_bitmask_inplace(ref, full, indices=rows, vocab_size=vocab)
        assert torch.equal(torch.isinf(ref), ours == torch.finfo(dtype).min)
        kept = ~torch.isinf(ref)
        assert torch.equal(ours[kept], logits.to(dtype)[kept])


def test_mask_kernel_interpreted() -> None:
    """The Triton kernel run by Triton's interpreter on the CPU: the same
    logits as the tensor ops, in float32 and bfloat16."""
    pytest.importorskip("triton")
    code = """
import torch
from engine.grammar import apply_token_bitmask
from engine.grammar_triton import apply_packed_bitmask
from tests.test_grammar import packed_case
rows = [5, 1, 3]
for dtype in (torch.float32, torch.bfloat16):
    logits, bitmask, packed = packed_case(rows, 5003, 3)
    logits = logits.to(dtype)
    ref = logits.clone()
    apply_token_bitmask(ref, bitmask, torch.tensor(rows))
    ours = logits.clone()
    apply_packed_bitmask(ours, packed, len(rows))
    assert torch.equal(ours, ref), dtype
    assert (ours == torch.finfo(dtype).min).any()
print("ok")
"""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


def test_mask_buffer_alternates_and_grows() -> None:
    buf = MaskBuffer(words=3)
    slot_a, a = buf.take(2, pinned=False)
    slot_b, b = buf.take(4, pinned=False)
    assert slot_a != slot_b and a.numel() == 8 and b.numel() == 16
    a.fill_(7)
    b.fill_(9)
    slot_c, c = buf.take(5, pinned=False)
    assert slot_c == slot_a and c.numel() == 20
    assert torch.equal(b, torch.full((16,), 9, dtype=torch.int32))


@pytest.mark.gpu
def test_packed_mask_on_cuda_matches_cpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for rows, dtype in [
        (list(range(0, 64, 2)), torch.float32),
        (list(range(0, 64, 2)), torch.bfloat16),
        ([7], torch.float32),
        ([3, 0, 5, 9, 1], torch.float32),
    ]:
        logits, _, packed = packed_case(rows, 128_256, len(rows))
        cpu = logits.clone()
        apply_packed_bitmask(cpu, packed, len(rows))
        gpu = logits.to("cuda", dtype)
        buf = MaskBuffer(words=-(-128_256 // 32))
        slot, host = buf.take(len(rows), pinned=True)
        host.copy_(packed)
        apply_packed_bitmask(gpu, buf.to_device(slot, host, gpu.device), len(rows))
        masked = gpu.cpu() == torch.finfo(dtype).min
        assert torch.equal(masked, cpu == torch.finfo(torch.float32).min)
        kept = ~masked
        assert torch.equal(gpu.cpu()[kept], logits.to(dtype)[kept])


@pytest.mark.gpu
def test_batched_step_on_cuda_matches_serial_reference(
    model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the GPU (pinned buffers, the copy's own stream, the Triton kernel,
    the overlap loop): valid outputs, and the tokens of the per-row reference."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    llm = LLM(
        model_dir,
        device="cuda:0",
        dtype="float32",
        page_size=16,
        overlap=True,
        kv_cache_memory_gb=0.25,
    )
    spec = json_schema(SCHEMA)
    params = [
        SamplingParams(max_tokens=80, temperature=1.0, seed=s, grammar=spec if s % 4 else None)
        for s in range(12)
    ]
    prompts = [[5 + s, 40, 77, 9] for s in range(12)]
    batched = llm.generate(prompts, params)
    for o, p in zip(batched, params):
        if p.grammar is not None and o.finish_reason == "stop":
            jsonschema.validate(json.loads(llm.tokenizer.decode(o.token_ids[:-1])), SCHEMA)
    assert any(o.finish_reason == "stop" for o, p in zip(batched, params) if p.grammar)
    monkeypatch.setattr(GrammarStep, "__call__", serial_mask)
    serial = llm.generate(prompts, params)
    assert [o.token_ids for o in batched] == [o.token_ids for o in serial]


def test_the_backend_marks_each_step_of_its_making(model_dir: str) -> None:
    """``for_model``'s ``mark`` hears each step's end in order (the engine's
    start times them on CUDA), and a model without tokenizer files marks
    the imports only before it says so."""
    from engine.grammar import GrammarBackend, GrammarError

    steps: list[str] = []
    backend = GrammarBackend.for_model(model_dir, 1000, [0], mark=steps.append)
    assert backend.vocab_size == 1000
    assert steps == ["grammar imports", "tokenizer", "tokenizer vocabulary", "grammar compiler"]
    steps.clear()
    with pytest.raises(GrammarError, match="tokenizer files"):
        GrammarBackend.for_model("/nonexistent-model-dir", 1000, [0], mark=steps.append)
    assert steps == ["grammar imports"]


@pytest.mark.parametrize(
    "tokenizer_class", ["PreTrainedTokenizerFast", "Qwen2Tokenizer", "GPT2Tokenizer"]
)
def test_the_backend_reads_the_vocabulary_autotokenizer_gives(
    model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tokenizer_class: str
) -> None:
    """``load_tokenizer`` reads tokenizer.json with the fast tokenizer's base
    class, whatever class tokenizer_config.json names: xgrammar then sees
    the same vocabulary, vocabulary type, prefix space and special tokens as
    through ``AutoTokenizer``, which the backend never calls where
    tokenizer.json is present."""
    import shutil

    import transformers
    import xgrammar as xgr

    from engine.grammar import GrammarBackend, load_tokenizer

    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(
        json.dumps({**config, "tokenizer_class": tokenizer_class})
    )

    def info(tokenizer: object) -> tuple:
        i = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=600, stop_token_ids=[2])
        return i.vocab_type, i.add_prefix_space, i.decoded_vocab, i.special_token_ids

    expected = info(transformers.AutoTokenizer.from_pretrained(str(model)))
    assert info(load_tokenizer(str(model))) == expected

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("AutoTokenizer called")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    backend = GrammarBackend.for_model(str(model), 600, [2])
    got = backend.info
    assert (got.vocab_type, got.add_prefix_space, got.decoded_vocab) == expected[:3]


def test_without_tokenizer_json_autotokenizer_picks_the_class(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model without tokenizer.json (SentencePiece or tiktoken files) is
    loaded by ``AutoTokenizer``, which picks its class."""
    import transformers

    from engine.grammar import load_tokenizer

    seen: list[str] = []
    monkeypatch.setattr(
        transformers.AutoTokenizer, "from_pretrained", lambda path: seen.append(path) or "tok"
    )
    assert load_tokenizer(str(tmp_path)) == "tok"
    assert seen == [str(tmp_path)]


def test_an_engine_of_a_preset_finds_its_tokenizer(
    model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine given a preset's name (random weights) serves grammar
    requests from the tokenizer of the preset's dummy directory: its config
    names that directory, not the name, which the tokenizer would look up on
    the Hub."""
    from engine import presets
    from engine.config import EngineConfig
    from engine.engine import Engine

    preset = json.loads((Path(model_dir) / "config.json").read_text())
    monkeypatch.setitem(presets.PRESETS, "tiny-preset", preset)
    monkeypatch.setenv("DISAGG_CACHE_DIR", str(tmp_path))
    engine = Engine(
        EngineConfig(
            model="tiny-preset", load_format="dummy", device="cpu", page_size=4, num_pages=64
        )
    )
    try:
        assert Path(engine.config.model).is_relative_to(tmp_path)
        assert (Path(engine.config.model) / "tokenizer.json").is_file()
        backend = engine.grammar_backend()
        assert backend.vocab_size == engine.model_config.vocab_size
    finally:
        engine.close()
