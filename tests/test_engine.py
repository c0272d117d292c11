"""End-to-end engine behaviour: generation vs HF, prefix cache, pool pressure, errors."""

from __future__ import annotations

import json
import random
import shutil

import msgspec
import pytest
import torch

from engine.llm import LLM
from engine.model_config import ModelConfig, ModelConfigError
from engine.request import EngineRequestError
from engine.weights import WeightLoadError
from protocol.sampling import InvalidSamplingParams, SamplingParams

VOCAB = 320


def prompts_of(
    lengths: list[int], seed: int = 0, prefix: list[int] | None = None
) -> list[list[int]]:
    g = random.Random(seed)
    return [(prefix or []) + [g.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def assert_no_leak(llm: LLM) -> None:
    sched = llm.engine.scheduler
    alloc = llm.engine.runner.pool.allocator
    assert not sched.running and not sched.waiting
    cached = sched.cache.cached_pages if sched.cache is not None else 0
    assert alloc.num_free + cached == alloc.capacity
    if sched.cache is not None:
        assert sched.cache.locked_pages == 0
        sched.cache.reset()
    assert alloc.num_free == alloc.capacity


def hf_greedy(hf: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


GREEDY32 = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize(
    "variant",
    ["llama-gqa4-tied", "qwen2-gqa2", "qwen3-gqa4", "qwen3moe-e8k2-norm", "qwen2moe-shared"],
)
def test_greedy_matches_hf_generate(hf_checkpoint, variant: str, page_size: int) -> None:
    path, hf = hf_checkpoint(variant)
    # A small token budget forces chunked prefill mixed with decode steps.
    llm = LLM(
        str(path),
        device="cpu",
        page_size=page_size,
        num_pages=512,
        max_num_batched_tokens=24,
        chunk_size=7,
    )
    prompts = prompts_of([3, 11, 30, 17, 1])
    outs = llm.generate(prompts, GREEDY32)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, 32)
        assert o.finish_reason == "length"
    assert_no_leak(llm)


def test_prefix_cache_hit_equals_cold_run(hf_checkpoint) -> None:
    path, _ = hf_checkpoint("llama-mha-llama3rope")
    shared = prompts_of([40], seed=7)[0]
    prompts = prompts_of([5, 9, 1, 14], seed=8, prefix=shared)
    cold = LLM(str(path), device="cpu", page_size=4, num_pages=256, enable_prefix_cache=False)
    expected = cold.generate(prompts, GREEDY32)
    assert all(o.num_cached_tokens == 0 for o in expected)
    assert_no_leak(cold)

    warm = LLM(str(path), device="cpu", page_size=4, num_pages=256)
    first = warm.generate(prompts[:1], GREEDY32)
    again = warm.generate(prompts, GREEDY32)
    assert first[0].token_ids == expected[0].token_ids
    assert [o.token_ids for o in again] == [o.token_ids for o in expected]
    # The whole shared prefix (40 tokens = 10 pages) is reused by every request.
    assert all(o.num_cached_tokens >= 40 for o in again)
    stats = warm.engine.scheduler.cache.stats()
    assert stats.hit_tokens >= 4 * 40
    assert_no_leak(warm)


@pytest.mark.parametrize("overlap", [True, False])
def test_pool_pressure_retracts_and_stays_correct(hf_checkpoint, overlap: bool) -> None:
    path, _ = hf_checkpoint("qwen3-gqa2-tied")
    prompts = prompts_of([20, 25, 12, 30, 8, 16, 22, 27], seed=9)
    roomy = LLM(str(path), device="cpu", page_size=4, num_pages=512, overlap=False)
    expected = [o.token_ids for o in roomy.generate(prompts, GREEDY32)]
    # Each request needs up to 16 pages; 40 pages cannot hold all 8 at once.
    tight = LLM(str(path), device="cpu", page_size=4, num_pages=41, overlap=overlap)
    got = tight.generate(prompts, GREEDY32)
    assert [o.token_ids for o in got] == expected
    assert tight.engine.scheduler.num_retracted > 0
    assert_no_leak(tight)


def test_seeded_sampling_is_reproducible_across_batches(hf_checkpoint) -> None:
    path, _ = hf_checkpoint("qwen2-gqa2")
    llm = LLM(str(path), device="cpu", page_size=1, num_pages=1024)
    prompts = prompts_of([6, 13, 9], seed=11)
    sp = SamplingParams(
        max_tokens=16, temperature=1.3, top_p=0.95, top_k=50, seed=1234, ignore_eos=True
    )
    alone = llm.generate(prompts[1:2], sp)[0].token_ids
    together = llm.generate(prompts, sp)[1].token_ids
    assert alone == together
    other_seed = llm.generate(prompts[1:2], msgspec.structs.replace(sp, seed=99))[0]
    assert other_seed.token_ids != alone
    t0 = llm.generate(
        prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, seed=5)
    )
    greedy = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in t0] == [o.token_ids for o in greedy]
    assert_no_leak(llm)


