"""Every field of the OpenAI request bodies is honoured or refused: ranges and
unsupported fields are a 400 naming the field, honoured ones reach the
workers in ``SamplingParams``, and echoed prompt logprobs are merged into the
completion's logprobs (whole and streamed).

The gateway app runs in-process over the hostile tests' fake dispatcher (the
real request-plane encoding, a few tokens back), which here also sends
prompt logprobs with the first token when a request asks for them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import msgspec
import openai
import pytest
from test_gateway_hostile import (
    MESSAGES,
    MODEL,
    App,
    WireDispatcher,
    _LocalState,
    assert_error,
    serve_in_process,
)

from gateway.config import GatewayConfig
from gateway.routing import HealthChecker, Router, RouterConfig
from protocol.sampling import SamplingParams
from protocol.to_gateway import TokenDelta


def fake_prompt_logprob(i: int) -> float:
    """What the fake worker says the logprob of prompt token ``i + 1`` is."""
    return -0.5 - i / 8


class ScoringDispatcher(WireDispatcher):
    """The fake workers, plus prompt logprobs (and their alternatives: the
    prompt's own token, then token 0) on the first delta when asked for."""

    async def stream(
        self, prompt_ids: list[int], spec: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[TokenDelta]:
        first = True
        async for delta in super().stream(prompt_ids, spec, request_id):
            if first and spec.prompt_logprobs is not None:
                lps = [fake_prompt_logprob(i) for i in range(len(prompt_ids) - 1)]
                tops = [
                    [(t, lp), (0, -9.0)][: spec.prompt_logprobs]
                    for t, lp in zip(prompt_ids[1:], lps)
                ]
                delta = msgspec.structs.replace(
                    delta, prompt_logprobs=lps, prompt_top_logprobs=tops
                )
            first = False
            yield delta


@pytest.fixture(scope="module")
def app(model_dir: str) -> Iterator[App]:
    router = Router(RouterConfig())
    dispatcher = ScoringDispatcher()
    state = _LocalState(
        GatewayConfig(), router, HealthChecker(router), dispatcher, model_dir=model_dir
    )  # type: ignore[arg-type]
    with serve_in_process(state, dispatcher) as served:
        yield served


def _send(app: App, endpoint: str, **fields: Any) -> httpx.Response:
    if endpoint == "completions":
        return app.complete(**{"prompt": "Hello", "max_tokens": 2, **fields})
    return app.chat(**{"messages": MESSAGES, "max_tokens": 2, **fields})


def _refused(vocab: int) -> list[tuple[str, dict[str, Any], str]]:
    """(endpoint, fields, the param the 400 names)."""
    both = [
        ({"temperature": 2.0001}, "temperature"),
        ({"temperature": -0.5}, "temperature"),
        ({"presence_penalty": 5}, "presence_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"frequency_penalty": 2.01}, "frequency_penalty"),
        ({"frequency_penalty": True}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": 2.5}, "repetition_penalty"),
        ({"logit_bias": {"5": 100.5}}, "logit_bias"),
        ({"logit_bias": {"5": -101}}, "logit_bias"),
        ({"logit_bias": {str(vocab): 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"+5": 1}}, "logit_bias"),
        ({"logit_bias": {" 5": 1}}, "logit_bias"),
        ({"logit_bias": {"1_0": 1}}, "logit_bias"),
        ({"logit_bias": {"hello": 1}}, "logit_bias"),
        ({"logit_bias": {"5": "1"}}, "logit_bias"),
        ({"logit_bias": {"5": True}}, "logit_bias"),
        ({"logit_bias": [5, 1]}, "logit_bias"),
        # Unknown fields: OpenAI's own that are not served, other servers'
        # extensions, typos.
        ({"use_beam_search": True}, "use_beam_search"),
        ({"min_tokens": 3}, "min_tokens"),
        ({"temprature": 0.5}, "temprature"),
        ({"metadata": {"k": 1}}, "metadata"),
    ]
    return [
        *(("completions", f, p) for f, p in both),
        *(("chat", f, p) for f, p in both),
        ("completions", {"best_of": 2}, "best_of"),
        ("completions", {"best_of": 3, "n": 2}, "best_of"),
        ("completions", {"suffix": "and then"}, "suffix"),
        ("completions", {"max_tokens": 0, "echo": True}, "max_tokens"),
        ("completions", {"max_tokens": 0, "logprobs": 1}, "max_tokens"),
        ("chat", {"audio": {"voice": "alloy"}}, "audio"),
        ("chat", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ("chat", {"echo": True}, "echo"),
        ("chat", {"suffix": "x"}, "suffix"),
    ]


def test_out_of_range_and_unsupported_fields_are_a_400_naming_them(app: App) -> None:
    for endpoint, fields, param in _refused(app.vocab):
        err = assert_error(_send(app, endpoint, **fields), 400, param)
        assert param in err["message"], err


def test_unknown_fields_say_they_are_not_supported(app: App) -> None:
    err = assert_error(_send(app, "chat", functionz=[]), 400, "functionz")
    assert "unrecognized request argument" in err["message"]


def test_honoured_fields_reach_the_workers(app: App) -> None:
    top = app.vocab - 1
    for endpoint in ("completions", "chat"):
        app.dispatcher.seen.clear()
        resp = _send(
            app,
            endpoint,
            temperature=2,
            presence_penalty=-2,
            frequency_penalty=2,
            repetition_penalty=2,
            logit_bias={"0": -100, str(top): 100, "17": 0.5},
            seed=-7,
        )
        assert resp.status_code == 200, resp.text
        (p,) = app.dispatcher.seen
        assert (p.temperature, p.presence_penalty, p.frequency_penalty) == (2, -2, 2)
        assert p.repetition_penalty == 2 and p.seed == -7
        assert p.logit_bias == ((0, -100.0), (17, 0.5), (top, 100.0))
        assert p.prompt_logprobs is None
    # Accepted and ignored on purpose: they ask nothing of the generation.
    ignored = {"user": "u1", "metadata": {"k": "v"}, "store": True, "service_tier": "auto"}
    app.dispatcher.seen.clear()
    for endpoint in ("completions", "chat"):
        assert _send(app, endpoint, **ignored).status_code == 200
    assert app.dispatcher.seen == [SamplingParams(max_tokens=2)] * 2
    # best_of equal to n ranks nothing; an empty suffix inserts nothing.
    assert _send(app, "completions", best_of=2, n=2, suffix="").status_code == 200


def test_model_by_id(app: App) -> None:
    resp = app.http.get(f"/v1/models/{MODEL}")
    assert resp.status_code == 200, resp.text
    assert resp.json()["id"] == MODEL and resp.json()["object"] == "model"
    err = assert_error(app.http.get("/v1/models/org/other-model"), 404, "model")
    assert "org/other-model" in err["message"]
    client = openai.OpenAI(base_url=f"http://{app.host}:{app.port}/v1", api_key="x", max_retries=0)
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


@pytest.mark.parametrize("prompt", [["Hello", "Goodbye world"], [[5, 6, 7], [8, 9]]])
def test_list_prompts_with_n(app: App, prompt: list[Any]) -> None:
    resp = app.complete(prompt=prompt, n=3, max_tokens=2, return_token_ids=True)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert [c["index"] for c in body["choices"]] == list(range(6))
    # n choices per prompt, prompt after prompt.
    ids = body["prompt_token_ids"]
    for c in body["choices"]:
        assert c["token_ids"][0] == ids[c["index"] // 3][0]
    assert body["usage"]["prompt_tokens"] == sum(len(p) for p in ids)  # once per prompt


def _prompt_ids(app: App, text: str) -> list[int]:
    assert app.state.tokenizer is not None
    return app.state.tokenizer.encode(text)


def _check_echo_logprobs(
    app: App, logprobs: dict[str, Any], text: str, prompt: list[int], k: int, generated: int
) -> None:
    n = len(prompt)
    assert len(logprobs["tokens"]) == n + generated
    lps = logprobs["token_logprobs"]
    assert lps[0] is None and logprobs["top_logprobs"][0] is None
    assert lps[1:n] == [fake_prompt_logprob(i) for i in range(n - 1)]
    tokenizer = app.state.tokenizer
    assert tokenizer is not None
    for i in range(1, n):
        tops = logprobs["top_logprobs"][i]
        tok = tokenizer.decode([prompt[i]])
        assert tops[tok] == lps[i]
        if k >= 2:
            assert tops[tokenizer.decode([0])] == -9.0
    # Offsets walk the echoed text token by token.
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0
    for a, b, tok in zip(offsets, offsets[1:], logprobs["tokens"]):
        assert b - a == len(tok)
    assert "".join(logprobs["tokens"])[: len(text)] == text[: len("".join(logprobs["tokens"]))]


@pytest.mark.parametrize("max_tokens", [0, 1, 3])
@pytest.mark.parametrize("k", [0, 2])
def test_echo_with_logprobs_leads_with_the_prompt(app: App, max_tokens: int, k: int) -> None:
    text = "Hello there, general"
    prompt = _prompt_ids(app, text)
    body = {"prompt": text, "echo": True, "logprobs": k, "max_tokens": max_tokens}
    resp = app.complete(**body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    (choice,) = out["choices"]
    assert app.dispatcher.seen[-1].prompt_logprobs == k
    assert app.dispatcher.seen[-1].max_tokens == max(max_tokens, 1)
    generated = min(max_tokens, 3)
    assert out["usage"]["completion_tokens"] == generated
    assert choice["text"].startswith(text)
    if max_tokens == 0:
        assert choice["text"] == text and choice["finish_reason"] == "length"
    _check_echo_logprobs(app, choice["logprobs"], choice["text"], prompt, k, generated)

    # Streamed: the echoed prompt comes with its logprobs, then the tokens.
    with app.http.stream(
        "POST", "/v1/completions", json={"model": MODEL, **body, "stream": True}
    ) as resp:
        events = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: "))["choices"][0] for e in events[:-1]]
    assert chunks[0]["text"] == text
    merged: dict[str, list[Any]] = {k: [] for k in choice["logprobs"]}
    for c in chunks:
        for key in merged:
            merged[key] += c["logprobs"][key] if c["logprobs"] else []
    assert merged == choice["logprobs"]
    assert "".join(c["text"] for c in chunks) == choice["text"]


def test_echo_without_logprobs_asks_for_none(app: App) -> None:
    app.dispatcher.seen.clear()
    resp = app.complete(prompt="Hello", echo=True, max_tokens=2)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["logprobs"] is None
    assert app.dispatcher.seen[-1].prompt_logprobs is None
    resp = app.complete(prompt="Hello", logprobs=1, max_tokens=2)
    assert app.dispatcher.seen[-1].prompt_logprobs is None
    assert len(resp.json()["choices"][0]["logprobs"]["tokens"]) == 2


def test_lm_eval_loglikelihood_request(app: App) -> None:
    """The body lm-eval's ``local-completions`` sends for loglikelihoods (a
    batch of token-id prompts, echo, logprobs 1, max_tokens 1), read the way
    it reads it: ``token_logprobs[ctxlen:-1]``, greedy when each equals the
    largest of its ``top_logprobs``."""
    prompts = [[11, 12, 13, 14, 15], [21, 22, 23]]
    ctxlens = [3, 1]
    body = {
        "model": MODEL,
        "prompt": prompts,
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    resp = app.http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
    for choice, prompt, ctxlen in zip(choices, prompts, ctxlens):
        lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        assert lps == [fake_prompt_logprob(i - 1) for i in range(ctxlen, len(prompt))]
        assert all(lp == max(top.values()) for lp, top in zip(lps, tops))


TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}

_BAD_MESSAGES: list[tuple[list[dict[str, Any]], str]] = [
    ([{"role": "boss", "content": "Hello"}], "messages[0].role"),
    ([{"role": "", "content": "Hello"}], "messages[0].role"),
    ([{"role": "User", "content": "Hello"}], "messages[0].role"),
    ([*MESSAGES, {"role": "robot", "content": "Hi"}], "messages[1].role"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "system"}, *MESSAGES], "messages[0].content"),
    ([*MESSAGES, {"role": "assistant"}], "messages[1].content"),
    (
        [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": None}],
        "messages[1].content",
    ),
    ([{"role": "tool", "content": "42"}], "messages[0].tool_call_id"),
    ([{"role": "tool", "content": "42", "tool_call_id": 7}], "messages[0].tool_call_id"),
    ([{"role": "user", "content": "Hello", "name": 3}], "messages[0].name"),
    ([{"role": "function", "content": "42"}], "messages[0].name"),
]


@pytest.mark.parametrize(("messages", "param"), _BAD_MESSAGES)
def test_malformed_chat_messages_are_a_400_naming_the_field(
    app: App, messages: list[dict[str, Any]], param: str
) -> None:
    # OpenAI refuses these too; a template would render them into some prompt.
    err = assert_error(_send(app, "chat", messages=messages), 400, param)
    assert param in err["message"], err


_GOOD_MESSAGES: list[list[dict[str, Any]]] = [
    [{"role": "system", "content": "Be brief."}, *MESSAGES],
    [{"role": "developer", "content": "Be brief."}, *MESSAGES],
    [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}],
        }
    ],
    [{"role": "user", "content": "Hello", "name": "ann"}],
    [*MESSAGES, {"role": "assistant", "content": "Hi"}, *MESSAGES],
    [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]}],
    [
        *MESSAGES,
        {"role": "assistant", "tool_calls": [TOOL_CALL]},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
    ],
    [{"role": "user", "content": ""}],
]


@pytest.mark.parametrize("messages", _GOOD_MESSAGES)
def test_valid_chat_messages_are_served(app: App, messages: list[dict[str, Any]]) -> None:
    resp = _send(app, "chat", messages=messages)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["role"] == "assistant"
