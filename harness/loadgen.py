"""The load generator of the serving benchmark (``python -m benchmarks.bench_serving``):
workloads, arrival times, sending streamed requests and timing their chunks,
the metrics vLLM's and SGLang's serving benchmarks report, and goodput
sweeps (one run per request rate or concurrency, each held to the p99 of
service-level objectives).

The client must not add latency of its own: a chunk's time is when its bytes
arrived, read in the socket's callback by a lean HTTP/1.1 client
(``harness/http_stream.py``; ``http_client="httpx"`` for the general one);
SSE and JSON are parsed after the run; request bodies are encoded before it;
several client processes can split very many streams over several event loops.
Torch-free.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import itertools
import json
import math
import multiprocessing
import os
import random
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from multiprocessing import connection as mp_connection
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import numpy as np

from harness.http_stream import Response, StreamClient, StreamError, sse_lines

ENDPOINTS = {"openai-completions": "/v1/completions", "openai-chat": "/v1/chat/completions"}
FIRST_TOKEN_ID = 10
"""Random token-id prompts draw from [FIRST_TOKEN_ID, --vocab-size): low ids are
special tokens in many vocabularies (the built-in tiny model's are 0-2)."""
SLO_METRICS = ("ttft", "tpot", "e2el")
STAT_METRICS = ("ttft", "tpot", "itl", "e2el")

# Filler for text prompts: one word is roughly one token for most tokenizers.
_WORD_LIST = """
time year people way day man thing woman life child world school state family
student group country problem hand part place case week company system program
question work government number night point home water room mother area money
story fact month lot right study book eye job word business issue side kind head
house service friend father power hour game line end member law car city community
name president team minute idea kid body information back parent face others level
office door health person art war history party result change morning reason
research girl guy moment air teacher force education foot boy age policy music
market sense nation plan college interest death experience effect use class control
care field development role effort rate heart drug show leader light voice wife
police mind price report decision son view relationship town road arm difference
value building action model season society tax director position player record
paper space ground form event official matter center couple site project activity
star table need court oil situation cost industry figure street image phone data
picture practice piece land product doctor wall patient worker news test movie north
love support technology step baby computer type attention film tree source organization
hair window evidence population truth song energy stone river garden bridge cloud
"""
WORDS = _WORD_LIST.split()


# -- workload -------------------------------------------------------------------


@dataclass(frozen=True)
class RequestSpec:
    prompt: str | list[int]
    prompt_len: int
    """Intended prompt length: tokens for token-id prompts, words for text
    (only used when the server reports no usage)."""
    output_len: int
    """max_tokens of the request."""


def prompt_kind(args: argparse.Namespace, chat: bool) -> str:
    """token-ids or text; "auto" is token-ids for completions, text for chat."""
    kind = args.random_prompt_kind
    if kind == "auto":
        return "text" if chat else "token-ids"
    if kind == "token-ids" and chat:
        raise ValueError("token-id prompts need --backend openai-completions; use text prompts")
    return kind


def random_lengths(n: int, length: int, ratio: float, rng: random.Random) -> list[int]:
    """n lengths uniform in [max(1, floor(length * ratio)), length] (SGLang's convention)."""
    if length < 1 or not 0.0 <= ratio <= 1.0:
        raise ValueError(f"need length >= 1 and 0 <= range ratio <= 1, got {length}, {ratio}")
    low = max(1, math.floor(length * ratio))
    return [rng.randint(low, length) for _ in range(n)]


def random_prompt(kind: str, length: int, vocab_size: int, rng: random.Random) -> str | list[int]:
    if kind == "text":
        return " ".join(rng.choice(WORDS) for _ in range(length))
    if vocab_size <= FIRST_TOKEN_ID:
        raise ValueError(f"--vocab-size must be > {FIRST_TOKEN_ID}, got {vocab_size}")
    return [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(length)]


def join_prompts(a: str | list[int], b: str | list[int]) -> str | list[int]:
    if isinstance(a, str) and isinstance(b, str):
        return f"{a} {b}"
    assert isinstance(a, list) and isinstance(b, list)
    return a + b


def warmup_specs(requests: Sequence[RequestSpec], count: int, seed: int) -> list[RequestSpec]:
    """``count`` warm-up requests shaped like the measured ones in turn (the
    same prompt and output lengths, token ids or text) but drawn anew, so that
    none shares a prefix with a measured prompt: a warm-up that sent measured
    prompts would leave them in the server's prefix cache, and their TTFT would
    be a cache hit's. Token ids come from the range the measured prompt uses."""
    return redrawn(requests, count, random.Random(f"warmup-{seed}"))


def redrawn(requests: Sequence[RequestSpec], count: int, rng: random.Random) -> list[RequestSpec]:
    """``count`` requests shaped like ``requests`` in turn, their prompts drawn
    anew from ``rng`` (see ``warmup_specs``)."""
    specs = []
    for i in range(count):
        src = requests[i % len(requests)]
        if isinstance(src.prompt, str):
            prompt: str | list[int] = random_prompt("text", len(src.prompt.split()), 0, rng)
        else:
            top = max(src.prompt, default=FIRST_TOKEN_ID) + 1
            prompt = random_prompt("token-ids", len(src.prompt), max(top, FIRST_TOKEN_ID + 2), rng)
        specs.append(RequestSpec(prompt, src.prompt_len, src.output_len))
    return specs


def sample_random(args: argparse.Namespace, kind: str, rng: random.Random) -> list[RequestSpec]:
    n, ratio = args.num_prompts, args.random_range_ratio
    ins = random_lengths(n, args.random_input_len, ratio, rng)
    outs = random_lengths(n, args.random_output_len, ratio, rng)
    return [
        RequestSpec(random_prompt(kind, i, args.vocab_size, rng), i, o) for i, o in zip(ins, outs)
    ]


def sample_shared_prefix(
    args: argparse.Namespace, kind: str, rng: random.Random
) -> list[RequestSpec]:
    specs = []
    for _ in range(args.gsp_num_groups):
        system = random_prompt(kind, args.gsp_system_prompt_len, args.vocab_size, rng)
        for _ in range(args.gsp_prompts_per_group):
            question = random_prompt(kind, args.gsp_question_len, args.vocab_size, rng)
            length = args.gsp_system_prompt_len + args.gsp_question_len
            specs.append(RequestSpec(join_prompts(system, question), length, args.gsp_output_len))
    # Interleave the groups, as real traffic would, instead of sending them in blocks.
    rng.shuffle(specs)
    return specs


def sample_sharegpt(args: argparse.Namespace, rng: random.Random) -> list[RequestSpec]:
    if args.dataset_path is None:
        raise ValueError("--dataset-name sharegpt needs --dataset-path FILE")
    path = Path(args.dataset_path)
    if not path.is_file():
        raise FileNotFoundError(f"ShareGPT file not found: {path} (--dataset-path)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    specs = []
    for conv in data:
        turns = conv.get("conversations") or conv.get("conversation") or []
        pair = next(
            (
                (a["value"], b["value"])
                for a, b in zip(turns, turns[1:])
                if a.get("from") == "human" and b.get("from") == "gpt"
            ),
            None,
        )
        if pair is None or not pair[0].strip():
            continue
        prompt, reply = pair
        out_len = args.sharegpt_output_len or max(1, len(reply.split()))
        specs.append(RequestSpec(prompt, len(prompt.split()), out_len))
    if not specs:
        raise ValueError(f"{path} holds no conversation with a human turn followed by a gpt turn")
    rng.shuffle(specs)
    if len(specs) < args.num_prompts:
        print(f"warning: {path} has only {len(specs)} usable conversations", file=sys.stderr)
    return specs[: args.num_prompts]


def sample_requests(args: argparse.Namespace, chat: bool = False) -> list[RequestSpec]:
    """The workload of ``args`` (the flags of ``add_workload_args``; ``chat``:
    for the chat API), deterministic for a given ``--seed``."""
    rng = random.Random(args.seed)
    if args.dataset_name == "sharegpt":
        return sample_sharegpt(args, rng)
    sample = {"random": sample_random, "shared-prefix": sample_shared_prefix}[args.dataset_name]
    return sample(args, prompt_kind(args, chat), rng)


def add_workload_args(ds: Any) -> None:
    """The workload flags (``sample_requests`` reads them) on a parser or group."""
    ds.add_argument(
        "--dataset-name",
        choices=["random", "shared-prefix", "sharegpt"],
        default="random",
        help="random: random prompts of --random-* lengths; shared-prefix: groups of prompts "
        "sharing a system prompt (--gsp-*); sharegpt: conversations from --dataset-path "
        "(default: %(default)s)",
    )
    ds.add_argument(
        "--num-prompts",
        type=int,
        default=1000,
        help="requests to send (random, sharegpt; shared-prefix sends num-groups x "
        "prompts-per-group) (default: %(default)s)",
    )
    ds.add_argument(
        "--seed",
        type=int,
        default=0,
        help="fixes prompts, lengths and arrival times (default: %(default)s)",
    )
    ds.add_argument(
        "--random-input-len",
        type=int,
        default=1024,
        help="prompt length in tokens (words for text prompts) (default: %(default)s)",
    )
    ds.add_argument(
        "--random-output-len", type=int, default=128, help="max_tokens (default: %(default)s)"
    )
    ds.add_argument(
        "--random-range-ratio",
        type=float,
        default=1.0,
        help="input and output lengths are uniform in [max(1, floor(LEN * RATIO)), LEN] "
        "(SGLang's convention; 1.0 = fixed lengths, 0.0 = anything up to LEN; vLLM's newer "
        "[LEN*(1-R), LEN*(1+R)] differs) (default: %(default)s)",
    )
    ds.add_argument(
        "--random-prompt-kind",
        choices=["auto", "token-ids", "text"],
        default="auto",
        help="token-ids: prompts are lists of ids uniform in "
        f"[{FIRST_TOKEN_ID}, --vocab-size), exact length (completions only); text: words from "
        "a built-in list, length counted in words (about one token each); auto: token-ids for "
        "completions, text for chat. Also used by shared-prefix (default: %(default)s)",
    )
    ds.add_argument(
        "--vocab-size",
        type=int,
        default=512,
        help="token-id prompts stay below this id (default: %(default)s, the built-in tiny "
        "model's vocab; raise it for real models)",
    )
    ds.add_argument(
        "--gsp-num-groups",
        type=int,
        default=64,
        help="shared-prefix: number of system prompts (default: %(default)s)",
    )
    ds.add_argument(
        "--gsp-prompts-per-group",
        type=int,
        default=16,
        help="shared-prefix: questions per system prompt (default: %(default)s)",
    )
    ds.add_argument(
        "--gsp-system-prompt-len",
        type=int,
        default=2048,
        help="shared-prefix: system prompt length, tokens or words (default: %(default)s)",
    )
    ds.add_argument(
        "--gsp-question-len",
        type=int,
        default=128,
        help="shared-prefix: question length, tokens or words (default: %(default)s)",
    )
    ds.add_argument(
        "--gsp-output-len",
        type=int,
        default=256,
        help="shared-prefix: max_tokens (default: %(default)s)",
    )
    ds.add_argument(
        "--dataset-path",
        default=None,
        help='sharegpt: local JSON file, a list of {"conversations": [{"from": "human"|"gpt", '
        '"value": ...}, ...]}; the first human turn followed by a gpt turn is the prompt',
    )
    ds.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="sharegpt: max_tokens of every request (default: the gpt reply's word count)",
    )


def arrival_gaps(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Pauses (s) after each of n requests. Gamma-distributed with mean 1/rate;
    burstiness 1.0 is a Poisson process, lower is burstier; rate inf: no pauses."""
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"request rate and burstiness must be > 0, got {rate}, {burstiness}")
    scale = 1.0 / (rate * burstiness)
    return [rng.gammavariate(burstiness, scale) for _ in range(n)]


# -- sending --------------------------------------------------------------------

HTTP_CLIENTS = ("raw", "httpx")
DEFER_PARSE_BYTES = 256 * 2**20
"""Responses are parsed after the run (off the timing path) until they hold this
many bytes; past it, each one is parsed as it completes, to bound memory."""
START_DELAY_S = 0.05
"""Client processes start sending this long after the last one is ready."""
CONCURRENCY_PER_PROCESS = 512
"""Streams one client process is given by default. Measured against the fake
server (harness/fake_openai_server.py, 12 ms between tokens, a 16-core host;
benchmarks/results/client-overhead-processes-h200-host-20261201.json): one process noticed first tokens 0.2 / 0.4 / 0.8 ms late at 64 / 256 / 512
streams; two or four processes were later (likely because a busy event loop
never sleeps, while several less busy ones are each woken up for their chunks)."""


@dataclass(frozen=True)
class BenchConfig:
    base_url: str
    model: str
    requests: list[RequestSpec]
    backend: str = "openai-completions"
    endpoint: str | None = None
    """Path under base_url; None: the backend's default."""
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    ignore_eos: bool = False
    api_key: str | None = None
    request_timeout_s: float = 3600.0
    warmup_requests: int = 0
    """Requests sent and awaited before the timed ones: ``warmup_specs``, never
    the measured prompts themselves."""
    seed: int = 0
    show_progress: bool = False
    http_client: str = "raw"
    """raw (harness/http_stream.py; http:// only) or httpx."""
    num_client_processes: int = 1
    """Client processes that split the requests (see ``benchmark``)."""

    @functools.cached_property
    def warmup(self) -> list[RequestSpec]:
        return warmup_specs(self.requests, self.warmup_requests, self.seed)

    @property
    def path(self) -> str:
        return self.endpoint or ENDPOINTS[self.backend]

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.path

    @property
    def chat(self) -> bool:
        return self.backend == "openai-chat"


@dataclass
class RequestOutcome:
    prompt_len: int
    success: bool = False
    error: str = ""
    start: float = 0.0
    """perf_counter() when the request was sent (CLOCK_MONOTONIC on Linux: the
    same clock in every client process)."""
    end: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    chunks: int = 0
    """Chunks with non-empty text."""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    """From the usage chunk; None when the server sent none."""


@dataclass
class BenchmarkResult:
    outcomes: list[RequestOutcome]
    duration: float
    """Seconds from the first send to the last finish."""
    processes: int = 1
    """Client processes that sent the requests."""


def request_payload(spec: RequestSpec, config: BenchConfig) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": config.model,
        "max_tokens": spec.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.chat:
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    if config.ignore_eos:
        body["ignore_eos"] = True
    return body


def chunk_text(chunk: dict[str, Any], chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if chat:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


def error_text(error: Any) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


def read_events(out: RequestOutcome, lines: Iterable[tuple[float, bytes]], chat: bool) -> None:
    """Fill ``out`` (timings, usage, or an error) from an SSE stream's lines,
    each with the time it arrived."""
    last = out.start
    for now, line in lines:
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        chunk = json.loads(data)
        if chunk.get("error"):
            out.error = error_text(chunk["error"])
            return
        if usage := chunk.get("usage"):
            out.prompt_tokens = usage.get("prompt_tokens")
            out.completion_tokens = usage.get("completion_tokens")
        if chunk_text(chunk, chat):
            if out.chunks == 0:
                out.ttft = now - out.start
            else:
                out.itl.append(now - last)
            last = now
            out.chunks += 1


def settle(out: RequestOutcome, resp: Response, chat: bool) -> None:
    """Turn a received response into the request's outcome."""
    out.end = resp.end
    out.latency = out.end - out.start
    if resp.status != 200:
        out.error = f"HTTP {resp.status}: {resp.body.decode(errors='replace')[:500]}"
    else:
        try:
            read_events(out, sse_lines(resp), chat)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            out.error = f"{type(e).__name__}: {e}"
    if not out.error and out.chunks == 0:
        out.error = "the stream carried no text"
    out.success = not out.error


class Sender:
    """Sends prepared requests and parses their responses later."""

    def __init__(self, config: BenchConfig) -> None:
        self.config = config
        self.headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self.unparsed: list[tuple[RequestOutcome, Response]] = []
        self.unparsed_bytes = 0

    def body(self, spec: RequestSpec) -> bytes:
        return json.dumps(request_payload(spec, self.config)).encode()

    def prepare(self, spec: RequestSpec) -> Any:
        """Everything a request needs before it is sent, built ahead of the run."""
        return self.body(spec)

    async def exchange(self, prepared: Any) -> Response:
        raise NotImplementedError

    async def send(self, spec: RequestSpec, prepared: Any) -> RequestOutcome:
        out = RequestOutcome(prompt_len=spec.prompt_len)
        out.start = time.perf_counter()
        try:
            resp = await self.exchange(prepared)
        except (StreamError, httpx.HTTPError, OSError) as e:
            out.end = time.perf_counter()
            out.latency = out.end - out.start
            out.error = f"{type(e).__name__}: {e}"
            return out
        # JSON waits until the run is over: parsing it now would delay the
        # arrival of other streams' chunks on this event loop.
        self.unparsed.append((out, resp))
        self.unparsed_bytes += resp.size
        if self.unparsed_bytes > DEFER_PARSE_BYTES:
            self.settle_all()
        return out

    def settle_all(self) -> None:
        for out, resp in self.unparsed:
            settle(out, resp, self.config.chat)
        self.unparsed.clear()
        self.unparsed_bytes = 0

    async def aclose(self) -> None:
        pass


class RawSender(Sender):
    """``harness/http_stream.py``: arrival times taken in the socket's read
    callback, no per-chunk work beyond HTTP framing."""

    def __init__(self, config: BenchConfig) -> None:
        super().__init__(config)
        self.client = StreamClient(config.base_url, config.request_timeout_s, self.headers)

    def prepare(self, spec: RequestSpec) -> bytes:
        return self.client.request_bytes(self.config.path, self.body(spec))

    async def exchange(self, prepared: bytes) -> Response:
        return await self.client.post(prepared)

    async def aclose(self) -> None:
        await self.client.aclose()


class HttpxSender(Sender):
    """httpx (also https://); arrival times taken as its byte iterator yields."""

    def __init__(self, config: BenchConfig) -> None:
        super().__init__(config)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        timeout = httpx.Timeout(config.request_timeout_s)
        self.client = httpx.AsyncClient(limits=limits, timeout=timeout)
        self.headers |= {"Content-Type": "application/json"}

    async def exchange(self, prepared: bytes) -> Response:
        out = Response()
        request = self.client.stream(
            "POST", self.config.url, content=prepared, headers=self.headers
        )
        async with request as resp:
            out.status = resp.status_code
            async for data in resp.aiter_bytes():
                out.times.append(time.perf_counter())
                out.pieces.append(data)
                # Leaving before the end of the body closes the connection.
                # Kept alive instead, httpx's pool hands out connections so
                # slowly at tens of streams that TTFT grows by seconds.
                if b"data: [DONE]" in data:
                    break
        out.end = time.perf_counter()
        return out

    async def aclose(self) -> None:
        await self.client.aclose()


def make_sender(config: BenchConfig) -> Sender:
    if config.http_client not in HTTP_CLIENTS:
        raise ValueError(f"unknown HTTP client {config.http_client!r}: one of {HTTP_CLIENTS}")
    return RawSender(config) if config.http_client == "raw" else HttpxSender(config)


class Progress:
    """``[  37/100]`` on stderr, rewritten in place."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self.width = len(str(total))

    def step(self) -> None:
        self.done += 1
        if self.enabled:
            end = "\n" if self.done == self.total else ""
            print(
                f"\r[{self.done:>{self.width}}/{self.total}]", end=end, file=sys.stderr, flush=True
            )


@dataclass(frozen=True)
class Share:
    """The part of a run that one client process sends."""

    indices: tuple[int, ...]
    """Positions in ``BenchConfig.requests``."""
    offsets: tuple[float, ...]
    """When to send each, in seconds from the common start."""
    max_concurrency: int | None
    warmup: tuple[int, ...]
    """Positions in ``BenchConfig.warmup`` of the requests to send (and await)
    before the start."""


def send_offsets(config: BenchConfig) -> list[float]:
    """Each request's send time from the start: the arrival process's pauses added up."""
    n = len(config.requests)
    gaps = arrival_gaps(n, config.request_rate, config.burstiness, random.Random(config.seed))
    return list(itertools.accumulate(gaps[:-1], initial=0.0)) if n else []


def split_shares(config: BenchConfig, processes: int) -> list[Share]:
    """Deal the requests (and warm-up requests, and the concurrency limit) out
    to ``processes`` clients in turn, keeping each request's send time; fewer
    clients when there are fewer requests or concurrency slots than that."""
    n, limit = len(config.requests), config.max_concurrency
    processes = max(1, min(processes, n, limit or n))
    offsets = send_offsets(config)
    shares = []
    for p in range(processes):
        indices = tuple(range(p, n, processes))
        concurrency = None if limit is None else limit // processes + (p < limit % processes)
        warmup = tuple(range(p, config.warmup_requests, processes))
        shares.append(Share(indices, tuple(offsets[i] for i in indices), concurrency, warmup))
    return shares


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No garbage collection while requests are timed: a full collection over
    a heap of stored chunks stops the event loop for milliseconds."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


async def send_share(
    config: BenchConfig,
    share: Share,
    start_at: Callable[[], float] | None = None,
    on_done: Callable[[], None] = lambda: None,
) -> list[RequestOutcome]:
    """Warm up, then send the share's requests at their times under its
    concurrency limit; the outcomes in the share's order. ``start_at`` is
    called once warm-up is over and returns the common start (perf_counter
    time); None: start right away."""
    sender = make_sender(config)
    slots = (
        asyncio.Semaphore(share.max_concurrency)
        if share.max_concurrency
        else contextlib.nullcontext()
    )

    async def limited(spec: RequestSpec, prepared: Any) -> RequestOutcome:
        async with slots:
            return await sender.send(spec, prepared)

    try:
        if share.warmup:
            specs = [config.warmup[i] for i in share.warmup]
            warm = await asyncio.gather(*(limited(s, sender.prepare(s)) for s in specs))
            sender.settle_all()
            if bad := [o for o in warm if not o.success]:
                print(
                    f"warning: {len(bad)} warm-up requests failed: {bad[0].error}", file=sys.stderr
                )
        specs = [config.requests[i] for i in share.indices]
        prepared = [sender.prepare(s) for s in specs]
        t0 = start_at() if start_at else time.perf_counter()
        tasks = []
        with gc_paused():
            # Absolute send times, so that event-loop delays do not accumulate.
            for spec, request, offset in zip(specs, prepared, share.offsets):
                if (wait := t0 + offset - time.perf_counter()) > 0:
                    await asyncio.sleep(wait)
                task = asyncio.create_task(limited(spec, request))
                task.add_done_callback(lambda _: on_done())
                tasks.append(task)
            outcomes = list(await asyncio.gather(*tasks))
        sender.settle_all()
        return outcomes
    finally:
        await sender.aclose()


def result_of(outcomes: list[RequestOutcome]) -> BenchmarkResult:
    duration = max(o.end for o in outcomes) - min(o.start for o in outcomes) if outcomes else 0.0
    return BenchmarkResult(outcomes, duration)


async def run_benchmark(config: BenchConfig) -> BenchmarkResult:
    """Warm up, then send ``config.requests`` at the configured arrival rate and
    concurrency from this process; return every request's outcome and the
    benchmark duration."""
    (share,) = split_shares(config, 1)
    progress = Progress(len(config.requests), config.show_progress)
    return result_of(await send_share(config, share, on_done=progress.step))


def default_client_processes(config: BenchConfig) -> int:
    """One process while one event loop keeps up with the streams, more above.

    Each client process handles up to CONCURRENCY_PER_PROCESS streams, and
    there are no more of them than half the cores (the rest is left to the
    server when it runs on the same machine)."""
    concurrency = config.max_concurrency or len(config.requests)
    wanted = math.ceil(concurrency / CONCURRENCY_PER_PROCESS)
    return max(1, min(wanted, (os.cpu_count() or 1) // 2))


def _client_process(config: BenchConfig, share: Share, pipe: Connection) -> None:
    """A client process: its share, with the start time from the parent."""

    def start_at() -> float:
        pipe.send(("ready", None))
        return pipe.recv()

    try:
        # A message per finished request only when there is a counter to show.
        on_done = (lambda: pipe.send(("done", None))) if config.show_progress else lambda: None
        outcomes = asyncio.run(send_share(config, share, start_at, on_done))
        pipe.send(("result", outcomes))
    except BaseException as e:  # reported by the parent, which then stops
        pipe.send(("error", f"{type(e).__name__}: {e}"))


def process_context() -> multiprocessing.context.BaseContext:
    # fork starts at once and needs no importable __main__; but a process with
    # threads may hold a lock that the child then waits on forever.
    if "fork" in multiprocessing.get_all_start_methods() and threading.active_count() == 1:
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("spawn")


def run_processes(config: BenchConfig, shares: list[Share]) -> BenchmarkResult:
    """One client process per share, started together; their outcomes merged
    in request order."""
    ctx = process_context()
    pipes, procs = [], []
    try:
        for share in shares:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_client_process, args=(config, share, child), daemon=True)
            proc.start()
            child.close()
            pipes.append(parent)
            procs.append(proc)
        for pipe in pipes:
            expect(pipe, "ready")
        t0 = time.perf_counter() + START_DELAY_S
        for pipe in pipes:
            pipe.send(t0)
        progress = Progress(len(config.requests), config.show_progress)
        outcomes: list[Any] = [None] * len(config.requests)
        waiting = dict(zip(pipes, shares))
        while waiting:
            for pipe in mp_connection.wait(list(waiting)):
                kind, value = receive(pipe)
                if kind == "done":
                    progress.step()
                    continue
                share = waiting.pop(pipe)
                for i, outcome in zip(share.indices, expect_value(kind, value, "result")):
                    outcomes[i] = outcome
        for proc in procs:
            proc.join()
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    assert all(o is not None for o in outcomes)
    return result_of(outcomes)


def receive(pipe: Connection) -> tuple[str, Any]:
    try:
        return pipe.recv()
    except EOFError:
        raise RuntimeError("a client process died") from None


def expect_value(kind: str, value: Any, wanted: str) -> Any:
    if kind == "error":
        raise RuntimeError(f"a client process failed: {value}")
    if kind != wanted:
        raise RuntimeError(f"a client process sent {kind!r}, expected {wanted!r}")
    return value


def expect(pipe: Connection, wanted: str) -> Any:
    return expect_value(*receive(pipe), wanted)


def benchmark(config: BenchConfig) -> BenchmarkResult:
    """Run the benchmark from ``config.num_client_processes`` processes (this
    one when 1). Each process sends every N-th request at its original time
    under 1/N of the concurrency limit, so slots are not shared between
    processes: a free slot in one does not start another's waiting request."""
    shares = split_shares(config, config.num_client_processes)
    if len(shares) == 1:
        return asyncio.run(run_benchmark(config))
    result = run_processes(config, shares)
    result.processes = len(shares)
    return result


# -- metrics --------------------------------------------------------------------


def parse_slo(text: str) -> dict[str, float]:
    """``ttft=500,tpot=50`` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slo = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep or key not in SLO_METRICS:
            raise argparse.ArgumentTypeError(
                f"bad SLO {item!r}: expected NAME=MS with NAME in {', '.join(SLO_METRICS)}"
            )
        try:
            slo[key] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad SLO value {value!r} (milliseconds)") from None
    return slo


def stats_ms(name: str, values_s: Sequence[float]) -> dict[str, float | None]:
    """mean/median/std/p90/p95/p99 in ms (None without samples), vLLM's key names."""
    keys = ("mean", "median", "std", "p90", "p95", "p99")
    if not values_s:
        return {f"{k}_{name}_ms": None for k in keys}
    a = np.asarray(values_s, dtype=float) * 1000.0
    vals = (a.mean(), np.median(a), a.std(), *np.percentile(a, [90, 95, 99]))
    return {f"{k}_{name}_ms": float(v) for k, v in zip(keys, vals)}


def compute_metrics(
    outcomes: Sequence[RequestOutcome], duration: float, slo: dict[str, float] | None = None
) -> dict[str, Any]:
    """Aggregate metrics over the successful outcomes (see the module docstring)."""
    ok = [o for o in outcomes if o.success]
    out_tokens = [o.chunks if o.completion_tokens is None else o.completion_tokens for o in ok]
    in_tokens = [o.prompt_len if o.prompt_tokens is None else o.prompt_tokens for o in ok]
    # Per request; 0 for single-token outputs, which therefore pass a TPOT SLO (as in vLLM).
    tpot_all = [(o.latency - o.ttft) / (n - 1) if n > 1 else 0.0 for o, n in zip(ok, out_tokens)]
    samples = {
        "ttft": [o.ttft for o in ok],
        "tpot": [t for t, n in zip(tpot_all, out_tokens) if n > 1],
        "itl": [g for o in ok for g in o.itl],
        "e2el": [o.latency for o in ok],
    }
    per = 1.0 / duration if duration > 0 else 0.0
    total_in, total_out = sum(in_tokens), sum(out_tokens)
    m: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(outcomes) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "output_tokens_from_chunks": any(o.completion_tokens is None for o in ok),
        "request_throughput": len(ok) * per,
        "request_goodput": None,
        "input_throughput": total_in * per,
        "output_throughput": total_out * per,
        "total_token_throughput": (total_in + total_out) * per,
    }
    if slo:
        per_request = {"ttft": samples["ttft"], "tpot": tpot_all, "e2el": samples["e2el"]}
        good = sum(
            all(per_request[k][i] * 1000.0 <= limit for k, limit in slo.items())
            for i in range(len(ok))
        )
        m |= {"request_goodput": good * per, "good_requests": good, "slo_ms": slo}
    for name in STAT_METRICS:
        m |= stats_ms(name, samples[name])
    errors = [o.error for o in outcomes if not o.success]
    m["errors"] = sorted(set(errors))[:10]
    return m


def json_rate(rate: float) -> float | str:
    """A request rate as a JSON record holds it: ``"inf"`` for no pauses."""
    return "inf" if math.isinf(rate) else rate


def measure(
    config: BenchConfig, slo: dict[str, float] | None, processes: int | None = None
) -> tuple[BenchmarkResult, dict[str, Any]]:
    """One run: its result and what a record gives of it (the metrics and
    the client). ``processes``: client processes, None for the default."""
    processes = processes or default_client_processes(config)
    result = benchmark(replace(config, num_client_processes=processes))
    client = {"http_client": config.http_client, "processes": result.processes}
    return result, {**compute_metrics(result.outcomes, result.duration, slo), "client": client}


# -- goodput sweep --------------------------------------------------------------

SWEEP_NAMES = {"request_rate": "request rate", "max_concurrency": "max concurrency"}
"""The settings a sweep can vary (``BenchConfig`` fields), as printed."""


class Verdict(NamedTuple):
    """Whether one point of a goodput sweep holds: no request failed and the
    p99 of every metric with an objective is within it."""

    broken: tuple[str, ...]
    """What the point missed: the SLO metrics whose p99 is over their
    objective, in the SLO's order, then "failed" when a request failed."""

    @property
    def holds(self) -> bool:
        return not self.broken


def slo_verdict(metrics: dict[str, Any], slo: dict[str, float]) -> Verdict:
    """The verdict on ``compute_metrics``' output. A metric without samples
    (TPOT when every output is one token) misses no objective."""
    over = tuple(k for k, limit in slo.items() if (metrics[f"p99_{k}_ms"] or 0.0) > limit)
    return Verdict(over + (("failed",) if metrics["failed"] else ()))


def why_broken(point: dict[str, Any], slo: dict[str, float]) -> str:
    """What a sweep point missed, e.g. ``ttft p99 812.30 ms > 500 ms, 2 failed``."""
    return ", ".join(
        f"{point['failed']} failed"
        if name == "failed"
        else f"{name} p99 {point[f'p99_{name}_ms']:.2f} ms > {slo[name]:g} ms"
        for name in point["broken"]
    )


def run_sweep(
    config: BenchConfig,
    over: str,
    values: Sequence[float],
    slo: dict[str, float],
    run_all: bool = False,
    processes: int | None = None,
    refine: int = 0,
) -> dict[str, Any]:
    """One run of ``config`` per value of its setting ``over``, in increasing
    order, until the first point that does not hold (every one if
    ``run_all``); then up to ``refine`` more, each halfway between the highest
    value that held below the first broken one and that broken one (bisection:
    a concurrency stops when the two are 1 apart). The points (their settings,
    metrics and verdict, in increasing order of the value) and the summary, as
    a record holds them."""
    values = sorted(set(values))
    points: list[dict[str, Any]] = []

    def run_point(value: float) -> bool:
        print(f"== {SWEEP_NAMES[over]} {value}", file=sys.stderr)
        point_config = replace(config, **{over: value})
        if points:
            # Prompts of the same lengths drawn anew: the earlier points' would
            # be in the server's prefix cache, and their TTFT a cache hit's.
            rng = random.Random(f"sweep-{config.seed}-{len(points)}")
            fresh = redrawn(config.requests, len(config.requests), rng)
            point_config = replace(point_config, requests=fresh)
        _, measured = measure(point_config, slo, processes)
        verdict = slo_verdict(measured, slo)
        point = {
            "request_rate": json_rate(point_config.request_rate),
            "max_concurrency": point_config.max_concurrency,
            **measured,
            "holds": verdict.holds,
            "broken": list(verdict.broken),
        }
        points.append(point)
        print("holds" if verdict.holds else f"breaks: {why_broken(point, slo)}", file=sys.stderr)
        if point["errors"]:
            print(f"errors: {point['errors']}", file=sys.stderr)
        return verdict.holds

    for value in values:
        if not (run_point(value) or run_all):
            break
    for _ in range(refine):
        value = bisect_point(points, over)
        if value is None:
            break
        run_point(value)
    points.sort(key=lambda p: p[over])
    return {
        "over": over,
        "values": [json_rate(v) for v in values],
        "slo_ms": slo,
        "run_all": run_all,
        "refine": refine,
        "points": points,
        "summary": sweep_summary(points, over, slo),
    }


def bisect_point(points: Sequence[dict[str, Any]], over: str) -> float | None:
    """The value halfway between the lowest broken point's and the highest
    held one's below it; None without both, or for a concurrency once they
    are 1 apart. A rate is rounded to 0.01 req/s (None once that is one of
    the two)."""
    broken = [p[over] for p in points if not p["holds"]]
    if not broken:
        return None
    hi = min(broken)
    held = [p[over] for p in points if p["holds"] and p[over] < hi]
    if not held:
        return None
    lo = max(held)
    if over == "max_concurrency":
        mid: float = (lo + hi) // 2
    else:
        mid = round((lo + hi) / 2, 2)
    return None if mid in (lo, hi) else mid


def sweep_summary(
    points: Sequence[dict[str, Any]], over: str, slo: dict[str, float]
) -> dict[str, Any]:
    """The highest point that held and the first that broke, None where there
    is none. Points are in increasing order; with --sweep-all, a point above a
    broken one may hold again."""
    held = [p for p in points if p["holds"]]
    broken = [p for p in points if not p["holds"]]
    summary: dict[str, Any] = {"highest_holding": None, "first_broken": None}
    if held:
        best = held[-1]
        summary["highest_holding"] = {
            "value": best[over],
            "output_throughput": best["output_throughput"],
            "request_goodput": best["request_goodput"],
        }
    if broken:
        first = broken[0]
        summary["first_broken"] = {
            "value": first[over],
            "broken": first["broken"],
            "reason": why_broken(first, slo),
        }
    return summary
