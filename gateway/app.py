"""The OpenAI-compatible HTTP API over the prefill and decode pools."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from gateway.config import GatewayConfig
from gateway.dispatch import Dispatcher, NoWorkerAvailable
from gateway.metrics import GatewayMetrics
from gateway.openai_types import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    now,
)
from gateway.router import HealthChecker, Router
from gateway.router import WorkerError as RouterWorkerError
from gateway.text import IncrementalDetokenizer, StopStringMatcher, Tokenizer
from protocol import tokenizer_files
from protocol.client import WorkerError
from protocol.sampling import MAX_TOP_LOGPROBS, InvalidSamplingParams, SamplingParams

log = logging.getLogger("gateway")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )

    def response(self) -> JSONResponse:
        body = {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }
        return JSONResponse(body, status_code=self.status)


class _ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its body iterator.

    Invariant: when a client disconnects mid-stream, its requests are aborted
    on the workers at once. Starlette cancels the sending task on disconnect
    but leaves the body iterator as it is: when the cancellation lands in
    ``send`` (common behind an http middleware, which hands chunks over a
    memory stream) the generator stays suspended at a ``yield`` until garbage
    collection, while its requests run on to their end on the workers.
    """

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


TopLogprobs = list[list[tuple[int, float]]] | None
"""Per token, the most likely (token id, logprob) pairs (None: not asked for)."""


class ChoiceEvent(NamedTuple):
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    cached_tokens: int
    top_logprobs: TopLogprobs = None


@dataclass
class GatewayState:
    config: GatewayConfig
    router: Router
    health: HealthChecker
    dispatcher: Dispatcher
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    tokenizer: Tokenizer | None = None
    model_name: str = ""
    context_length: int = 0

    async def load_model_facts(self) -> None:
        """Tokenizer, served name and context window from the first worker."""
        workers = self.router.workers()
        if not workers:
            raise RuntimeError("no workers to take the tokenizer from")
        w = workers[0]
        async with httpx.AsyncClient(timeout=30) as http:
            body = (await http.get(f"{w.url}/tokenizer")).raise_for_status().json()
            info = (await http.get(f"{w.url}/server_info")).raise_for_status().json()
        self.tokenizer = Tokenizer.from_files(tokenizer_files.unpack(body))
        self.model_name = self.config.served_model_name or info.get("served_model_name") or "model"
        self.context_length = int(info.get("context_length") or self.tokenizer.model_max_length)


# -- request translation ------------------------------------------------------------


def _sampling(
    req: ChatCompletionRequest | CompletionRequest,
    max_tokens: int,
    seed: int | None,
    top_logprobs: int,
) -> SamplingParams:
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            seed=seed,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            top_logprobs=top_logprobs,
        )
    except InvalidSamplingParams as e:
        raise APIError(400, str(e), param=e.param) from None
    return params


def _num_top_logprobs(req: ChatCompletionRequest | CompletionRequest, chat: bool) -> int | None:
    """How many alternatives each token's logprobs list (None: no logprobs)."""
    if chat:
        k = req.top_logprobs  # type: ignore[union-attr]
        if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
            raise APIError(
                400, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs"
            )
        if k and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        return (k or 0) if req.logprobs else None
    k = req.logprobs  # type: ignore[assignment]
    if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
        raise APIError(400, f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]", param="logprobs")
    return k


