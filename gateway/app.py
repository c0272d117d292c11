"""The OpenAI-compatible HTTP API over the prefill and decode pools: its routes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import AbstractAsyncContextManager
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.admission import Overloaded
from gateway.dispatch import NoWorkerAvailable
from gateway.guards import RECEIVED_AT, RELEASE_SLOT, Guards, buffer_body
from gateway.metrics import RequestTiming
from gateway.openai import (
    APIError,
    ChatCompletionRequest,
    ChatShape,
    ClosingStreamingResponse,
    CompletionRequest,
    CompletionShape,
    GenerationRequest,
    ModelCard,
    ModelList,
    ResponseContext,
    ResponseShape,
    check_choices,
    check_lengths,
    check_seed,
    check_token_ids,
    choice_seed,
    choice_stream,
    collect_choices,
    completion_prompts,
    full_response,
    internal_error,
    requested_max_tokens,
    sampling_params,
    sse_stream,
    stop_strings,
)
from gateway.openai.choices import EagerStream
from gateway.openai.prompt_scoring import prompt_only
from gateway.openai.structured import (
    Constraint,
    first_event_checked,
    one_constraint,
    response_format_grammar,
    structured_outputs_grammar,
    with_grammar,
)
from gateway.openai.tools import ToolPlan, plan_tools, template_messages, tool_call_events
from gateway.openai.validation import check_messages, scores_prompt_only
from gateway.routing import WorkerError, normalize_url
from gateway.stages import RequestTrace
from gateway.state import GatewayState
from gateway.text.tool_parsers import parser_for_template
from protocol.finish import GRAMMAR_PARAM, PROMPT_PARAM
from protocol.roles import PREFILL, ROLES

log = logging.getLogger("gateway.app")

_PARAM_SOURCES = ("body", "query", "path", "header", "cookie")
"""First element of a validation error's ``loc``: where the value came from."""

_UNION_FIELDS = {
    "prompt": "a string, a list of strings, token ids (integers) or a list of lists of token ids",
    "stop": "a string or a list of strings",
}
"""What fields of several types take: pydantic's error names only one of them."""


def build_app(state: GatewayState) -> FastAPI:
    app = FastAPI(title="disagg-serve gateway", lifespan=_lifespan(state))
    # Before any route is added: every route is a _GuardedRoute.
    app.router.route_class = _GuardedRoute
    _add_error_handlers(app, state)
    app.add_middleware(
        Guards, config=state.config, busy_poll=state.busy_poll, direct=_direct_routes(state)
    )
    _add_status_routes(app, state)
    _add_admin_routes(app, state)
    _add_generation_routes(app, state)
    return app


def _lifespan(state: GatewayState) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.add_initial_workers()
        # The health rounds also admit workers (their admission checks load
        # the model's facts from the first one that passes).
        state.health.after_round += [state.dispatcher.prune, state.dispatcher.connect_all]
        await state.health.start()
        await state.dispatcher.connect_all()
        try:
            yield
        finally:
            if state.admission.running:
                log.warning(
                    "aborting %d request(s) still in flight on the workers",
                    state.admission.running,
                )
            await state.health.stop()
            await state.busy_poll.stop()
            await state.dispatcher.close()

    return lifespan


