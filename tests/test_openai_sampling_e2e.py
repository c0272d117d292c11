"""Logit bias, penalties and echoed prompt logprobs end to end: the official
``openai`` SDK against ``python -m gateway`` in front of a real prefill and a
real decode worker (tiny model, CPU, tcp KV transfer, prefill chunks of 8
tokens). Prompts of at least ``SKIP_PREFILL`` tokens go through the prefill
worker (its first token, and the prompt's logprobs, come from there; the
decode worker carries on); shorter ones are prefilled by the decode worker.

References are independent of the serving path: a greedy decode that runs
the whole sequence through the model at every step and applies the penalties
as a plain Python loop, and one forward over the whole prompt for the prompt
logprobs. After every test both workers are idle with their whole KV pool
available again; the logs are printed when a test fails."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from test_logit_adjust import _direct_prompt_logprobs, _greedy_reference
from workers import Worker, dump_log, free_port, launch_gateway, launch_workers, worker_cmd

from engine.llm import LLM
from engine.tiny import TINY_MODEL_NAME
from protocol.sampling import SamplingParams
from worker.cli import CLUSTER_TOKEN_ENV

pytestmark = pytest.mark.e2e

MODEL = TINY_MODEL_NAME
ENGINE: dict[str, Any] = dict(
    page_size=4,
    num_pages=256,
    context_length=256,
    chunk_size=8,
    max_num_batched_tokens=32,
    transfer_backend="tcp",
    transfer_timeout_s=20,
)
SKIP_PREFILL = 12
"""Prompts shorter than this are prefilled by the decode worker."""
ENV = {CLUSTER_TOKEN_ENV: "openai-sampling-secret", "OMP_NUM_THREADS": "1"}
SHORT = "Once upon a time"
LONG = "The quick brown fox jumps over the lazy dog and then the dog sleeps all day long"
DRAIN_TIMEOUT_S = 20.0

LOGS: list[Path] = []


@dataclass
class Served:
    url: str
    workers: list[Worker]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def served(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    log_dir = tmp_path_factory.mktemp("openai-sampling")
    specs = []
    for role, module in (("prefill", "prefill_server"), ("decode", "decode_server")):
        port = free_port()
        flags = ("--served-model-name", MODEL)
        cmd = worker_cmd(module, model_dir, port, role=role, flags=flags, **ENGINE)
        specs.append((cmd, port, log_dir / f"{role}.log", ENV))
    with launch_workers(specs) as (prefill, decode):
        LOGS.extend([prefill.log_path, decode.log_path])
        args = ["--prefill", prefill.url, "--decode", decode.url]
        args += ["--skip-prefill-threshold", str(SKIP_PREFILL), "--log-level", "warning"]
        with launch_gateway(args, log_dir / "gateway.log", 60, ENV) as (url, _):
            LOGS.append(log_dir / "gateway.log")
            yield Served(url, [prefill, decode])
        LOGS.clear()


@pytest.fixture(autouse=True)
def _drained(request: pytest.FixtureRequest, served: Served) -> Iterator[None]:
    """After every test: both pools back to their starting counts (logs on failure)."""
    failed_before = request.session.testsfailed
    try:
        yield
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        for w in served.workers:
            start = w.start_info["stats"]
            while True:
                s = w.stats()
                if (
                    s["running"] == s["waiting"] == s.get("rooms", 0) == 0
                    and s["available_pages"] == s["total_pages"] == start["available_pages"]
                ):
                    break
                assert time.monotonic() < deadline, f"{w.name} did not drain: {s}"
                time.sleep(0.05)
    finally:
        if request.session.testsfailed > failed_before:
            for path in LOGS:
                dump_log(request.config, path, 120)


@pytest.fixture(scope="module")
def offline(model_dir: str) -> LLM:
    return LLM(model_dir, device="cpu", page_size=4, num_pages=256, context_length=256)


def test_prompts_take_both_paths(offline: LLM) -> None:
    assert len(offline.tokenizer.encode(SHORT)) < SKIP_PREFILL
    assert len(offline.tokenizer.encode(LONG)) > max(SKIP_PREFILL, ENGINE["chunk_size"])


def _token_ids(choice: Any, default: list[int] | None = None) -> list[int]:
    """The extension ``token_ids`` of a choice (``default``: a chunk may have none)."""
    ids = (choice.model_extra or {}).get("token_ids", default)
    assert ids is not None, choice
    return ids


@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["decode-only", "prefill+decode"])
def test_logit_bias_forces_and_bans(served: Served, offline: LLM, prompt: str) -> None:
    client = served.client()
    forced = 123
    resp = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=8,
        n=2,
        seed=3,
        logit_bias={str(forced): 100},
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert [_token_ids(c) for c in resp.choices] == [[forced] * 8] * 2
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=6,
        temperature=1.0,
        logit_bias={str(forced): 100},
        stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    ids = [t for chunk in stream for c in chunk.choices for t in _token_ids(c, [])]
    assert ids == [forced] * 6
    # -100 bans: the greedy output's most frequent token never comes back.
    free = offline.generate(
        [offline.tokenizer.encode(prompt)],
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
    )[0].token_ids
    banned = max(set(free), key=free.count)
    for seed in range(3):
        resp = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=24,
            temperature=0.7 if seed else 0,
            seed=seed,
            logit_bias={str(banned): -100},
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        got = _token_ids(resp.choices[0])
        assert len(got) == 24 and banned not in got


@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["decode-only", "prefill+decode"])
def test_penalties_equal_the_reference(served: Served, offline: LLM, prompt: str) -> None:
    """Greedy with penalties through the workers equals the step-by-step
    reference; through prefill and decode, the decode worker counts the
    first token that the prefill worker sampled."""
    client = served.client()
    ids = offline.tokenizer.encode(prompt)
    # The tiny model hardly repeats itself greedily, so positive penalties
    # alone change nothing here (the engine tests cover them): these pull
    # towards repeats, and how far depends on the exact counts. A negative
    # frequency penalty repeats the first token, which the prefill worker
    # sampled: the decode worker must have counted it.
    cases = [
        dict(frequency_penalty=-1.5),
        dict(presence_penalty=-2.0, frequency_penalty=0.7),
        dict(repetition_penalty=0.5),
    ]
    plain = offline.generate([ids], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    for case in cases:
        p = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, **case)  # type: ignore[arg-type]
        want = _greedy_reference(offline, ids, p, 20)
        assert want != plain[0].token_ids, case
        extra = {"return_token_ids": True, "ignore_eos": True}
        if "repetition_penalty" in case:
            extra["repetition_penalty"] = case["repetition_penalty"]
        resp = client.completions.create(
            model=MODEL,
            prompt=ids,
            max_tokens=20,
            temperature=0,
            presence_penalty=case.get("presence_penalty", 0.0),
            frequency_penalty=case.get("frequency_penalty", 0.0),
            extra_body=extra,
        )
        assert _token_ids(resp.choices[0]) == want, case


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["decode-only", "prefill+decode"])
def test_echoed_prompt_logprobs_equal_one_forward(
    served: Served, offline: LLM, prompt: str, stream: bool
) -> None:
    """Each prompt token's logprob given its prefix, as one forward over the
    whole prompt gives it (1e-4), though the workers compute it in chunks of
    8; asked twice, so the second time the prompt is in the prefix caches."""
    client = served.client()
    ids = offline.tokenizer.encode(prompt)
    ref = _direct_prompt_logprobs(offline, ids)
    want = [ref[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
    for _ in range(2):
        resp = client.completions.create(
            model=MODEL, prompt=prompt, echo=True, logprobs=3, max_tokens=2, stream=stream
        )
        chunks = list(resp) if stream else [resp]
        tokens: list[str] = []
        lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        text = ""
        for chunk in chunks:
            for c in chunk.choices:
                text += c.text
                if c.logprobs is not None:
                    tokens += c.logprobs.tokens
                    lps += c.logprobs.token_logprobs
                    tops += c.logprobs.top_logprobs
        assert text.startswith(prompt)
        assert len(lps) == len(ids) + 2
        assert lps[0] is None and tops[0] is None
        assert lps[1 : len(ids)] == pytest.approx(want, abs=1e-4)
        checked = 0
        for i in range(1, len(ids)):
            best = ref[i - 1].topk(3)
            top = tops[i]
            assert top is not None
            listed = [*best.indices.tolist(), ids[i]]
            texts = [offline.tokenizer.decode([t]) for t in listed]
            if len(set(texts)) < len(set(listed)):
                continue  # two tokens of one text share a key of the dict
            checked += 1
            assert len(top) == len(set(texts))
            for text_, v in zip(texts, best.values.tolist()):
                assert top[text_] == pytest.approx(v, abs=1e-4)
        assert checked >= len(ids) // 2


def test_prompt_scoring_as_lm_eval_asks(served: Served, offline: LLM) -> None:
    """lm-eval's loglikelihood body (token-id prompts in one batch, echo,
    logprobs 1, max_tokens 1, temperature 0), read as it reads it, and the
    max_tokens 0 form that scores the prompt alone."""
    client = served.client()
    context = offline.tokenizer.encode("The cat sat on the")
    continuations = [offline.tokenizer.encode(" mat"), offline.tokenizer.encode(" dog and the fox")]
    prompts = [context + c for c in continuations]
    resp = client.completions.create(
        model=MODEL, prompt=prompts, temperature=0, max_tokens=1, logprobs=1, seed=1234, echo=True
    )
    for choice, ids in zip(sorted(resp.choices, key=lambda c: c.index), prompts):
        assert choice.logprobs is not None
        ref = _direct_prompt_logprobs(offline, ids)
        got = choice.logprobs.token_logprobs[len(context) : -1]
        want = [ref[i - 1, ids[i]].item() for i in range(len(context), len(ids))]
        assert got == pytest.approx(want, abs=1e-4)
        greedy = all(
            lp == max(top.values())
            for lp, top in zip(got, choice.logprobs.top_logprobs[len(context) : -1])
        )
        assert greedy == all(
            ref[i - 1].argmax().item() == ids[i] for i in range(len(context), len(ids))
        )
    only = client.completions.create(
        model=MODEL, prompt=prompts[1], max_tokens=0, echo=True, logprobs=0
    )
    (choice,) = only.choices
    assert choice.text == offline.tokenizer.decode(prompts[1])
    assert choice.finish_reason == "length"
    assert only.usage is not None and only.usage.completion_tokens == 0
    assert choice.logprobs is not None and len(choice.logprobs.token_logprobs) == len(prompts[1])


def test_strict_fields_through_the_sdk(served: Served) -> None:
    client = served.client()
    for kwargs, param in (
        (dict(temperature=3), "temperature"),
        (dict(presence_penalty=5), "presence_penalty"),
        (dict(best_of=2), "best_of"),
        (dict(suffix="x"), "suffix"),
        (dict(logit_bias={"100000": 5}), "logit_bias"),
        (dict(extra_body={"guided_json": {}}), "guided_json"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, **kwargs)  # type: ignore[arg-type]
        assert e.value.body["param"] == param, e.value.body  # type: ignore[index]
    assert client.models.retrieve(MODEL).id == MODEL