def _stops(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        raise APIError(400, "stop strings must not be empty", param="stop")
    if len(stops) > 16:
        raise APIError(400, "at most 16 stop strings", param="stop")
    return stops


def _check_lengths(
    state: GatewayState, prompt: list[int], max_tokens: int | None, param: str
) -> int:
    cfg = state.config
    if not prompt:
        raise APIError(400, "the prompt is empty", param=param)
    if cfg.max_prompt_tokens and len(prompt) > cfg.max_prompt_tokens:
        raise APIError(
            400,
            f"prompt has {len(prompt)} tokens; the limit is {cfg.max_prompt_tokens}",
            param=param,
        )
    room = state.context_length - len(prompt)
    if max_tokens is None:
        max_tokens = room
    if max_tokens < 1:
        raise APIError(400, "max_tokens must be at least 1", param="max_tokens")
    if len(prompt) + max_tokens > state.context_length:
        raise APIError(
            400,
            f"this model's maximum context length is {state.context_length} tokens; the request has "
            f"{len(prompt)} prompt tokens and asks for {max_tokens} more",
            param="max_tokens" if room > 0 else param,
        )
    return max_tokens


# -- generation ---------------------------------------------------------------------


async def _choice(
    state: GatewayState,
    prompt: list[int],
    spec: SamplingParams,
    stops: list[str],
    request_id: str,
) -> AsyncIterator[ChoiceEvent]:
    """One completion: detokenized deltas, cut at the first stop string."""
    assert state.tokenizer is not None
    detok = IncrementalDetokenizer(state.tokenizer)
    matcher = StopStringMatcher(stops) if stops else None
    stream = state.dispatcher.stream(prompt, spec, request_id)
    try:
        async for delta in stream:
            if delta.finish_reason in ("error", "abort"):
                raise APIError(
                    502,
                    delta.error or f"request {delta.finish_reason}ed by a worker",
                    type_="server_error",
                    code="upstream_error",
                )
            text = detok.push(delta.token_ids)
            finish = delta.finish_reason
            if finish is not None:
                text += detok.flush()
            if matcher is not None:
                text, hit = matcher.push(text)
                if hit:
                    yield ChoiceEvent(
                        text,
                        delta.token_ids,
                        delta.logprobs,
                        "stop",
                        delta.num_cached_tokens,
                        delta.top_logprobs,
                    )
                    return  # leaving the stream aborts the request on the workers
                if finish is not None:
                    text += matcher.flush()
            yield ChoiceEvent(
                text,
                delta.token_ids,
                delta.logprobs,
                finish,
                delta.num_cached_tokens,
                delta.top_logprobs,
            )
            if finish is not None:
                return
    except NoWorkerAvailable as e:
        raise APIError(503, str(e), type_="server_error", code="no_worker") from None
    except WorkerError as e:
        raise APIError(
            502, f"worker failed: {e}", type_="server_error", code="upstream_error"
        ) from None
    finally:
        await stream.aclose()


async def _merge_choices(
    gens: list[AsyncIterator[ChoiceEvent]],
) -> AsyncIterator[tuple[int, ChoiceEvent]]:
    """Interleave the choices of one request as their events arrive."""
    queue: asyncio.Queue[tuple[int, ChoiceEvent | BaseException | None]] = asyncio.Queue()
    closing = False

    async def pump(i: int, gen: AsyncIterator[ChoiceEvent]) -> None:
        # Invariant: once the merge is closed, every choice's stream is closed
        # (its requests aborted) at its next event at the latest, even when the
        # cancel below is lost: asyncio.wait_for (in the worker client) drops a
        # cancel that races a result on Python 3.11, and the pump would then
        # consume the request to its end.
        try:
            async with contextlib.aclosing(gen):  # type: ignore[type-var]
                async for ev in gen:
                    if closing:
                        return
                    await queue.put((i, ev))
            await queue.put((i, None))
        except BaseException as e:  # noqa: BLE001 (re-raised in the consumer)
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        live = len(tasks)
        while live:
            i, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        closing = True
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t


# -- the app ----------------------------------------------------------------------


def build_app(state: GatewayState) -> FastAPI:
    cfg = state.config

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        for role, urls in (("prefill", cfg.prefill), ("decode", cfg.decode)):
            for url in urls:
                await state.health.add_worker(url, role)
        await state.load_model_facts()
        state.health.after_round.append(state.dispatcher.prune)
        await state.health.start()
        try:
            yield
        finally:
            await state.health.stop()
            await state.dispatcher.close()

    app = FastAPI(title="disagg-serve gateway", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def on_api_error(_: Request, e: APIError) -> JSONResponse:
        state.metrics.failures.inc(e.code or str(e.status))
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def on_validation(_: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        return APIError(
            400,
            f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid')}",
            param=loc[0] if loc else None,
        ).response()

    @app.middleware("http")
    async def guards(request: Request, call_next: Any) -> Response:
        path = request.url.path
        auth = request.headers.get("authorization")
        if path.startswith("/v1/") and cfg.api_key and auth != f"Bearer {cfg.api_key}":
            return APIError(401, "invalid or missing API key", code="invalid_api_key").response()
        if path.startswith("/admin/") and cfg.admin_key and auth != f"Bearer {cfg.admin_key}":
            return APIError(401, "invalid or missing admin key", code="invalid_api_key").response()
        size = request.headers.get("content-length")
        if size is None and request.method in ("POST", "PUT", "PATCH"):
            # Invariant: no body over max_body_bytes reaches a handler, framed
            # by Content-Length or not (a chunked body has no header to check;
            # it is read here and handed on from Starlette's request cache).
            size = str(len(await request.body()))
        if size is not None and size.isdigit() and int(size) > cfg.max_body_bytes:
            return APIError(
                400,
                f"request body is {size} bytes; the limit is {cfg.max_body_bytes}",
                code="body_too_large",
            ).response()
        return await call_next(request)

    @app.get("/health")
    async def health() -> Response:
        ok = any(
            state.router.is_available(w) for w in state.router.workers() if w.role != "prefill"
        )
        return JSONResponse(
            {"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503
        )

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=state.model_name, max_model_len=state.context_length)])

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(
            state.metrics.render(state.router), media_type="text/plain; version=0.0.4"
        )

    @app.get("/admin/workers")
    async def list_workers() -> Any:
        return {"workers": [w.to_dict() for w in state.router.workers()]}

    @app.post("/admin/workers")
    async def add_worker(body: dict[str, Any]) -> Any:
        url = body.get("url")
        if not isinstance(url, str):
            raise APIError(400, "body must carry the worker's url", param="url")
        try:
            w = await state.health.add_worker(url, body.get("role"))
        except RouterWorkerError as e:
            raise APIError(400, str(e), param="url") from None
        if state.tokenizer is None:
            await state.load_model_facts()
        return w.to_dict()

    @app.delete("/admin/workers")
    async def remove_worker(url: str) -> Any:
        w = await state.health.remove_worker(url)
        if w is None:
            raise APIError(404, f"no worker {url}", param="url", code="not_found")
        await state.dispatcher.prune()
        # Still listed (draining) until its outstanding requests end.
        return {"removed": url, "draining": True, "outstanding_requests": w.outstanding_requests}

    def check_model(name: str) -> None:
        if name != state.model_name:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {state.model_name!r}",
                param="model",
                code="model_not_found",
            )

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest) -> Response:
        check_model(req.model)
        assert state.tokenizer is not None
        p = req.prompt
        if isinstance(p, str):
            prompts = [state.tokenizer.encode(p)]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]  # type: ignore[arg-type]
        elif p and all(isinstance(x, str) for x in p):
            prompts = [state.tokenizer.encode(x) for x in p]  # type: ignore[arg-type]
        elif p and all(isinstance(x, list) for x in p):
            prompts = [list(x) for x in p]  # type: ignore[union-attr]
        else:
            raise APIError(
                400, "prompt must be a string, a list of strings or token ids", param="prompt"
            )
        vocab = state.tokenizer.vocab_size
        for ids in prompts:
            if any(not 0 <= t < vocab for t in ids):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        return await run(req, prompts, chat=False, default_max=16)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest) -> Response:
        check_model(req.model)
        assert state.tokenizer is not None
        msgs = [m.model_dump(exclude_none=True) for m in req.messages]
        if not msgs:
            raise APIError(400, "messages must not be empty", param="messages")
        try:
            ids = state.tokenizer.chat_ids(msgs, add_generation_prompt=req.add_generation_prompt)
        except ValueError as e:
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from None
        return await run(req, [ids], chat=True, default_max=None)

    async def run(
        req: ChatCompletionRequest | CompletionRequest,
        prompts: list[list[int]],
        chat: bool,
        default_max: int | None,
    ) -> Response:
        if not 1 <= req.n <= 16:
            raise APIError(400, "n must be between 1 and 16", param="n")
        top_k = _num_top_logprobs(req, chat)
        stops = _stops(req.stop)
        requested = getattr(req, "max_completion_tokens", None) or req.max_tokens or default_max
        jobs = []
        for p_index, ids in enumerate(prompts):
            max_tokens = _check_lengths(state, ids, requested, "messages" if chat else "prompt")
            for i in range(req.n):
                # n > 1 with a seed: distinct but reproducible streams per choice.
                seed = None if req.seed is None else (req.seed + i) % (1 << 63)
                jobs.append((p_index, ids, _sampling(req, max_tokens, seed, top_k or 0)))
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        gens = [
            _choice(state, ids, spec, stops, f"{rid}-{i}") for i, (_, ids, spec) in enumerate(jobs)
        ]
        timeout = cfg.request_timeout_s
        started = time.monotonic()
        state.metrics.requests.inc("chat" if chat else "completions")
        view = _View(state, chat, top_k)
        if req.stream:
            return _ClosingStreamingResponse(
                _sse(state, req, view, rid, prompts, jobs, gens, timeout, started),
                media_type="text/event-stream",
            )
        timing = _Timing(state.metrics, len(jobs), started)
        try:
            async with asyncio.timeout(timeout):
                results = [[] for _ in jobs]
                async for i, ev in _merge_choices(gens):
                    timing.observe(i, ev)
                    results[i].append(ev)
        except TimeoutError:
            raise APIError(
                504,
                f"request did not finish within {timeout:g}s",
                type_="server_error",
                code="timeout",
            ) from None
        state.metrics.e2e.observe(time.monotonic() - started)
        return JSONResponse(_full_response(state, req, view, rid, prompts, jobs, results))

    return app


