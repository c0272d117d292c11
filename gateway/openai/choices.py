"""The choices of one request: each a stream of detokenized text cut at its
stop strings, merged as their events arrive, under one deadline."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import NamedTuple

from gateway.dispatch import Dispatcher, NoWorkerAvailable
from gateway.metrics import RequestTiming
from gateway.openai.errors import APIError, request_timeout
from gateway.text import IncrementalDetokenizer, StopStringMatcher, Tokenizer
from protocol.client import WorkerError
from protocol.sampling import SamplingParams

TopLogprobs = list[list[tuple[int, float]]] | None
"""Per token, the most likely (token id, logprob) pairs (None: not asked for)."""


class ChoiceEvent(NamedTuple):
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    cached_tokens: int
    top_logprobs: TopLogprobs = None


async def choice_stream(
    dispatcher: Dispatcher,
    tokenizer: Tokenizer,
    prompt: list[int],
    spec: SamplingParams,
    stops: list[str],
    request_id: str,
) -> AsyncIterator[ChoiceEvent]:
    """One completion: detokenized deltas, cut at the first stop string."""
    detok = IncrementalDetokenizer(tokenizer)
    matcher = StopStringMatcher(stops) if stops else None
    stream = dispatcher.stream(prompt, spec, request_id)
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


async def collect_choices(
    gens: list[AsyncIterator[ChoiceEvent]], timing: RequestTiming, timeout_s: float
) -> list[list[ChoiceEvent]]:
    """Every event of every choice, per choice; a 504 ``APIError`` past ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):
            results: list[list[ChoiceEvent]] = [[] for _ in gens]
            async for i, ev in merge_choices(gens):
                timing.observe(i, len(ev.token_ids))
                results[i].append(ev)
    except TimeoutError:
        raise request_timeout(timeout_s) from None
    return results


async def until(
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


def join_events(events: list[ChoiceEvent]) -> tuple[list[int], list[float], TopLogprobs]:
    """The token ids, logprobs and top logprobs of ``events``, in order."""
    ids = [t for e in events for t in e.token_ids]
    lps = [x for e in events for x in e.logprobs]
    if all(e.top_logprobs is None for e in events):
        return ids, lps, None
    return ids, lps, [t for e in events for t in (e.top_logprobs or [[] for _ in e.token_ids])]
