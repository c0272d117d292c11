"""Structured output and tool calls end to end, through the official ``openai``
SDK: a prefill and a decode worker process (tiny random-weight model, CPU,
tcp KV transfer) behind ``python -m gateway``. The prefill worker samples the
first token under the grammar and the decode worker replays it into its own
matcher; with random weights only the grammar makes the outputs valid, which
``jsonschema`` checks independently. Every test ends with both pools back to
their starting free pages; worker logs are printed when a test fails."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from workers import dump_log, free_port, launch_gateway, launch_workers, worker_cmd

from engine.tiny import TINY_MODEL_NAME
from worker.cli import CLUSTER_TOKEN_ENV

pytestmark = pytest.mark.e2e

ENGINE: dict[str, Any] = dict(
    page_size=4, num_pages=512, context_length=1024, transfer_backend="tcp", transfer_timeout_s=10
)
ENV = {CLUSTER_TOKEN_ENV: "structured-e2e-secret", "OMP_NUM_THREADS": "1"}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "address", "active"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": -99, "maximum": 99},
                "b": {"type": "integer", "minimum": -99, "maximum": 99},
            },
            "required": ["a", "b"],
        },
    },
}
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
LOGS: list[Path] = []


class Stack:
    def __init__(self, url: str, workers: list[Any]) -> None:
        self.url = url
        self.workers = workers
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)

    def drained(self, timeout: float = 20.0) -> None:
        """Both workers idle with their starting free pages."""
        deadline = time.monotonic() + timeout
        while True:
            stats = [w.stats() for w in self.workers]
            ok = all(
                s["running"] == 0
                and s["waiting"] == 0
                and s.get("rooms", 0) == 0
                and s.get("transferring", 0) == 0
                and s["available_pages"] == w.start_info["stats"]["available_pages"]
                for s, w in zip(stats, self.workers)
            )
            if ok:
                return
            assert time.monotonic() < deadline, f"workers not drained: {stats}"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def stack(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    log_dir = tmp_path_factory.mktemp("structured-e2e")
    specs = []
    for role, module in (("prefill", "prefill_server"), ("decode", "decode_server")):
        port = free_port()
        cmd = worker_cmd(
            module,
            model_dir,
            port,
            role=role,
            flags=("--served-model-name", TINY_MODEL_NAME),
            **ENGINE,
        )
        specs.append((cmd, port, log_dir / f"{role}.log", ENV))
    with launch_workers(specs) as workers:
        LOGS.extend(w.log_path for w in workers)
        args = ["--prefill", workers[0].url, "--decode", workers[1].url, "--log-level", "warning"]
        gw_log = log_dir / "gateway.log"
        LOGS.append(gw_log)
        with launch_gateway(args, gw_log, 60, ENV) as (url, _):
            yield Stack(url, workers)
    LOGS.clear()


@pytest.fixture(autouse=True)
def _logs_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    failed = request.session.testsfailed
    yield
    if request.session.testsfailed > failed:
        for path in LOGS:
            dump_log(request.config, path, 80)


def person_format() -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }


def test_json_schema_outputs_validate(stack: Stack) -> None:
    """20 seeded sampled choices, 10 streamed and 10 not, all valid; a stream
    carries the same text as the whole response with the same seed."""
    whole = stack.client.chat.completions.create(
        model=TINY_MODEL_NAME,
        messages=MESSAGES,
        response_format=person_format(),
        max_tokens=150,
        n=10,
        seed=7,
    )
    texts = []
    for choice in whole.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        texts.append(choice.message.content)
    assert len(set(texts)) > 1
    stream = stack.client.chat.completions.create(
        model=TINY_MODEL_NAME,
        messages=MESSAGES,
        response_format=person_format(),
        max_tokens=150,
        n=10,
        seed=7,
        stream=True,
    )
    streamed = [""] * 10
    finish: list[str | None] = [None] * 10
    for chunk in stream:
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish[c.index]
    assert finish == ["stop"] * 10
    for text in streamed:
        jsonschema.validate(json.loads(text), PERSON)
    assert streamed == texts
    stack.drained()


def test_json_object_and_structured_outputs(stack: Stack) -> None:
    out = stack.client.chat.completions.create(
        model=TINY_MODEL_NAME,
        messages=MESSAGES,
        response_format={"type": "json_object"},
        max_tokens=200,
        n=4,
        seed=1,
    )
    stopped = [c for c in out.choices if c.finish_reason == "stop"]
    assert stopped
    for c in stopped:
        assert isinstance(json.loads(c.message.content), dict)
    done = stack.client.completions.create(
        model=TINY_MODEL_NAME,
        prompt="Pick one:",
        max_tokens=10,
        n=3,
        seed=2,
        extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}},
    )
    assert all(c.text in ("red", "green", "blue") for c in done.choices)
    regex = stack.client.completions.create(
        model=TINY_MODEL_NAME,
        prompt="Date:",
        max_tokens=20,
        seed=3,
        extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"}},
    )
    assert regex.choices[0].finish_reason == "stop"
    assert len(regex.choices[0].text) == 10 and regex.choices[0].text.startswith("20")
    stack.drained()


def check_calls(calls: list[Any], names: set[str]) -> list[tuple[str, str]]:
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
        out.append((call.function.name, call.function.arguments))
    return out


def streamed_calls(stream: Any) -> tuple[list[tuple[str, str]], str | None]:
    """Tool calls put together from streamed deltas, as the SDK's users do.
    A call's first delta has its id, type and name; later ones only carry
    more of its arguments, which stream in pieces."""
    calls: dict[int, list[str]] = {}
    pieces = 0
    finish = None
    for chunk in stream:
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or ():
                first = d.index not in calls
                assert (d.id is not None, d.type, d.function.name is not None) == (
                    (True, "function", True) if first else (False, None, False)
                )
                entry = calls.setdefault(d.index, ["", ""])
                entry[0] += d.function.name or ""
                entry[1] += d.function.arguments or ""
                pieces += 1
    assert pieces > len(calls)
    return [tuple(calls[i]) for i in sorted(calls)], finish  # type: ignore[misc]


@pytest.mark.parametrize(
    ("tool_choice", "parallel", "names"),
    [
        ({"type": "function", "function": {"name": "get_weather"}}, None, {"get_weather"}),
        ("required", False, {"get_weather", "add"}),
        ("required", True, {"get_weather", "add"}),
    ],
)
def test_forced_tool_calls(
    stack: Stack, tool_choice: Any, parallel: bool | None, names: set[str]
) -> None:
    kw: dict[str, Any] = dict(
        model=TINY_MODEL_NAME,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER, ADD],
        tool_choice=tool_choice,
        max_tokens=120,
        seed=5,
    )
    if parallel is not None:
        kw["parallel_tool_calls"] = parallel
    whole = stack.client.chat.completions.create(**kw)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = check_calls(choice.message.tool_calls, names)
    assert calls and (parallel or len(calls) == 1)
    streamed, finish = streamed_calls(stack.client.chat.completions.create(**kw, stream=True))
    assert finish == "tool_calls"
    assert streamed == calls
    stack.drained()


def test_history_with_tool_calls_and_auto(stack: Stack) -> None:
    """An earlier call and its result in the conversation; tool_choice auto on
    a model that writes no tags gives plain content."""
    out = stack.client.chat.completions.create(
        model=TINY_MODEL_NAME,
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": '{"city": "Paris", "unit": "celsius"}',
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
        ],
        tools=[WEATHER],
        max_tokens=8,
        seed=0,
    )
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens > 100  # the tools and the history were rendered
    stack.drained()


@pytest.mark.parametrize("stream", [False, True])
def test_grammar_refused_by_the_workers_is_400(stack: Stack, stream: bool) -> None:
    body = {
        "model": TINY_MODEL_NAME,
        "messages": MESSAGES,
        "max_tokens": 5,
        "stream": stream,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "nope"}},
        },
    }
    r = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format" and "nope" in error["message"]
    bad_regex = {"model": TINY_MODEL_NAME, "prompt": "x", "structured_outputs": {"regex": "(a"}}
    r = httpx.post(f"{stack.url}/v1/completions", json=bad_regex, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs"
    # No worker was held responsible: the next request is served.
    ok = stack.client.completions.create(model=TINY_MODEL_NAME, prompt="Hi", max_tokens=2)
    assert ok.choices[0].finish_reason == "length"
    stack.drained()


def test_bad_fields_are_400(stack: Stack) -> None:
    cases = [
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
        ),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ]
    for extra, param in cases:
        body = {"model": TINY_MODEL_NAME, "messages": MESSAGES, "max_tokens": 4, **extra}
        r = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == param, (extra, r.text)