def _usage(
    prompts: list[list[int]], jobs: list, counts: list[int], cached: list[int]
) -> dict[str, Any]:
    prompt_tokens = sum(len(p) for p in prompts)
    completion = sum(counts)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": sum(cached)},
    }


class _View:
    """Formats a choice's tokens for the response: logprobs in the chat or the
    completions shape, with ``top_k`` alternatives per token (None: none)."""

    def __init__(self, state: GatewayState, chat: bool, top_k: int | None) -> None:
        assert state.tokenizer is not None
        self.tokenizer = state.tokenizer
        self.chat = chat
        self.top_k = top_k

    def logprobs(
        self, ids: list[int], lps: list[float], tops: TopLogprobs, offset: int = 0
    ) -> dict[str, Any] | None:
        """``offset``: where the first token starts in the choice's text
        (completions' ``text_offset``)."""
        if self.top_k is None:
            return None
        alts = tops if tops is not None and self.top_k else [[] for _ in ids]
        if self.chat:
            return {
                "content": [
                    {**self._entry(t, lp), "top_logprobs": [self._entry(a, b) for a, b in top]}
                    for t, lp, top in zip(ids, lps, alts)
                ]
            }
        tokens = [self.tokenizer.decode([t]) for t in ids]
        offsets = []
        for tok in tokens:
            offsets.append(offset)
            offset += len(tok)
        top_dicts = []
        for tok, lp, top in zip(tokens, lps, alts):
            d = {self.tokenizer.decode([a]): b for a, b in top}
            d.setdefault(tok, lp)  # the chosen token is always listed
            top_dicts.append(d)
        return {
            "tokens": tokens,
            "token_logprobs": lps,
            "top_logprobs": top_dicts,
            "text_offset": offsets,
        }

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        return {
            "token": self.tokenizer.decode([token_id]),
            "logprob": logprob,
            "bytes": list(self.tokenizer.token_bytes(token_id)),
        }