def _add_error_handlers(app: FastAPI, state: GatewayState) -> None:
    @app.exception_handler(APIError)
    async def on_api_error(_: Request, e: APIError) -> JSONResponse:
        return _api_error_response(state, e)

    @app.exception_handler(RequestValidationError)
    async def on_validation(_: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        return _validation_error(errors[0] if errors else {}).response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return _http_error(request, e).response()


def _api_error_response(state: GatewayState, e: APIError) -> JSONResponse:
    """An API error's answer, counted in the failures metric by its code."""
    state.metrics.failures.inc(e.code or str(e.status))
    return e.response()


def _validation_error(err: dict[str, Any]) -> APIError:
    """The 400 of a request that failed validation (pydantic's first error)."""
    loc = list(err.get("loc", ()))
    if loc and loc[0] in _PARAM_SOURCES:
        loc = loc[1:]
    if err.get("type") == "json_invalid":
        # FastAPI puts the character offset where a field name goes.
        where = f" at character {loc[0]}" if loc and isinstance(loc[0], int) else ""
        reason = (err.get("ctx") or {}).get("error") or "invalid JSON"
        return APIError(400, f"the request body is not valid JSON{where}: {reason}")
    param = loc[0] if loc and isinstance(loc[0], str) else None
    if err.get("type") == "extra_forbidden" and len(loc) == 1:
        return APIError(
            400,
            f"unrecognized request argument: {param} (this server does not support it; "
            "see docs/api.md, request fields)",
            param=param,
        )
    message = f"{'.'.join(str(x) for x in loc) or 'body'}: {err.get('msg', 'invalid')}"
    if param in _UNION_FIELDS:
        message = f"{param} must be {_UNION_FIELDS[param]} ({message})"
    return APIError(400, message, param=param)


def _http_error(request: Request, e: StarletteHTTPException) -> APIError:
    """An HTTP error raised by the framework (no such route, method not
    allowed, an unreadable body) in the OpenAI error body."""
    status, detail = e.status_code, str(e.detail)
    if status == 404 and detail == "Not Found":
        detail = f"no endpoint {request.method} {request.url.path}"
    elif status == 405 and detail == "Method Not Allowed":
        detail = f"{request.method} is not allowed on {request.url.path}"
    type_ = "server_error" if status >= 500 else "invalid_request_error"
    return APIError(status, detail, type_, headers=dict(e.headers or {}))


class _GuardedRoute(APIRoute):
    """A route whose unexpected exceptions are a 500 in the OpenAI error body.

    Starlette's last resort answers such an exception with a plain-text 500
    and raises it on into the server, which then drops the connection: the
    client's next request on it fails too. Here it is logged and answered like
    any other error, and the connection stays open."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            if request.method == "POST":
                await _parse_json_fast(request)
            try:
                return await handler(request)
            except (APIError, RequestValidationError, StarletteHTTPException):
                raise  # answered by their exception handlers
            except Exception as e:
                log.exception("%s %s failed", request.method, request.url.path)
                raise internal_error(e) from e

        return guarded


async def _parse_json_fast(request: Request) -> None:
    """Parse the body with msgspec (a third of the stdlib's time: 0.14 ms less
    for a 4k-token prompt of ids) into the cache ``Request.json`` reads.

    Invariant: the route sees what the stdlib parser gives. Where the two
    differ (NaN, Infinity, 1e400, lone surrogates, a BOM, UTF-16) msgspec
    refuses, and the route parses the body itself, as before, down to its
    error message for a body that is no JSON at all."""
    try:
        body = await request.body()
    except Exception:  # the route reads it again and answers as it always did
        return
    with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
        request._json = msgspec.json.decode(body)  # Starlette's cache of request.json()


REPLICA_ID = f"{socket.gethostname()}:{os.getpid()}"
"""Which gateway process answered (replicas share a port)."""


def _add_status_routes(app: FastAPI, state: GatewayState) -> None:
    @app.get("/health")
    async def health() -> Response:
        """ "ok" while a decode-pool worker takes requests, and each worker's
        state: whether it takes requests and, when it does not, why."""
        workers = state.router.workers()
        up = {w.url: state.router.is_available(w) for w in workers}
        ok = any(up[w.url] for w in workers if w.role != PREFILL)
        return JSONResponse(
            {
                "status": "ok" if ok else "unavailable",
                "replica": REPLICA_ID,
                "workers": [
                    {
                        "url": w.url,
                        "role": w.role,
                        "healthy": up[w.url],
                        "last_error": None if up[w.url] else (w.refused or w.last_error),
                    }
                    for w in workers
                ],
            },
            status_code=200 if ok else 503,
        )

    @app.get("/v1/models")
    async def models() -> ModelList:
        # The served model is the workers': until one is up, wait (bounded) as
        # a generation request does, rather than list a model with no name.
        await _ready(state)
        return ModelList(data=[ModelCard(id=state.model_name, max_model_len=state.max_model_len)])

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        await _ready(state)
        _check_model(state, model_id)
        return ModelCard(id=state.model_name, max_model_len=state.max_model_len)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(
            state.metrics.render(state.router), media_type="text/plain; version=0.0.4"
        )


def _add_admin_routes(app: FastAPI, state: GatewayState) -> None:
    @app.get("/admin/workers")
    async def list_workers() -> Any:
        return {"workers": state.admin.list_workers()}

    @app.post("/admin/workers")
    async def add_worker(body: dict[str, Any], request: Request) -> Any:
        url = body.get("url")
        if not isinstance(url, str):
            raise APIError(400, "body must carry the worker's url", param="url")
        url = _worker_url(url)
        role = body.get("role")
        if role is not None and (not isinstance(role, str) or role not in ROLES):
            raise APIError(
                400, f"unknown worker role {role!r}; choose from {', '.join(ROLES)}", param="role"
            )
        new = url not in state.router.prefill and url not in state.router.decode
        try:
            w = await state.admin.add_worker(url, role)
        except (WorkerError, ValueError) as e:
            # ValueError: the worker's /server_info does not fit its pool. A
            # new worker that failed its admission checks is not kept: the
            # registration failed, and says why.
            if new and state.router.get(url) is not None:
                state.router.remove(url)
            raise APIError(400, str(e), param="url") from None
        _pass_on(state, request, "POST", "/admin/workers", json={"url": url, "role": role})
        return w.to_dict()

    @app.delete("/admin/workers")
    async def remove_worker(url: str, request: Request) -> Any:
        url = _worker_url(url)
        w = await state.admin.remove_worker(url)
        _pass_on(state, request, "DELETE", "/admin/workers", params={"url": url})
        if w is None:
            raise APIError(404, f"no worker {url}", param="url", code="not_found")
        await state.dispatcher.prune()
        # Still listed (draining) until its outstanding requests end.
        return {"removed": url, "draining": True, "outstanding_requests": w.outstanding_requests}


def _pass_on(state: GatewayState, request: Request, method: str, path: str, **kw: Any) -> None:
    """Pass an admin change on to the peer replicas (``--peers``), unless it
    came from one of them; in the background: the caller's answer does not
    wait for the peers."""
    from gateway.replicas import PEER_HEADER, pass_on

    peers = state.config.peers
    if not peers or request.headers.get(PEER_HEADER):
        return
    task = asyncio.create_task(pass_on(peers, method, path, state.config.admin_bearer, **kw))
    state.background.add(task)
    task.add_done_callback(state.background.discard)


def _worker_url(url: str) -> str:
    """``url`` normalized, or a 400 naming ``url``."""
    try:
        return normalize_url(url)
    except ValueError as e:
        raise APIError(400, str(e), param="url") from None


def _add_generation_routes(app: FastAPI, state: GatewayState) -> None:
    # The well-formed requests of these routes are served by ``DirectRoute``
    # before they get here; these serve the rest (and describe the API).
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        return await _completions(state, req, request)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request) -> Response:
        return await _chat(state, req, request)


async def _completions(state: GatewayState, req: CompletionRequest, request: Request) -> Response:
    await _ready(state)
    _check_model(state, req.model)
    assert state.tokenizer is not None
    prompts = completion_prompts(req.prompt, state.tokenizer, state.vocab_size)
    await _admit(state, request, req, prompts)
    constraint = Constraint(
        structured_outputs_grammar(req.structured_outputs), "structured_outputs"
    )
    return await _generate(state, req, prompts, CompletionShape, _received(request), constraint)


async def _chat(state: GatewayState, req: ChatCompletionRequest, request: Request) -> Response:
    await _ready(state)
    _check_model(state, req.model)
    assert state.tokenizer is not None
    check_messages(req.messages)
    msgs = [m.model_dump(exclude_none=True) for m in req.messages]
    tools = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    constraint = one_constraint(
        Constraint(response_format_grammar(req.response_format), "response_format"),
        Constraint(structured_outputs_grammar(req.structured_outputs), "structured_outputs"),
        tools.constraint,
    )
    try:
        ids = state.tokenizer.chat_ids(
            template_messages(msgs),
            add_generation_prompt=req.add_generation_prompt,
            tools=tools.tools,
        )
    except ValueError as e:
        raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from None
    await _admit(state, request, req, [ids])
    return await _generate(state, req, [ids], ChatShape, _received(request), constraint, tools)


class DirectRoute:
    """A generation route served without FastAPI's routing and dependency
    machinery, which cost about 0.4 ms per request on a 2-core host (about
    half of it solving the route's parameters) where the route's own work
    before dispatch is 0.1 ms.

    Invariant: the answer is the FastAPI route's. Only requests FastAPI would
    read the same way are taken: a JSON content type (or none) and a body
    msgspec parses to an object; everything else (another content type,
    bytes that are no JSON, NaN and the like, a body of another JSON type)
    goes on to the route, which answers as it always did. A taken body is
    validated by the same pydantic model, and its errors, API errors and
    unexpected exceptions are answered by the same functions as the app's
    exception handlers."""

    def __init__(
        self,
        state: GatewayState,
        model: type[GenerationRequest],
        handler: Callable[[GatewayState, Any, Request], Coroutine[Any, Any, Response]],
    ) -> None:
        self.state, self.model, self.handler = state, model, handler

    async def __call__(self, scope: Any, receive: Any, send: Any) -> Any:
        """Serve the request and return None; or, when it is not one this path
        takes, the ``receive`` the route must read the request from (the body
        already read is handed on first)."""
        if not _json_content(scope):
            return receive
        body, replay, whole = await buffer_body(receive)
        if not whole:
            return replay
        try:
            data = msgspec.json.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError):
            data = None
        if not isinstance(data, dict):
            return replay
        request = Request(scope, replay, send)
        try:
            req = self.model.model_validate(data)
        except ValidationError as e:
            # As FastAPI reports a body parameter's errors (its handler: the
            # first error, its location under "body").
            first = e.errors(include_url=False)[:1]
            error = _validation_error({**first[0], "loc": ("body", *first[0]["loc"])})
            await error.response()(scope, replay, send)
            return None
        try:
            response = await self.handler(self.state, req, request)
        except APIError as e:
            response = _api_error_response(self.state, e)
        except Exception as e:
            log.exception("POST %s failed", scope["path"])
            response = _api_error_response(self.state, internal_error(e))
        await response(scope, replay, send)
        return None


def _json_content(scope: Any) -> bool:
    """Whether FastAPI reads this request's body as JSON (no content type, or
    application/json or application/*+json)."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            mime = value.split(b";", 1)[0].strip().lower()
            return mime == b"application/json" or (
                mime.startswith(b"application/") and mime.endswith(b"+json")
            )
    return True


def _direct_routes(state: GatewayState) -> dict[str, DirectRoute]:
    return {
        "/v1/completions": DirectRoute(state, CompletionRequest, _completions),
        "/v1/chat/completions": DirectRoute(state, ChatCompletionRequest, _chat),
    }


async def _ready(state: GatewayState) -> None:
    """Wait (bounded) for a worker when none is up yet; 503 after that."""
    try:
        await state.wait_ready()
    except NoWorkerAvailable as e:
        raise APIError(503, str(e), type_="server_error", code="no_worker") from None


async def _admit(
    state: GatewayState, request: Request, req: GenerationRequest, prompts: list[list[int]]
) -> None:
    """Take an admission slot for the request (429 with Retry-After when the
    gateway is at capacity); ``Guards`` gives it back when the response is out."""
    n = req.n or 1
    asked = getattr(req, "max_completion_tokens", None) or req.max_tokens
    tokens = sum(
        n * (len(ids) + (asked or max(0, state.max_model_len - len(ids)))) for ids in prompts
    )
    try:
        await state.admit(tokens)
    except Overloaded as e:
        raise APIError(
            429,
            f"{e} (retry after {e.retry_after}s)",
            type_="rate_limit_error",
            code="rate_limit_exceeded",
            headers={"Retry-After": e.retry_after},
        ) from None
    request.scope.setdefault("state", {})[RELEASE_SLOT] = state.admission.release


def _received(request: Request) -> float:
    """When the request came in (stamped by ``Guards``; now, without it)."""
    return request.scope.get("state", {}).get(RECEIVED_AT) or time.monotonic()


def _check_model(state: GatewayState, name: str) -> None:
    if name != state.model_name:
        raise APIError(
            404,
            f"the model {name!r} does not exist; this server serves {state.model_name!r}",
            param="model",
            code="model_not_found",
        )


async def _generate(
    state: GatewayState,
    req: GenerationRequest,
    prompts: list[list[int]],
    shape_type: type[ResponseShape],
    received: float | None = None,
    constraint: Constraint = Constraint(),
    tools: ToolPlan = ToolPlan(),
) -> Response:
    """``req.n`` choices per prompt, as one response of ``shape_type``'s shape;
    ``received``: when the request came in (the prompts are tokenized now);
    ``constraint``: the grammar of every choice; ``tools``: how tool calls
    are found in the text."""
    tokenized = time.monotonic()
    cfg, tokenizer = state.config, state.tokenizer
    assert tokenizer is not None
    check_choices(req.n)
    check_seed(req.seed)
    check_token_ids(req.stop_token_ids or [], state.vocab_size, "stop_token_ids")
    shape = shape_type.for_request(req, tokenizer)
    stops = stop_strings(req.stop)
    requested, max_tokens_param = requested_max_tokens(req, shape.default_max_tokens)
    choice_prompts, specs = [], []
    max_model_len = state.max_model_len
    for ids in prompts:
        max_tokens = check_lengths(
            ids,
            requested,
            shape.prompt_param,
            context_length=state.context_length,
            max_model_len=max_model_len,
            max_prompt_tokens=cfg.max_prompt_tokens,
            max_tokens_param=max_tokens_param,
        )
        for i in range(req.n):
            choice_prompts.append(ids)
            seed = choice_seed(req.seed, i)
            specs.append(sampling_params(req, max_tokens, seed, shape.top_k or 0, state.vocab_size))
    if constraint.grammar is not None:
        specs = [with_grammar(s, constraint.grammar) for s in specs]
    rid = shape.id_prefix + secrets.token_hex(12)
    traces = [RequestTrace(received or tokenized, tokenized) for _ in specs]
    # The request fields behind what a worker may refuse of the request itself.
    error_params = {PROMPT_PARAM: shape.prompt_param}
    if constraint.param:
        error_params[GRAMMAR_PARAM] = constraint.param
    gens = [
        choice_stream(
            state.dispatcher, tokenizer, ids, spec, stops, f"{rid}-{i}", traces[i], error_params
        )
        for i, (ids, spec) in enumerate(zip(choice_prompts, specs))
    ]
    if scores_prompt_only(req):
        gens = [prompt_only(g) for g in gens]  # type: ignore[misc]
    if tools.mode != "none":
        tool_format = parser_for_template(tokenizer.chat_template_text)
        gens = [tool_call_events(g, tools.parser(tool_format)) for g in gens]  # type: ignore[misc]
    if req.stream and constraint.grammar is not None:
        # A grammar the workers refuse is a 400, not an error inside a 200 stream.
        gens[0] = await first_event_checked(gens[0], cfg.request_timeout_s)
    started = time.monotonic()
    state.metrics.requests.inc(shape.endpoint)
    ctx = ResponseContext(
        shape, rid, state.model_name, prompts, choice_prompts, req.n, req.return_token_ids
    )
    if req.stream:
        # The requests go out now; the response starts while the workers compute.
        # Two turns of the loop: one for each choice's task to route and send
        # (colocated), one for the prefill and decode sends of a disaggregated one.
        eager = [EagerStream(g) for g in gens]
        for _ in range(2):
            await asyncio.sleep(0)
        events = sse_stream(
            ctx,
            eager,  # type: ignore[arg-type]
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            metrics=state.metrics,
            timeout_s=cfg.request_timeout_s,
            started=started,
            traces=traces,
        )
        return ClosingStreamingResponse(events, media_type="text/event-stream", closing=eager)
    timing = RequestTiming(state.metrics, len(gens), started)
    ok = False
    try:
        results = await collect_choices(gens, timing, cfg.request_timeout_s)
        ok = True
    finally:
        for trace in traces:
            state.metrics.stages.finish(trace, ok)
    state.metrics.e2e.observe(time.monotonic() - started)
    return JSONResponse(full_response(ctx, results))
