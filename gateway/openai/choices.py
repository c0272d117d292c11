"""The choices of one request: each a stream of detokenized text cut at its
stop strings, merged as their events arrive, under one deadline."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import Any, NamedTuple

from gateway.dispatch import Dispatcher, NoWorkerAvailable
from gateway.metrics import RequestTiming
from gateway.openai.errors import APIError, request_timeout
from gateway.stages import RequestTrace, current_trace
from gateway.text import IncrementalDetokenizer, StopStringMatcher, Tokenizer
from protocol.client import WorkerError
from protocol.finish import FAILED, FinishReason
from protocol.sampling import SamplingParams
from protocol.to_gateway import TokenDelta

TopLogprobs = list[list[tuple[int, float]]] | None
"""Per token, the most likely (token id, logprob) pairs (None: not asked for)."""
PromptLogprobs = tuple[list[float], list[list[tuple[int, float]]]]
"""The logprob of each prompt token but the first, and its alternatives."""


class ChoiceEvent(NamedTuple):
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    cached_tokens: int
    top_logprobs: TopLogprobs = None
    tool_calls: list[dict[str, Any]] | None = None
    """Tool calls completed by this event, in OpenAI's streamed form (each
    with its ``index`` in the choice); see ``gateway.openai.tools``."""
    prompt_logprobs: PromptLogprobs | None = None
    """On the first event, when asked for: the prompt's logprobs (see
    ``gateway.openai.prompt_scoring``)."""


_new_event = tuple.__new__
"""``ChoiceEvent`` from a tuple of all its fields, in order (``_EVENT_FIELDS``)."""
_EVENT_FIELDS = (
    "text",
    "token_ids",
    "logprobs",
    "finish_reason",
    "cached_tokens",
    "top_logprobs",
    "tool_calls",
    "prompt_logprobs",
)
if ChoiceEvent._fields != _EVENT_FIELDS:  # the tuples built with _new_event would be wrong
    raise ImportError(f"ChoiceEvent's fields changed: {ChoiceEvent._fields}; update _new_event")


async def choice_stream(
    dispatcher: Dispatcher,
    tokenizer: Tokenizer,
    prompt: list[int],
    spec: SamplingParams,
    stops: list[str],
    request_id: str,
    trace: RequestTrace | None = None,
    error_params: dict[str, str] | None = None,
) -> AsyncIterator[ChoiceEvent]:
    """One completion: detokenized deltas, cut at the first stop string.
    ``trace`` collects the choice's stages (the dispatcher finds it in
    ``current_trace``, set for the task that runs this stream).
    ``error_params``: the request field behind each parameter a worker can
    refuse (a delta's ``error_param``: PROMPT_PARAM, a sampling parameter); such a
    refusal is a 400 naming that field (it would fail on any worker: no
    retry can help). A worker's failure is a 502."""
    detok = IncrementalDetokenizer(tokenizer)
    matcher = StopStringMatcher(stops) if stops else None
    current_trace.set(trace)
    stream = dispatcher.stream(prompt, spec, request_id)
    try:
        async for delta in stream:
            finish = delta.finish_reason
            if finish is not None and finish in FAILED:
                fault = delta.error_param if finish == FinishReason.ERROR else None
                if fault is not None:
                    param = (error_params or {}).get(fault, fault)
                    error = delta.error or "invalid"
                    raise APIError(400, f"{param}: {error}", param=param)
                raise APIError(
                    502,
                    delta.error or f"request {finish}ed by a worker",
                    type_="server_error",
                    code="upstream_error",
                )
            if matcher is None:
                text = detok.push(delta.token_ids)
                if finish is not None:
                    text += detok.flush()
            else:
                text, kept = _through_stops(delta, detok, matcher)
                if kept is not None:
                    tops = delta.top_logprobs
                    yield ChoiceEvent(
                        text,
                        delta.token_ids[:kept],
                        delta.logprobs[:kept],
                        FinishReason.STOP,
                        delta.num_cached_tokens,
                        tops[:kept] if tops is not None else None,
                        prompt_logprobs=_prompt_logprobs(delta),
                    )
                    return  # leaving the stream aborts the request on the workers
                if finish is not None:
                    text += matcher.flush()
            # The tuple built directly: this runs once per token, and the
            # NamedTuple's own constructor is a Python function.
            yield _new_event(
                ChoiceEvent,
                (
                    text,
                    delta.token_ids,
                    delta.logprobs,
                    finish,
                    delta.num_cached_tokens,
                    delta.top_logprobs,
                    None,
                    None if delta.prompt_logprobs is None else _prompt_logprobs(delta),
                ),
            )
            if finish is not None:
                return
    except NoWorkerAvailable as e:
        raise APIError(503, str(e), type_="server_error", code="no_worker") from None
    except WorkerError as e:
        # The dispatcher's errors name the worker and what befell it.
        raise APIError(502, str(e), type_="server_error", code="upstream_error") from None
    finally:
        await stream.aclose()


class EagerStream:
    """``events`` whose first item is being fetched from construction on, in a
    task of its own: a streamed response hands its request to the workers
    right after tokenizing, and starts its HTTP response while they compute,
    rather than before it sends anything (0.5 ms of TTFT on the CPU).

    Invariant: only the first item goes through the task; every later
    ``__anext__`` is the stream's own (no extra frame per token). Cancelling
    the reader while it waits for the first item cancels the task, and so the
    request; ``aclose`` ends both, also when nobody ever read."""

    __slots__ = ("_events", "_first")

    def __init__(self, events: AsyncIterator[ChoiceEvent]) -> None:
        self._events = events
        self._first: asyncio.Task[ChoiceEvent] | None = asyncio.ensure_future(_first(events))

    def __aiter__(self) -> EagerStream:
        return self

    def __anext__(self) -> Awaitable[ChoiceEvent]:
        first = self._first
        if first is None:
            return self._events.__anext__()
        self._first = None
        return first

    async def aclose(self) -> None:
        first, self._first = self._first, None
        if first is not None:
            first.cancel()
            with contextlib.suppress(BaseException):
                await first
        await self._events.aclose()  # type: ignore[attr-defined]


async def _first(events: AsyncIterator[ChoiceEvent]) -> ChoiceEvent:
    return await anext(events)


def _prompt_logprobs(delta: TokenDelta) -> PromptLogprobs | None:
    if delta.prompt_logprobs is None:
        return None
    return delta.prompt_logprobs, delta.prompt_top_logprobs or []


def _through_stops(
    delta: TokenDelta, detok: IncrementalDetokenizer, matcher: StopStringMatcher
) -> tuple[str, int | None]:
    """The text of ``delta`` cut at a stop string, and how many of its tokens
    the choice keeps when one was hit (None: not hit).

    A delta may carry several tokens (deltas merged while the gateway was
    busy): they go through token by token, so that the choice ends, and its
    token ids and usage stop, at the token that completes the stop string,
    exactly as when the tokens came one delta each."""
    ids = delta.token_ids
    final = delta.finish_reason is not None
    if len(ids) <= 1:
        text = detok.push(ids)
        if final:
            text += detok.flush()
        text, hit = matcher.push(text)
        return text, (len(ids) if hit else None)
    parts = []
    last = len(ids) - 1
    for k, token in enumerate(ids):
        piece = detok.push((token,))
        if final and k == last:
            piece += detok.flush()
        piece, hit = matcher.push(piece)
        parts.append(piece)
        if hit:
            return "".join(parts), k + 1
    return "".join(parts), None


async def merge_choices(
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


async def _only(gen: AsyncIterator[ChoiceEvent]) -> AsyncIterator[tuple[int, ChoiceEvent]]:
    async with contextlib.aclosing(gen):  # type: ignore[type-var]
        async for ev in gen:
            yield 0, ev


def choice_events(
    gens: list[AsyncIterator[ChoiceEvent]],
) -> AsyncIterator[tuple[int, ChoiceEvent]]:
    """The events of a request's choices as they arrive, each with its index.
    One choice is read in the caller's task (no task and queue per token);
    several are merged (``merge_choices``). Closing the result closes them."""
    return _only(gens[0]) if len(gens) == 1 else merge_choices(gens)


async def collect_choices(
    gens: list[AsyncIterator[ChoiceEvent]], timing: RequestTiming, timeout_s: float
) -> list[list[ChoiceEvent]]:
    """Every event of every choice, per choice; a 504 ``APIError`` past ``timeout_s``.

    A plain timeout serves here: nothing runs between two waits for an event
    but this loop's own code, so only a wait can be interrupted (a streamed
    response, whose writer holds control between its waits, has
    ``gateway.openai.sse.StreamDeadline``). A cancel that a source below lost
    (it caught the cancel and went on) still stops the reading at the next
    event."""
    task = asyncio.current_task()
    assert task is not None
    cancelling = task.cancelling()
    results: list[list[ChoiceEvent]] = [[] for _ in gens]
    try:
        async with contextlib.aclosing(choice_events(gens)) as events:
            async with asyncio.timeout(timeout_s):
                async for i, ev in events:
                    if task.cancelling() > cancelling:
                        # Lost below us; the timeout makes its own a TimeoutError.
                        raise asyncio.CancelledError
                    timing.observe(i, len(ev.token_ids))
                    results[i].append(ev)
    except TimeoutError:
        raise request_timeout(timeout_s) from None
    return results


def join_events(events: list[ChoiceEvent]) -> tuple[list[int], list[float], TopLogprobs]:
    """The token ids, logprobs and top logprobs of ``events``, in order."""
    ids = [t for e in events for t in e.token_ids]
    lps = [x for e in events for x in e.logprobs]
    if all(e.top_logprobs is None for e in events):
        return ids, lps, None
    return ids, lps, [t for e in events for t in (e.top_logprobs or [[] for _ in e.token_ids])]