class _Timing:
    """TTFT and ITL of each choice of a request, into the gateway's histograms."""

    def __init__(self, metrics: GatewayMetrics, n: int, started: float) -> None:
        self.metrics = metrics
        self.started = started
        self.last: list[float | None] = [None] * n

    def observe(self, i: int, ev: ChoiceEvent) -> None:
        if not ev.token_ids:
            return
        t = time.monotonic()
        last = self.last[i]
        if last is None:
            self.metrics.ttft.observe(t - self.started)
        else:
            self.metrics.itl.observe(t - last)
        self.last[i] = t


def _joined(events: list[ChoiceEvent]) -> tuple[list[int], list[float], TopLogprobs]:
    """The token ids, logprobs and top logprobs of ``events``, in order."""
    ids = [t for e in events for t in e.token_ids]
    lps = [x for e in events for x in e.logprobs]
    if all(e.top_logprobs is None for e in events):
        return ids, lps, None
    return ids, lps, [t for e in events for t in (e.top_logprobs or [[] for _ in e.token_ids])]


def _full_response(
    state: GatewayState,
    req: Any,
    view: _View,
    rid: str,
    prompts: list[list[int]],
    jobs: list,
    results: list[list[ChoiceEvent]],
) -> dict[str, Any]:
    choices = []
    counts, cached = [], []
    for index, ((_p, ids, _spec), events) in enumerate(zip(jobs, results)):
        text = "".join(e.text for e in events)
        toks, lps, tops = _joined(events)
        finish = events[-1].finish_reason if events else "stop"
        counts.append(len(toks))
        cached.append(
            max((e.cached_tokens for e in events), default=0) if index % req.n == 0 else 0
        )
        if view.chat:
            choice: dict[str, Any] = {
                "index": index,
                "message": {"role": "assistant", "content": text},
                "logprobs": view.logprobs(toks, lps, tops),
                "finish_reason": finish,
            }
        else:
            prefix = state.tokenizer.decode(ids) if req.echo and state.tokenizer else ""
            choice = {
                "index": index,
                "text": prefix + text,
                "logprobs": view.logprobs(toks, lps, tops, len(prefix)),
                "finish_reason": finish,
            }
        if req.return_token_ids:
            choice["token_ids"] = toks
        choices.append(choice)
    body: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion" if view.chat else "text_completion",
        "created": now(),
        "model": state.model_name,
        "choices": choices,
        "usage": _usage(prompts, jobs, counts, cached),
    }
    if req.return_token_ids:
        body["prompt_token_ids"] = prompts[0] if len(prompts) == 1 else prompts
    return body


