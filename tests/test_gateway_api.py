"""The OpenAI-compatible gateway end to end, through the official ``openai`` SDK.

One prefill and one decode worker process (tiny model, CPU, tcp KV transfer)
and the gateway in a process of its own (``python -m gateway``, so its start-up
and shutdown are real) are started once for the module. Greedy outputs,
token ids and logprobs are checked against the offline engine
(``engine.llm.LLM``) on the same prompt ids. Every test that runs requests ends
by checking that both workers are idle with their whole KV pool available
again; the worker and gateway logs are printed when a test fails.

One test serves the gateway app in-process instead (uvicorn in a thread, fake
worker streams), to hit a disconnect race deterministically.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from raw_http import RawRequest, exchange
from workers import (
    REPO,
    Worker,
    dump_log,
    free_port,
    launch_gateway,
    launch_workers,
    log_tail,
    stop,
    worker_cmd,
)

from engine.llm import LLM, GenerationOutput
from engine.tiny import TINY_MODEL_NAME
from gateway.app import build_app
from gateway.config import GatewayConfig
from gateway.routing import HealthChecker, Router, RouterConfig
from gateway.state import GatewayState
from gateway.text import Tokenizer
from protocol.sampling import SamplingParams
from protocol.to_gateway import TokenDelta
from worker.cli import CLUSTER_TOKEN_ENV

pytestmark = pytest.mark.e2e

MODEL = TINY_MODEL_NAME
API_KEY = "gw-test-key"
ADMIN_KEY = "gw-admin-key"
CONTEXT = 1024
ENGINE: dict[str, Any] = dict(
    page_size=4,
    num_pages=256,
    context_length=CONTEXT,
    transfer_backend="tcp",
    transfer_timeout_s=10,
)
MAX_BODY_BYTES = 16 << 10
MAX_PROMPT_TOKENS = 300
HEALTH_INTERVAL_S = 0.2
WORKER_ENV = {
    CLUSTER_TOKEN_ENV: "gateway-api-cluster-secret",
    # Several processes share a few cores: one intra-op thread each.
    "OMP_NUM_THREADS": "1",
}
GATEWAY_START_TIMEOUT_S = 60.0
DRAIN_TIMEOUT_S = 20.0
ABORT_DEADLINE_S = 2.5
"""Disconnected streams must be gone from the gateway and the workers within
this of their clients leaving; the requests behind them (CONTEXT - 64 tokens
each) need longer than that to run out even alone."""
CLIENT_TIMEOUT_S = 60.0

PROMPTS = [
    "The quick brown fox jumps over the lazy dog",
    "Once upon a time there was a little",
    "Hello world",
    "In the beginning",
]

LIVE_LOGS: list[Path] = []
"""Logs of the running processes of this module (printed when a test fails)."""


# -- processes --------------------------------------------------------------------


@dataclass
class Gateway:
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    prefill: Worker
    decode: Worker
    extra_workers: list[Worker] = field(default_factory=list)
    """Workers added at run time that are alive and must drain too."""

    @property
    def workers(self) -> list[Worker]:
        return [self.prefill, self.decode, *(w for w in self.extra_workers if w.alive)]

    def client(self, **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1",
            api_key=kw.pop("api_key", API_KEY),
            max_retries=0,  # a retry would hide a failure (and double the work)
            timeout=CLIENT_TIMEOUT_S,
            **kw,
        )

    def aclient(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=CLIENT_TIMEOUT_S
        )

    def admin(self, method: str, path: str, **kw: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        return httpx.request(method, f"{self.url}{path}", headers=headers, timeout=30, **kw)

    def gateway_workers(self) -> dict[str, dict[str, Any]]:
        resp = self.admin("GET", "/admin/workers")
        assert resp.status_code == 200, resp.text
        return {w["url"]: w for w in resp.json()["workers"]}


def idle(stats: dict[str, Any]) -> bool:
    """No request anywhere in the worker and every KV page available again."""
    return (
        stats["running"] == 0
        and stats["waiting"] == 0
        and stats.get("in_flight", 0) == 0
        and stats.get("rooms", 0) == 0
        and stats.get("prealloc", 0) == 0
        and stats.get("transferring", 0) == 0
        and stats["available_pages"] == stats["total_pages"]
    )


def assert_drained(gw: Gateway, timeout: float = DRAIN_TIMEOUT_S) -> None:
    """Both pools back to their starting counts: every live worker idle with
    ``available_pages == total_pages`` (as at start), and nothing outstanding
    in the gateway."""
    deadline = time.monotonic() + timeout
    while True:
        stats = {w.name: w.stats() for w in gw.workers}
        pending = {
            w.name: stats[w.name]
            for w in gw.workers
            if not idle(stats[w.name])
            or stats[w.name]["total_pages"] != w.start_info["stats"]["total_pages"]
            or stats[w.name]["available_pages"] != w.start_info["stats"]["available_pages"]
        }
        outstanding = {
            url: w["outstanding_requests"]
            for url, w in gw.gateway_workers().items()
            if w["outstanding_requests"]
        }
        if not pending and not outstanding:
            return
        if time.monotonic() > deadline:
            raise AssertionError(
                f"not drained after {timeout:g}s: workers {pending}; gateway outstanding "
                f"{outstanding}"
            )
        time.sleep(0.05)


def start_gateway(
    log_path: Path, prefill: Worker, decode: Worker, port: int
) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "gateway", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--prefill", prefill.url, "--decode", decode.url]
    cmd += ["--api-key", API_KEY, "--admin-key", ADMIN_KEY]
    cmd += ["--max-body-bytes", str(MAX_BODY_BYTES)]
    cmd += ["--max-prompt-tokens", str(MAX_PROMPT_TOKENS)]
    cmd += ["--health-interval-s", str(HEALTH_INTERVAL_S), "--health-timeout-s", "1"]
    cmd += ["--worker-timeout-s", "30", "--log-level", "warning"]
    env = {**os.environ, CLUSTER_TOKEN_ENV: WORKER_ENV[CLUSTER_TOKEN_ENV]}
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)


def wait_gateway(proc: subprocess.Popen[bytes], url: str, log_path: Path) -> None:
    deadline = time.monotonic() + GATEWAY_START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"gateway exited with {proc.returncode}:\n{log_tail(log_path)}")
        if time.monotonic() > deadline:
            pytest.fail(
                f"gateway not healthy after {GATEWAY_START_TIMEOUT_S}s:\n{log_tail(log_path)}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.1)


def _worker_spec(log_dir: Path, name: str, role: str, model_dir: str):
    port = free_port()
    module = "prefill_server" if role == "prefill" else "decode_server"
    cmd = worker_cmd(
        module, model_dir, port, role=role, flags=("--served-model-name", MODEL), **ENGINE
    )
    return cmd, port, log_dir / f"{name}.log", WORKER_ENV


@pytest.fixture(scope="module")
def gw(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    log_dir = tmp_path_factory.mktemp("gateway-api")
    specs = [
        _worker_spec(log_dir, "prefill", "prefill", model_dir),
        _worker_spec(log_dir, "decode", "decode", model_dir),
    ]
    with launch_workers(specs) as (prefill, decode):
        LIVE_LOGS.extend([prefill.log_path, decode.log_path])
        port = free_port()
        log_path = log_dir / "gateway.log"
        proc = start_gateway(log_path, prefill, decode, port)
        LIVE_LOGS.append(log_path)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_gateway(proc, url, log_path)
            yield Gateway(url, proc, log_path, prefill, decode)
        finally:
            stop(proc)
            LIVE_LOGS.clear()
        # A real shutdown: SIGTERM ends the gateway cleanly, not by a kill.
        assert proc.returncode == 0, f"gateway exited with {proc.returncode}:\n{log_tail(log_path)}"


@pytest.fixture(autouse=True)
def _dump_logs_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    failed_before = request.session.testsfailed
    yield
    if request.session.testsfailed > failed_before:
        for path in LIVE_LOGS:
            dump_log(request.config, path, 120)


# -- the offline reference --------------------------------------------------------


class Offline:
    """The offline engine on the same model and page size (greedy results cached)."""

    def __init__(self, model_dir: str) -> None:
        self.llm = LLM(model_dir, device="cpu", page_size=4, num_pages=512, context_length=CONTEXT)
        self._cache: dict[tuple, GenerationOutput] = {}

    def encode(self, text: str) -> list[int]:
        return self.llm.tokenizer.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.llm.tokenizer.decode(ids, skip_special_tokens=True)

    def greedy(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        ignore_eos: bool = False,
        top_logprobs: int = 0,
    ) -> list[GenerationOutput]:
        keys = [(tuple(p), max_tokens, ignore_eos, top_logprobs) for p in prompts]
        todo = [k for k in dict.fromkeys(keys) if k not in self._cache]
        if todo:
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=0,
                ignore_eos=ignore_eos,
                top_logprobs=top_logprobs,
            )
            outs = self.llm.generate([list(k[0]) for k in todo], params)
            self._cache.update(zip(todo, outs))
        return [self._cache[k] for k in keys]


@pytest.fixture(scope="module")
def offline(model_dir: str) -> Offline:
    return Offline(model_dir)


# -- helpers ----------------------------------------------------------------------


def extra(obj: Any, name: str) -> Any:
    """An extension field of an SDK object (kept by its pydantic models)."""
    return (obj.model_extra or {}).get(name)


@dataclass
class Streamed:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = None
    usage: Any = None
    logprobs: list[float] = field(default_factory=list)
    chunks: int = 0


def collect(stream: Any, chat: bool) -> Streamed:
    """Concatenate a one-choice stream; checks that usage only comes last."""
    out = Streamed()
    for chunk in stream:
        out.chunks += 1
        assert out.usage is None, "a chunk after the usage chunk"
        if chunk.usage is not None:
            assert chunk.choices == [], "the usage chunk must have no choices"
            out.usage = chunk.usage
            continue
        _add_chunk(out, chunk, chat)
    return out


def _add_chunk(out: Streamed, chunk: Any, chat: bool) -> None:
    assert len(chunk.choices) == 1, chunk
    c = chunk.choices[0]
    assert c.index == 0
    out.text += (c.delta.content or "") if chat else c.text
    out.token_ids += extra(c, "token_ids") or []
    if extra(chunk, "prompt_token_ids") is not None:
        assert out.prompt_token_ids is None, "prompt_token_ids sent twice"
        out.prompt_token_ids = extra(chunk, "prompt_token_ids")
    if c.logprobs is not None:
        if chat:
            out.logprobs += [t.logprob for t in c.logprobs.content or []]
        else:
            out.logprobs += list(c.logprobs.token_logprobs or [])
    if c.finish_reason is not None:
        assert out.finish_reason is None, "two finish reasons"
        out.finish_reason = c.finish_reason


def assert_logprobs_close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want), (got, want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= 1e-4, f"logprob {i}: {g} vs offline {w}"


def assert_usage(usage: Any, prompt_tokens: int, completion_tokens: int) -> None:
    assert usage.prompt_tokens == prompt_tokens
    assert usage.completion_tokens == completion_tokens
    assert usage.total_tokens == prompt_tokens + completion_tokens


def stopped_or_length(out: GenerationOutput, max_tokens: int) -> str:
    return (
        "length" if len(out.token_ids) == max_tokens and out.finish_reason == "length" else "stop"
    )


def histogram_count(metrics: str, name: str) -> int:
    m = re.search(rf"^{name}_count (\d+)$", metrics, re.M)
    assert m, f"{name} missing from /metrics"
    return int(m.group(1))


# -- chat and completions -----------------------------------------------------------


def test_completions_greedy_match_offline(gw: Gateway, offline: Offline) -> None:
    client = gw.client()
    max_tokens = 20
    for prompt in PROMPTS[:2]:
        resp = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            logprobs=1,
            extra_body={"return_token_ids": True},
        )
        assert resp.object == "text_completion" and resp.model == MODEL
        ids = offline.encode(prompt)
        assert extra(resp, "prompt_token_ids") == ids
        (want,) = offline.greedy([ids], max_tokens)
        (c,) = resp.choices
        assert extra(c, "token_ids") == want.token_ids
        assert c.text == offline.decode(want.token_ids)
        assert c.finish_reason == stopped_or_length(want, max_tokens)
        assert_usage(resp.usage, len(ids), len(want.token_ids))
        assert c.logprobs is not None
        assert_logprobs_close(c.logprobs.token_logprobs, want.logprobs)
        assert len(c.logprobs.tokens) == len(want.token_ids)

        stream = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            logprobs=1,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"return_token_ids": True},
        )
        got = collect(stream, chat=False)
        assert got.text == c.text
        assert got.token_ids == want.token_ids
        assert got.prompt_token_ids == ids
        assert got.finish_reason == c.finish_reason
        assert got.usage is not None, "no usage chunk with include_usage"
        assert_usage(got.usage, len(ids), len(want.token_ids))
        assert_logprobs_close(got.logprobs, want.logprobs)

    # Without include_usage no chunk carries usage.
    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks and all(ch.usage is None and ch.choices for ch in chunks)
    assert_drained(gw)


def test_chat_greedy_match_offline(gw: Gateway, offline: Offline) -> None:
    client = gw.client()
    max_tokens = 16
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Tell me a story about a fox."},
    ]
    resp = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        logprobs=True,
        extra_body={"return_token_ids": True},
    )
    assert resp.object == "chat.completion" and resp.model == MODEL
    prompt_ids = extra(resp, "prompt_token_ids")
    assert isinstance(prompt_ids, list) and len(prompt_ids) > 10
    (want,) = offline.greedy([prompt_ids], max_tokens)
    (c,) = resp.choices
    assert c.message.role == "assistant"
    assert extra(c, "token_ids") == want.token_ids
    assert c.message.content == offline.decode(want.token_ids)
    assert c.finish_reason == stopped_or_length(want, max_tokens)
    assert_usage(resp.usage, len(prompt_ids), len(want.token_ids))
    assert c.logprobs is not None and c.logprobs.content is not None
    assert_logprobs_close([t.logprob for t in c.logprobs.content], want.logprobs)

    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        logprobs=True,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_token_ids": True},
    )
    got = collect(stream, chat=True)
    assert got.text == c.message.content
    assert got.token_ids == want.token_ids
    assert got.prompt_token_ids == prompt_ids
    assert got.finish_reason == c.finish_reason
    assert got.usage is not None
    assert_usage(got.usage, len(prompt_ids), len(want.token_ids))
    assert_logprobs_close(got.logprobs, want.logprobs)

    # max_completion_tokens is the chat name of max_tokens.
    resp = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=3, temperature=0
    )
    assert resp.usage.completion_tokens <= 3
    assert_drained(gw)


def _assert_top_close(
    got: list[list[tuple[str, float]]], want: list[list[tuple[int, float]]], offline: Offline
) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert [t for t, _ in g] == [offline.decode([t]) for t, _ in w], f"token {i}"
        assert_logprobs_close([lp for _, lp in g], [lp for _, lp in w])


def test_top_logprobs_match_offline(gw: Gateway, offline: Offline) -> None:
    """Chat top_logprobs and completions logprobs=N carry the offline engine's
    N most likely tokens per position, streamed or not; completions'
    text_offset runs on across streamed chunks."""
    client = gw.client()
    k, max_tokens = 3, 12
    messages = [{"role": "user", "content": "Name three colours."}]
    resp = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        logprobs=True,
        top_logprobs=k,
        extra_body={"return_token_ids": True},
    )
    prompt_ids = extra(resp, "prompt_token_ids")
    (want,) = offline.greedy([prompt_ids], max_tokens, top_logprobs=k)
    assert want.top_logprobs is not None
    content = resp.choices[0].logprobs.content
    assert [len(t.top_logprobs) for t in content] == [k] * len(want.token_ids)
    _assert_top_close(
        [[(a.token, a.logprob) for a in t.top_logprobs] for t in content],
        want.top_logprobs,
        offline,
    )
    # Greedy: the chosen token is the most likely one; bytes add up to the text.
    assert all(t.top_logprobs[0].token == t.token for t in content)
    special = set(offline.llm.tokenizer.all_special_ids)
    raw = b"".join(bytes(t.bytes) for t, i in zip(content, want.token_ids) if i not in special)
    assert raw.decode(errors="replace") == resp.choices[0].message.content

    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        logprobs=True,
        top_logprobs=k,
        stream=True,
    )
    streamed = [
        t
        for ch in stream
        if ch.choices and ch.choices[0].logprobs
        for t in ch.choices[0].logprobs.content
    ]
    # The same tokens; logprobs equal up to float rounding (the second request
    # reuses the cached prompt, so its forward runs other shapes).
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-5)
    assert [len(t.top_logprobs) for t in streamed] == [k] * len(content)

    prompt = PROMPTS[1]
    ids = offline.encode(prompt)
    (want,) = offline.greedy([ids], max_tokens, top_logprobs=k)
    for stream in (False, True):
        kw: dict[str, Any] = {"stream": True} if stream else {}
        out = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            logprobs=k,
            echo=True,
            **kw,
        )
        chunks = list(out) if stream else [out]
        text = "".join(ch.choices[0].text for ch in chunks)
        lps = [ch.choices[0].logprobs for ch in chunks if ch.choices[0].logprobs is not None]
        tokens = [t for lp in lps for t in lp.tokens]
        offsets = [o for lp in lps for o in lp.text_offset]
        tops = [d for lp in lps for d in lp.top_logprobs]
        assert text == prompt + offline.decode(want.token_ids), stream
        # The echoed prompt's tokens lead (the first with no logprob), then
        # the generated ones (their prompt logprobs: tests/test_openai_sampling_e2e.py).
        n = len(ids)
        assert tokens == [offline.decode([t]) for t in ids + want.token_ids]
        # Offsets index the whole text (echoed prompt included), chunk after chunk.
        assert offsets[0] == 0 and offsets[n] == len(prompt)
        assert all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], tokens))
        assert all(text[o : o + len(t)] == t for o, t in zip(offsets, tokens))
        assert len(tops) == n + len(want.token_ids) and tops[0] is None
        for i, (got_top, want_top) in enumerate(zip(tops[n:], want.top_logprobs)):
            # Keyed by text, as the API has it (ids with the same text collapse).
            expected = {offline.decode([t]): lp for t, lp in want_top}
            assert got_top.keys() == expected.keys(), f"token {i}"
            assert_logprobs_close([got_top[t] for t in expected], list(expected.values()))
    assert_drained(gw)


def test_completions_prompt_forms_echo(gw: Gateway, offline: Offline) -> None:
    client = gw.client()
    max_tokens = 8
    ids = [offline.encode(p) for p in PROMPTS]
    wants = offline.greedy(ids, max_tokens)

    # A list of strings: one choice per prompt, in order.
    resp = client.completions.create(
        model=MODEL,
        prompt=PROMPTS,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert [c.index for c in resp.choices] == list(range(len(PROMPTS)))
    assert extra(resp, "prompt_token_ids") == ids
    for c, want in zip(resp.choices, wants):
        assert extra(c, "token_ids") == want.token_ids
        assert c.text == offline.decode(want.token_ids)
    assert_usage(resp.usage, sum(map(len, ids)), sum(len(w.token_ids) for w in wants))

    # Token ids: list[int] and list[list[int]].
    resp = client.completions.create(
        model=MODEL, prompt=ids[0], max_tokens=max_tokens, temperature=0
    )
    assert resp.choices[0].text == offline.decode(wants[0].token_ids)
    assert_usage(resp.usage, len(ids[0]), len(wants[0].token_ids))
    resp = client.completions.create(
        model=MODEL, prompt=ids[1:3], max_tokens=max_tokens, temperature=0
    )
    assert [c.text for c in resp.choices] == [offline.decode(w.token_ids) for w in wants[1:3]]

    # echo: the prompt's text, then the completion (streaming too).
    resp = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=max_tokens, temperature=0, echo=True
    )
    assert resp.choices[0].text == PROMPTS[0] + offline.decode(wants[0].token_ids)
    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=max_tokens, temperature=0, echo=True, stream=True
    )
    assert collect(stream, chat=False).text == resp.choices[0].text
    assert_drained(gw)


def test_completions_n_and_seed(gw: Gateway) -> None:
    client = gw.client()
    kw: dict[str, Any] = dict(
        model=MODEL,
        prompt=PROMPTS[1],
        max_tokens=12,
        temperature=1.0,
        n=2,
        seed=1234,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    first = client.completions.create(**kw)
    second = client.completions.create(**kw)
    assert [c.index for c in first.choices] == [0, 1]
    a = [extra(c, "token_ids") for c in first.choices]
    assert all(len(t) == 12 for t in a)
    assert a == [extra(c, "token_ids") for c in second.choices], "seeded fan-out not reproducible"
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert a[0] != a[1], "the two choices of n=2 are identical"
    # The prompt is counted once, every choice's tokens are.
    assert_usage(first.usage, len(extra(first, "prompt_token_ids")), 24)

    # Streaming fan-out: the choices arrive interleaved, each by its index.
    stream = client.completions.create(**kw, stream=True)
    texts = ["", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in first.choices]
    assert_drained(gw)


def test_stop_strings_lengths_and_seeds(gw: Gateway, offline: Offline) -> None:
    client = gw.client()
    ids = offline.encode(PROMPTS[0])
    max_tokens = 24
    (want,) = offline.greedy([ids], max_tokens, ignore_eos=True)
    toks = want.token_ids
    full = offline.decode(toks)
    resp = client.completions.create(
        model=MODEL,
        prompt=ids,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert resp.choices[0].text == full

    # A stop string whose first occurrence straddles a token boundary.
    # (The tiny model's text has U+FFFD for invalid byte sequences: only the
    # stop string itself must be free of them.)
    stop_str, cut = None, -1
    for k in range(3, len(toks) - 1):
        head, longer = offline.decode(toks[:k]), offline.decode(toks[: k + 1])
        pos = len(head)  # the boundary between token k-1 and token k
        if not (full.startswith(head) and full.startswith(longer) and len(longer) > pos):
            continue
        for left, right in ((1, 1), (2, 1), (1, 2), (2, 2)):
            cand = full[pos - left : pos + right]
            if len(cand) < left + right or "\ufffd" in cand or not cand.strip():
                continue
            start = full.find(cand)
            if start < pos < start + len(cand):  # its first occurrence straddles it
                stop_str, cut = cand, start
                break
        if stop_str:
            break
    assert stop_str, f"no token boundary to put a stop string on in {full!r}"
    for stream in (False, True):
        kw: dict[str, Any] = dict(
            model=MODEL,
            prompt=ids,
            max_tokens=max_tokens,
            temperature=0,
            stop=["never-in-the-text", stop_str],
            extra_body={"ignore_eos": True},
        )
        if stream:
            got = collect(client.completions.create(**kw, stream=True), chat=False)
            text, finish = got.text, got.finish_reason
        else:
            c = client.completions.create(**kw).choices[0]
            text, finish = c.text, c.finish_reason
        assert text == full[:cut], f"stop {stop_str!r} (stream={stream}): {text!r}"
        assert finish == "stop"

    # max_tokens ends with "length".
    c = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count to ten."}],
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    ).choices[0]
    assert c.finish_reason == "length" and len(extra(c, "token_ids")) == 5

    # Same seed, same sample; another seed, (very likely) another one.
    def sample(seed: int) -> str:
        return (
            client.completions.create(
                model=MODEL,
                prompt=PROMPTS[2],
                max_tokens=16,
                temperature=1.0,
                seed=seed,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .text
        )

    s1, s2, s3 = sample(7), sample(7), sample(8)
    assert s1 == s2
    assert s1 != s3
    assert_drained(gw)


# -- concurrency and disconnects ------------------------------------------------------


async def _stream_one(
    client: openai.AsyncOpenAI, prompt: str, max_tokens: int, ignore_eos: bool = False
) -> Streamed:
    stream = await client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": ignore_eos},
    )
    out = Streamed()
    async for chunk in stream:
        out.chunks += 1
        _add_chunk(out, chunk, chat=False)
    return out


def _stream_all(gw: Gateway, prompts: list[str], max_tokens: int) -> list[Streamed]:
    """Stream every prompt at once (greedy), each on its own connection."""

    async def run() -> list[Streamed]:
        client = gw.aclient()
        try:
            return await asyncio.gather(*(_stream_one(client, p, max_tokens) for p in prompts))
        finally:
            await client.close()

    return asyncio.run(run())


def test_concurrent_streams(gw: Gateway, offline: Offline) -> None:
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} number {i}" for i in range(32)]
    max_tokens = 12
    wants = offline.greedy([offline.encode(p) for p in prompts], max_tokens)
    results = _stream_all(gw, prompts, max_tokens)
    for p, got, want in zip(prompts, results, wants):
        assert got.prompt_token_ids == want.prompt_token_ids, p
        assert got.token_ids == want.token_ids, p
        assert got.text == offline.decode(want.token_ids), p
        assert got.finish_reason == stopped_or_length(want, max_tokens), p
    assert_drained(gw)


def test_disconnected_streams_are_aborted(gw: Gateway, offline: Offline) -> None:
    """Clients that close their stream after two chunks: the gateway aborts
    their requests on both workers at once, while other clients finish."""
    long_tokens = CONTEXT - 64  # would take many seconds to run out
    max_tokens = 12

    async def quit_early(client: openai.AsyncOpenAI, prompt: str) -> int:
        stream = await client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=long_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        n = 0
        async for _ in stream:
            n += 1
            if n == 2:
                break
        await stream.close()
        return n

    async def wave(
        quitters: list[str], stayers: list[str]
    ) -> tuple[list[int], list[Streamed], float]:
        client = gw.aclient()
        try:
            q = asyncio.gather(*(quit_early(client, p) for p in quitters))
            s = asyncio.gather(*(_stream_one(client, p, max_tokens) for p in stayers))
            counts = await q
            left_at = time.monotonic()
            return counts, await s, left_at
        finally:
            await client.close()

    for w in range(2):
        quitters = [f"{PROMPTS[i % len(PROMPTS)]} quitter {w}.{i}" for i in range(16)]
        stayers = [f"{PROMPTS[i % len(PROMPTS)]} stayer {w}.{i}" for i in range(8)]
        wants = offline.greedy([offline.encode(p) for p in stayers], max_tokens)
        counts, results, left_at = asyncio.run(wave(quitters, stayers))
        assert counts == [2] * len(quitters)
        for p, got, want in zip(stayers, results, wants):
            assert got.token_ids == want.token_ids, p
            assert got.text == offline.decode(want.token_ids), p
        # Aborted, not run to completion: nothing left in flight soon after
        # the quitters left (their requests would need far longer to finish).
        assert_drained(gw, timeout=max(0.1, ABORT_DEADLINE_S - (time.monotonic() - left_at)))


@dataclass
class _LocalState(GatewayState):
    """The real app state with the model facts read from the model dir (no
    workers to ask)."""

    model_dir: str = ""

    async def load_model_facts(self) -> None:
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        self.model_name, self.context_length = MODEL, CONTEXT


class _EndlessDispatcher:
    """Stands in for the workers: every request streams one token every few
    milliseconds until it is closed (the gateway aborting it). It ignores
    cancellation, as the worker client does whenever a cancel races a token
    (``asyncio.wait_for`` on Python 3.11 then returns the token instead of
    raising): only closing the stream ends it."""

    def __init__(self) -> None:
        self.started = 0
        self.open = 0
        self.stopped = False
        """Set at teardown: ends even the streams the gateway leaked."""

    async def stream(
        self, prompt_ids: list[int], spec: Any, request_id: str | None = None
    ) -> AsyncIterator[TokenDelta]:
        self.started += 1
        self.open += 1
        try:
            while not self.stopped:
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.sleep(0.002)
                yield TokenDelta("fake", [prompt_ids[0]], [-1.0])
        finally:
            self.open -= 1

    async def prune(self) -> None:
        pass

    async def connect_all(self) -> None:
        pass

    async def close(self) -> None:
        pass


@contextlib.contextmanager
def _in_process_gateway(
    model_dir: str, config: GatewayConfig, dispatcher: _EndlessDispatcher
) -> Iterator[str]:
    """The gateway app over ``dispatcher``, served by uvicorn in a thread; yields its URL."""
    router = Router(RouterConfig())
    state = _LocalState(config, router, HealthChecker(router), dispatcher, model_dir=model_dir)  # type: ignore[arg-type]
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            build_app(state),
            host="127.0.0.1",
            port=port,
            log_level="warning",
            timeout_graceful_shutdown=5,
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "in-process gateway down"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        dispatcher.stopped = True
        server.should_exit = True
        thread.join(30)
        assert not thread.is_alive(), "the in-process gateway did not stop"


def test_disconnect_closes_the_stream_in_process(model_dir: str) -> None:
    """The gateway app itself (middleware, SSE generator, choice merging) with
    fake endless worker streams that lose cancellations, served by uvicorn in a
    thread: every stream whose client disconnects is still closed at once. (With
    real workers the lost cancel is a race, hit in a fraction of disconnects.)"""
    dispatcher = _EndlessDispatcher()
    with _in_process_gateway(model_dir, GatewayConfig(api_key=API_KEY), dispatcher) as base:

        async def quit_early(client: openai.AsyncOpenAI, i: int) -> None:
            stream = await client.completions.create(
                model=MODEL, prompt=f"disconnect {i}", max_tokens=400, stream=True
            )
            n = 0
            async for _ in stream:
                n += 1
                if n == 2:
                    break
            await stream.close()

        async def run() -> None:
            client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0)
            try:
                for _ in range(3):
                    await asyncio.gather(*(quit_early(client, i) for i in range(16)))
                    deadline = time.monotonic() + 2.0
                    while dispatcher.open:
                        assert time.monotonic() < deadline, (
                            f"{dispatcher.open} streams still open after their clients left"
                        )
                        await asyncio.sleep(0.01)
            finally:
                await client.close()

        asyncio.run(run())
        assert dispatcher.started == 48


def test_request_timeout_ends_every_request(model_dir: str) -> None:
    """Requests whose workers never finish end at --request-timeout-s: 504 in
    the OpenAI error body, or an error event and [DONE] on a stream; their
    worker streams are closed."""
    dispatcher = _EndlessDispatcher()
    timeout_s = 0.5
    config = GatewayConfig(request_timeout_s=timeout_s)
    with _in_process_gateway(model_dir, config, dispatcher) as base:
        body = {"model": MODEL, "prompt": "forever", "max_tokens": 400}
        t0 = time.monotonic()
        resp = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
        assert resp.status_code == 504, resp.text
        assert resp.json()["error"]["code"] == "timeout"
        assert time.monotonic() - t0 < timeout_s + 5

        t0 = time.monotonic()
        resp = httpx.post(f"{base}/v1/completions", json={**body, "stream": True}, timeout=30)
        events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
        assert time.monotonic() - t0 < timeout_s + 5
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "timeout"
        assert len(events) > 3, "tokens streamed before the timeout"
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
        assert 'gateway_request_failures_total{kind="timeout"} 2' in metrics
        deadline = time.monotonic() + 2
        while dispatcher.open:
            assert time.monotonic() < deadline, "worker streams left open after the timeout"
            time.sleep(0.01)
        assert dispatcher.started == 2


# -- guards and plain endpoints -------------------------------------------------------


def test_auth(gw: Gateway) -> None:
    resp = httpx.get(f"{gw.url}/v1/models", timeout=10)
    assert resp.status_code == 401
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["code"] == "invalid_api_key" and "API key" in err["message"]
    with pytest.raises(openai.AuthenticationError) as e:
        gw.client(api_key="wrong").completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    # The admin API has its own key.
    resp = httpx.get(
        f"{gw.url}/admin/workers", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10
    )
    assert resp.status_code == 401


def test_models_health_metrics(gw: Gateway) -> None:
    models = gw.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(f"{gw.url}/health", timeout=10).status_code == 200

    def counts() -> tuple[int, int]:
        text = httpx.get(f"{gw.url}/metrics", timeout=10).text
        return (
            histogram_count(text, "gateway_time_to_first_token_seconds"),
            histogram_count(text, "gateway_inter_token_latency_seconds"),
        )

    ttft0, itl0 = counts()
    # Non-streamed requests count too: TTFT and ITL as the gateway saw the tokens.
    gw.client().completions.create(
        model=MODEL, prompt="Hi", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    ttft1, itl1 = counts()
    assert ttft1 == ttft0 + 1
    assert itl1 >= itl0 + 3
    ttft0, itl0 = ttft1, itl1
    stream = gw.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=6,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert len(list(stream)) > 2
    ttft1, itl1 = counts()
    assert ttft1 == ttft0 + 1
    assert itl1 >= itl0 + 4
    text = httpx.get(f"{gw.url}/metrics", timeout=10).text
    assert 'gateway_time_to_first_token_seconds_bucket{le="+Inf"}' in text
    assert "# TYPE gateway_inter_token_latency_seconds histogram" in text
    assert_drained(gw)


def test_request_guards(gw: Gateway, offline: Offline) -> None:
    client = gw.client()

    def bad(exc: type[openai.APIStatusError], **kw: Any) -> openai.APIStatusError:
        kw.setdefault("model", MODEL)
        create = client.chat.completions.create if "messages" in kw else client.completions.create
        with pytest.raises(exc) as e:
            create(**kw)
        return e.value

    e = bad(openai.NotFoundError, model="no-such-model", prompt="x", max_tokens=1)
    assert e.status_code == 404 and e.code == "model_not_found" and e.param == "model"
    e = bad(
        openai.NotFoundError, model="no-such-model", messages=[{"role": "user", "content": "x"}]
    )
    assert e.status_code == 404

    # Beyond the context window: the limit is in the message.
    e = bad(openai.BadRequestError, prompt="Hello world", max_tokens=CONTEXT)
    assert e.status_code == 400 and str(CONTEXT) in e.message
    e = bad(
        openai.BadRequestError,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=CONTEXT,
    )
    assert str(CONTEXT) in e.message

    # Empty prompt and messages.
    for prompt in ("", [], [[]]):
        e = bad(openai.BadRequestError, prompt=prompt, max_tokens=1)
        assert e.param == "prompt"
    e = bad(openai.BadRequestError, messages=[], max_tokens=1)
    assert e.param == "messages"

    # Invalid sampling values name their parameter.
    for param, value in (("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5)):
        e = bad(openai.BadRequestError, prompt="Hello", max_tokens=1, **{param: value})
        assert e.param == param, e.body
        e = bad(
            openai.BadRequestError,
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=1,
            **{param: value},
        )
        assert e.param == param, e.body

    # --max-prompt-tokens.
    long_ids = (offline.encode(PROMPTS[0]) * 50)[: MAX_PROMPT_TOKENS + 1]
    e = bad(openai.BadRequestError, prompt=long_ids, max_tokens=1)
    assert str(MAX_PROMPT_TOKENS) in e.message and e.param == "prompt"
    resp = client.completions.create(model=MODEL, prompt=long_ids[:-1], max_tokens=1)
    assert resp.usage.prompt_tokens == MAX_PROMPT_TOKENS

    # top_logprobs needs logprobs, and both stay within [0, 20].
    for kw in ({"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21}):
        e = bad(
            openai.BadRequestError,
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=1,
            **kw,
        )
        assert e.param == "top_logprobs", kw
    e = bad(openai.BadRequestError, prompt="Hello", max_tokens=1, logprobs=21)
    assert e.param == "logprobs" and "20" in e.message

    # Token ids outside the vocabulary.
    e = bad(openai.BadRequestError, prompt=[1, 2, 10**6], max_tokens=1)
    assert e.param == "prompt"
    assert_drained(gw)


def test_body_limit(gw: Gateway) -> None:
    limit = str(MAX_BODY_BYTES)
    with pytest.raises(openai.BadRequestError) as e:
        gw.client().completions.create(model=MODEL, prompt="a" * (MAX_BODY_BYTES + 1), max_tokens=1)
    assert limit in e.value.message

    # A chunked body (no Content-Length) is held to the limit too.
    def body() -> Iterator[bytes]:
        yield b'{"model": "' + MODEL.encode() + b'", "max_tokens": 1, "prompt": "'
        for _ in range(MAX_BODY_BYTES // 1000 + 1):
            yield b"a" * 1000
        yield b'"}'

    resp = httpx.post(
        f"{gw.url}/v1/completions",
        content=body(),
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
        timeout=30,
    )
    assert resp.status_code == 400, resp.text
    assert limit in resp.json()["error"]["message"]

    # A chunked body under the limit still works.
    def small() -> Iterator[bytes]:
        yield b'{"model": "' + MODEL.encode() + b'", "max_tokens": 2, '
        yield b'"prompt": "Hello world", "temperature": 0}'

    resp = httpx.post(
        f"{gw.url}/v1/completions",
        content=small(),
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
        timeout=30,
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 2
    assert_drained(gw)


def test_bad_values_are_400s_on_a_kept_connection(gw: Gateway, offline: Offline) -> None:
    """Values the request plane cannot carry or the engine cannot take are
    refused before anything reaches the workers, and the HTTP/1.1 connection
    stays usable: the good request after them, on the same connection, is
    served by the real workers."""
    auth = {"Authorization": f"Bearer {API_KEY}"}
    good = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0}
    bad = [
        ({"stop_token_ids": [10**20]}, "stop_token_ids"),
        ({"top_k": 2**64}, "top_k"),
        ({"seed": 2**64}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"prompt": [[False]]}, "prompt"),
    ]
    host, port = gw.url.removeprefix("http://").split(":")
    requests = [RawRequest.post_json("/v1/completions", {**good, **f}, auth) for f, _ in bad]
    requests.append(RawRequest.post_json("/v1/completions", good, auth))
    *refused, served = exchange(host, int(port), requests)
    for resp, (fields, param) in zip(refused, bad):
        assert resp.status == 400, (fields, resp.body)
        assert resp.json()["error"]["param"] == param, resp.body
    assert served.status == 200, served.body
    want = offline.greedy([offline.encode(PROMPTS[0])], 3)[0]
    assert served.json()["choices"][0]["text"] == offline.decode(want.token_ids)
    assert_drained(gw)


# -- admin: workers joining, leaving and dying ------------------------------------------


@pytest.fixture(scope="module")
def extra_decode(
    gw: Gateway, model_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Worker]:
    """A second decode worker (own process group, so it can be SIGKILLed),
    started when a test needs it; not registered with the gateway."""
    log_dir = tmp_path_factory.mktemp("gateway-api-extra")
    spec = _worker_spec(log_dir, "decode-extra", "decode", model_dir)
    with launch_workers([spec], new_session=True) as (w,):
        LIVE_LOGS.append(w.log_path)
        gw.extra_workers.append(w)
        try:
            yield w
        finally:
            gw.extra_workers.remove(w)
            with contextlib.suppress(ValueError):
                LIVE_LOGS.remove(w.log_path)
            if w.alive:
                w.kill()


def _transfers(w: Worker) -> int:
    """Requests the decode worker took KV for (one per disaggregated request)."""
    return w.stats()["transfers_ok"]


def _burst(gw: Gateway, offline: Offline, n: int, tag: str) -> None:
    """``n`` concurrent greedy requests, all answered correctly."""
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {tag} {i}" for i in range(n)]
    max_tokens = 24
    wants = offline.greedy([offline.encode(p) for p in prompts], max_tokens)
    for p, got, want in zip(prompts, _stream_all(gw, prompts, max_tokens), wants):
        assert got.token_ids == want.token_ids, p
        assert got.text == offline.decode(want.token_ids), p


def test_admin_add_and_remove_worker(gw: Gateway, offline: Offline, extra_decode: Worker) -> None:
    resp = gw.admin("POST", "/admin/workers", json={"url": extra_decode.url})
    assert resp.status_code == 200, resp.text
    assert resp.json()["role"] == "decode"
    assert extra_decode.url in gw.gateway_workers()
    assert httpx.post(f"{gw.url}/admin/workers", json={"url": "x"}, timeout=10).status_code == 401
    bad = gw.admin("POST", "/admin/workers", json={"url": f"http://127.0.0.1:{free_port()}"})
    assert bad.status_code == 400

    # least_load: while the first decode worker is busy, the new one takes requests.
    before = (_transfers(gw.decode), _transfers(extra_decode))
    _burst(gw, offline, 8, "added")
    after = (_transfers(gw.decode), _transfers(extra_decode))
    assert after[1] > before[1], "the added worker got no request"
    assert after[0] > before[0], "the first worker got no request"
    assert sum(after) - sum(before) == 8

    resp = gw.admin("DELETE", "/admin/workers", params={"url": extra_decode.url})
    assert resp.status_code == 200, resp.text
    assert extra_decode.url not in gw.gateway_workers()
    assert gw.admin("DELETE", "/admin/workers", params={"url": extra_decode.url}).status_code == 404
    before = (_transfers(gw.decode), _transfers(extra_decode))
    _burst(gw, offline, 8, "removed")
    assert _transfers(extra_decode) == before[1], "a removed worker got requests"
    assert _transfers(gw.decode) == before[0] + 8
    assert_drained(gw)


def test_removed_worker_finishes_its_requests(
    gw: Gateway, offline: Offline, extra_decode: Worker
) -> None:
    """A worker removed while it serves requests takes no new ones, finishes
    the ones it has (correct text), and then leaves the pool."""
    resp = gw.admin("POST", "/admin/workers", json={"url": extra_decode.url})
    assert resp.status_code == 200, resp.text
    max_tokens = 600  # seconds of decoding: removed mid-request even on a slow machine
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} draining {i}" for i in range(8)]
    wants = offline.greedy([offline.encode(p) for p in prompts], max_tokens, ignore_eos=True)

    async def run() -> list[Streamed]:
        client = gw.aclient()
        try:
            tasks = [
                asyncio.create_task(_stream_one(client, p, max_tokens, ignore_eos=True))
                for p in prompts
            ]
            deadline = time.monotonic() + 30
            while extra_decode.stats()["running"] == 0:
                assert time.monotonic() < deadline, "the added worker never got a request"
                await asyncio.sleep(0.02)
            resp = await asyncio.to_thread(
                gw.admin, "DELETE", "/admin/workers", params={"url": extra_decode.url}
            )
            assert resp.status_code == 200, resp.text
            assert resp.json()["outstanding_requests"] > 0, "removed after its requests ended"
            return await asyncio.gather(*tasks)
        finally:
            await client.close()

    for p, got, want in zip(prompts, asyncio.run(run()), wants):
        assert got.token_ids == want.token_ids, p
        assert got.finish_reason == "length"
    assert extra_decode.url not in gw.gateway_workers()
    assert_drained(gw)


def test_short_prompts_skip_prefill(gw: Gateway, offline: Offline, tmp_path: Path) -> None:
    """With --skip-prefill-threshold, prompts up to it go to a decode worker
    alone (it prefills them itself): no KV moves and the tokens are the same."""
    args = ["--prefill", gw.prefill.url, "--decode", gw.decode.url]
    args += ["--skip-prefill-threshold", "64", "--log-level", "warning"]
    env = {CLUSTER_TOKEN_ENV: WORKER_ENV[CLUSTER_TOKEN_ENV]}
    log_path = tmp_path / "gateway-skip.log"
    with launch_gateway(args, log_path, GATEWAY_START_TIMEOUT_S, env) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        transfers = _transfers(gw.decode)
        for prompt in PROMPTS:
            ids = offline.encode(prompt)
            assert len(ids) <= 64
            (want,) = offline.greedy([ids], 16)
            resp = client.completions.create(
                model=MODEL,
                prompt=ids,
                max_tokens=16,
                temperature=0,
                extra_body={"return_token_ids": True},
            )
            assert extra(resp.choices[0], "token_ids") == want.token_ids, prompt
        assert _transfers(gw.decode) == transfers, "a short prompt went through prefill"
        long_ids = (offline.encode(PROMPTS[0]) * 8)[:100]
        client.completions.create(model=MODEL, prompt=long_ids, max_tokens=2)
        assert _transfers(gw.decode) == transfers + 1, "a long prompt skipped prefill"
    assert_drained(gw)


def test_killed_worker_leaves_pool(gw: Gateway, offline: Offline, extra_decode: Worker) -> None:
    resp = gw.admin("POST", "/admin/workers", json={"url": extra_decode.url})
    assert resp.status_code == 200, resp.text
    try:
        _burst(gw, offline, 4, "before-kill")
        assert_drained(gw)
        extra_decode.kill()  # SIGKILL, front and engine at once
        # Before the health checker can notice, requests routed to the dead
        # worker find no connection and go to the live one.
        before = _transfers(gw.decode)
        _burst(gw, offline, 8, "at-kill")
        assert _transfers(gw.decode) == before + 8
        deadline = time.monotonic() + 10 * HEALTH_INTERVAL_S + 5
        while gw.gateway_workers()[extra_decode.url]["healthy"]:
            assert time.monotonic() < deadline, "the health checker never noticed the dead worker"
            time.sleep(HEALTH_INTERVAL_S / 2)
        metrics = httpx.get(f"{gw.url}/metrics", timeout=10).text
        assert f'gateway_worker_healthy{{url="{extra_decode.url}",role="decode"}} 0' in metrics
        before = _transfers(gw.decode)
        _burst(gw, offline, 8, "after-kill")
        assert _transfers(gw.decode) == before + 8
        assert httpx.get(f"{gw.url}/health", timeout=10).status_code == 200
    finally:
        gw.admin("DELETE", "/admin/workers", params={"url": extra_decode.url})
    assert extra_decode.url not in gw.gateway_workers()
    assert_drained(gw)


def test_worker_registers_itself(
    gw: Gateway, model_dir: str, offline: Offline, tmp_path: Path
) -> None:
    """A worker started with --register joins its pool and takes traffic."""
    cmd, port, log_path, env = _worker_spec(tmp_path, "decode-registered", "decode", model_dir)
    cmd += ["--register", gw.url, "--register-key", ADMIN_KEY]
    with launch_workers([(cmd, port, log_path, env)]) as (w,):
        LIVE_LOGS.append(w.log_path)
        gw.extra_workers.append(w)
        try:
            deadline = time.monotonic() + 30
            while w.url not in gw.gateway_workers():
                assert time.monotonic() < deadline, f"never registered:\n{log_tail(w.log_path)}"
                time.sleep(0.1)
            assert gw.gateway_workers()[w.url]["role"] == "decode"
            before = _transfers(w)
            _burst(gw, offline, 8, "registered")
            assert _transfers(w) > before, "the registered worker got no request"
            resp = gw.admin("DELETE", "/admin/workers", params={"url": w.url})
            assert resp.status_code == 200, resp.text
            assert_drained(gw)
        finally:
            gw.extra_workers.remove(w)
            LIVE_LOGS.remove(w.log_path)


# -- command line ---------------------------------------------------------------------


def test_help_lists_every_flag() -> None:
    from gateway.__main__ import build_parser

    proc = subprocess.run(
        [sys.executable, "-m", "gateway", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        env={**os.environ, "COLUMNS": "100"},
    )
    assert proc.returncode == 0, proc.stderr
    flags = {s for a in build_parser()._actions for s in a.option_strings}
    flags |= {
        "--port",
        "--prefill",
        "--decode",
        "--api-key",
        "--admin-key",
        "--max-body-bytes",
        "--max-prompt-tokens",
        "--health-interval-s",
        "--health-timeout-s",
        "--worker-timeout-s",
        "--log-level",
    }
    missing = sorted(
        f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", proc.stdout)
    )
    assert not missing, f"--help does not mention {missing}"


def test_flag_defaults_are_the_config_defaults() -> None:
    from gateway.__main__ import _embedded_config, build_parser
    from gateway.embedded import EMBEDDED_SETTINGS, EmbeddedConfig
    from worker.config import WorkerConfig

    args = build_parser().parse_args([])
    gw, rc, em = GatewayConfig(), RouterConfig(), EmbeddedConfig()
    for cfg, names in (
        (gw, ("host", "port", "served_model_name", "api_key", "admin_key", "request_timeout_s")),
        (gw, ("worker_timeout_s", "connect_timeout_s", "max_body_bytes", "max_prompt_tokens")),
        (gw, ("log_level",)),
        (rc, ("prefill_policy", "decode_policy", "skip_prefill_threshold")),
        (rc, ("health_interval_s", "health_timeout_s")),
        (em, ("prefill_device", "decode_device")),
    ):
        for name in names:
            assert getattr(args, name) == getattr(cfg, name), name
    # The embedded workers' flags are the workers' own, with their defaults.
    worker = WorkerConfig()
    for name in EMBEDDED_SETTINGS:
        owner = worker.engine if hasattr(worker.engine, name) else worker
        assert getattr(args, name) == getattr(owner, name), name
    assert _embedded_config(args) == em
    assert tuple(args.prefill) == gw.prefill and tuple(args.decode) == gw.decode