def test_stop_conditions(hf_checkpoint) -> None:
    path, _ = hf_checkpoint("llama-gqa4-tied")
    llm = LLM(str(path), device="cpu", page_size=2, num_pages=256)
    p = prompts_of([10], seed=12)[0]
    full = llm.generate([p], GREEDY32)[0].token_ids
    stop_tok = full[5]
    first = full.index(stop_tok)
    out = llm.generate(
        [p], SamplingParams(max_tokens=32, temperature=0, stop_token_ids=[stop_tok])
    )[0]
    assert out.token_ids == full[: first + 1] and out.finish_reason == "stop"
    # The model's EOS ends generation unless ignore_eos.
    eos_llm = LLM(str(path), device="cpu", page_size=2, num_pages=256)
    object.__setattr__(eos_llm.engine.model_config, "eos_token_ids", (stop_tok,))
    out = eos_llm.generate([p], SamplingParams(max_tokens=32, temperature=0))[0]
    assert out.token_ids == full[: first + 1] and out.finish_reason == "stop"
    out = llm.generate([p], SamplingParams(max_tokens=7, temperature=0))[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    # The context window caps generation too.
    short = LLM(str(path), device="cpu", page_size=2, num_pages=256, context_length=14)
    out = short.generate([p], GREEDY32)[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
    for x in (llm, eos_llm, short):
        assert_no_leak(x)


def test_request_errors(hf_checkpoint) -> None:
    path, _ = hf_checkpoint("llama-gqa4-tied")
    llm = LLM(str(path), device="cpu", page_size=4, num_pages=12, context_length=64)
    with pytest.raises(EngineRequestError, match="empty"):
        llm.generate([[]])
    with pytest.raises(EngineRequestError, match="KV pool holds at most 44 tokens"):
        llm.generate([[5] * 64])
    with pytest.raises(EngineRequestError, match="outside the vocabulary"):
        llm.generate([[5, VOCAB + 3]])
    # 11 usable pages of 4 tokens: the pool, not the context (64), is the limit.
    assert llm.engine.max_model_len == 44
    with pytest.raises(EngineRequestError, match="KV pool holds"):
        llm.generate([[5] * 50], SamplingParams(max_tokens=13))
    # A prompt that fits has its output cut where the pool would run out.
    out = llm.generate([[5] * 40], SamplingParams(max_tokens=13, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
    assert_no_leak(llm)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-5), "top_k"),
        (dict(min_p=2.0), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(seed=2**63), "seed"),
        (dict(temperature=float("nan")), "temperature"),
    ],
)
def test_invalid_sampling_params(kwargs: dict, param: str) -> None:
    with pytest.raises(InvalidSamplingParams) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


def test_unknown_architecture(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(
        ModelConfigError, match="LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"
    ):
        LLM(str(tmp_path))
    with pytest.raises(ModelConfigError, match="no config.json"):
        ModelConfig.load(tmp_path / "absent")


def test_missing_and_mismatched_weights(hf_checkpoint, tmp_path) -> None:
    src, _ = hf_checkpoint("qwen2-gqa2", shard=True)
    d = tmp_path / "ckpt"
    shutil.copytree(src, d)
    # A shard named by the index is gone.
    victim = sorted(d.glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(WeightLoadError, match=victim.name):
        LLM(str(d))
    # No weight files at all.
    for f in d.glob("*.safetensors*"):
        f.unlink()
    with pytest.raises(WeightLoadError, match="no \\*.safetensors"):
        LLM(str(d))
    # Weights of another shape.
    src2, _ = hf_checkpoint("llama-gqa4-tied")
    d2 = tmp_path / "mismatch"
    shutil.copytree(src2, d2)
    cfg = json.loads((d2 / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (d2 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightLoadError, match="has shape"):
        LLM(str(d2))
    # A weight the model lacks entirely.
    cfg["intermediate_size"] = 128
    cfg["num_hidden_layers"] = 3
    (d2 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightLoadError, match="lacks"):
        LLM(str(d2))


def test_overlap_launches_next_step_before_reading_the_last(hf_checkpoint) -> None:
    path, _ = hf_checkpoint("llama-gqa4-tied")
    llm = LLM(str(path), device="cpu", page_size=4, num_pages=64)
    eng = llm.engine
    prompt = prompts_of([9], seed=13)[0]
    eng.add_request("a", prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    first, res = eng.overlap_step(None)
    assert first is not None and res == []  # launched, nothing read back yet
    second, res = eng.overlap_step(first)
    assert [r.token_id for r in res] == first.out.token_ids.tolist()
    # Step 2 was built before step 1's token reached the host; its input was
    # filled in from step 1's output on the device.
    assert second is not None and second.batch.future_rows == [0]
    assert second.batch.forward.input_ids[0].item() == res[0].token_id
    assert second.batch.forward.positions[0].item() == len(prompt)
    third, res2 = eng.overlap_step(second)
    # max_tokens is 3: the third token is in flight, so nothing more is launched.
    assert third is not None
    fourth, res3 = eng.overlap_step(third)
    assert fourth is None and res3[-1].finish_reason == "length"
    assert len(res) + len(res2) + len(res3) == 3
    assert_no_leak(llm)


def test_a_start_logs_where_its_time_went(model_dir, caplog) -> None:
    """One line once the engine is ready: the whole start and its parts, in
    order, which add up to it."""
    import logging
    import re

    from engine.config import EngineConfig
    from engine.engine import Engine

    with caplog.at_level(logging.INFO, logger="engine.engine"):
        engine = Engine(EngineConfig(model=model_dir, device="cpu", page_size=4, num_pages=64))
    lines = [r.getMessage() for r in caplog.records if r.name == "engine.engine"]
    assert len(lines) == 1, lines
    number = r"\d+\.\d"
    want = (
        rf"engine ready in ({number}) s \(weights {number}, KV pool {number}, "
        rf"attention {number}, scheduler {number}\)"
    )
    match = re.fullmatch(want, lines[0])
    assert match is not None, lines[0]
    parts = engine.runner.start_times.parts
    assert list(parts) == ["weights", "KV pool", "attention", "scheduler"]
    assert abs(sum(parts.values()) - float(match[1])) < 0.15