async def _until(
    events: AsyncIterator[tuple[int, ChoiceEvent]], deadline: float
) -> AsyncIterator[tuple[int, ChoiceEvent]]:
    """``events`` until the monotonic ``deadline``, then ``TimeoutError``.

    Invariant: the deadline only ever interrupts the wait for the next event.
    An ``asyncio.timeout`` around a loop that yields would also fire while the
    consumer (the response writer) holds control, cancelling it instead of us:
    the stream would then end without its error event and ``[DONE]``."""
    it = aiter(events)
    while True:
        try:
            async with asyncio.timeout_at(_loop_time(deadline)):
                item = await anext(it)
        except StopAsyncIteration:
            return
        yield item


def _loop_time(monotonic_deadline: float) -> float:
    """A ``time.monotonic`` deadline on the event loop's clock."""
    loop = asyncio.get_running_loop()
    return loop.time() + (monotonic_deadline - time.monotonic())


async def _sse(
    state: GatewayState,
    req: Any,
    view: _View,
    rid: str,
    prompts: list[list[int]],
    jobs: list,
    gens: list[AsyncIterator[ChoiceEvent]],
    timeout: float,
    started: float,
) -> AsyncIterator[str]:
    chat = view.chat
    created = now()
    obj = "chat.completion.chunk" if chat else "text_completion"
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(
        choices: list[dict[str, Any]], usage: dict[str, Any] | None = None, **extra: Any
    ) -> str:
        body: dict[str, Any] = {
            "id": rid,
            "object": obj,
            "created": created,
            "model": state.model_name,
            "choices": choices,
            **extra,
        }
        if include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    counts = [0] * len(jobs)
    cached = [0] * len(jobs)
    timing = _Timing(state.metrics, len(jobs), started)
    text_offset = [0] * len(jobs)
    """Where each choice's next token starts in its text (echo included)."""
    # Invariant: a choice's streamed token_ids (and logprobs) add up to all of
    # its tokens. A token whose text is still held back (half a UTF-8
    # character, a possible stop-string prefix) sends no chunk of its own, so
    # its ids and logprobs ride on the choice's next chunk instead of being lost.
    held: list[list[ChoiceEvent]] = [[] for _ in jobs]
    prompt_sent = [False] * len(jobs)
    if chat:
        for i in range(len(jobs)):
            yield chunk(
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
    elif req.echo:
        for i, (_p, ids, _s) in enumerate(jobs):
            echoed = state.tokenizer.decode(ids)
            text_offset[i] = len(echoed)
            yield chunk(
                [
                    {
                        "index": i,
                        "text": echoed,
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
    try:
        # aclosing: leaving this generator (the client went away) must close the
        # merge at once, which cancels the choices and aborts their requests.
        async with contextlib.aclosing(_merge_choices(gens)) as merged:
            async for i, ev in _until(merged, started + timeout):
                timing.observe(i, ev)
                counts[i] += len(ev.token_ids)
                if i % req.n == 0:
                    cached[i] = max(cached[i], ev.cached_tokens)
                if not ev.text and ev.finish_reason is None:
                    held[i].append(ev)
                    continue
                events, held[i] = [*held[i], ev], []
                ids, lps, tops = _joined(events)
                logprobs = view.logprobs(ids, lps, tops, text_offset[i])
                if logprobs is not None and not chat:
                    text_offset[i] += sum(len(t) for t in logprobs["tokens"])
                if chat:
                    delta = {"content": ev.text} if ev.text else {}
                    c: dict[str, Any] = {
                        "index": i,
                        "delta": delta,
                        "logprobs": logprobs,
                        "finish_reason": ev.finish_reason,
                    }
                else:
                    c = {
                        "index": i,
                        "text": ev.text,
                        "logprobs": logprobs,
                        "finish_reason": ev.finish_reason,
                    }
                if req.return_token_ids:
                    c["token_ids"] = ids
                extra = {}
                if req.return_token_ids and not prompt_sent[i]:
                    extra = {"prompt_token_ids": jobs[i][1]}
                    prompt_sent[i] = True
                yield chunk([c], **extra)
    except TimeoutError:
        state.metrics.failures.inc("timeout")
        err = {
            "message": f"request did not finish within {timeout:g}s",
            "type": "server_error",
            "param": None,
            "code": "timeout",
        }
        yield f"data: {json.dumps({'error': err})}\n\n"
    except APIError as e:
        state.metrics.failures.inc(e.code or str(e.status))
        err = {"message": e.message, "type": e.type, "param": e.param, "code": e.code}
        yield f"data: {json.dumps({'error': err})}\n\n"
    else:
        state.metrics.e2e.observe(time.monotonic() - started)
        if include_usage:
            yield chunk([], usage=_usage(prompts, jobs, counts, cached))
    yield "data: [DONE]\n\n"
