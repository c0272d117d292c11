"""Streamed responses: a request's choices as server-sent events, in the shape
of their endpoint, ending in ``data: [DONE]``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from json.encoder import encode_basestring  # type: ignore[attr-defined]
from typing import Any

from fastapi.responses import StreamingResponse

from gateway.metrics import GatewayMetrics, RequestTiming
from gateway.openai.choices import ChoiceEvent, join_events, merge_choices
from gateway.openai.errors import APIError, internal_error, request_timeout
from gateway.openai.prompt_scoring import wants_prompt_logprobs, with_prompt_logprobs
from gateway.openai.responses import ResponseContext, now, usage
from gateway.stages import RequestTrace
from protocol.stages import FIRST_BYTE_WRITTEN

DONE = "data: [DONE]\n\n"

log = logging.getLogger("gateway.sse")


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its body iterator.

    Invariant: when a client disconnects mid-stream, its requests are aborted
    on the workers at once. Starlette cancels the sending task on disconnect
    but leaves the body iterator as it is: when the cancellation lands in
    ``send`` (common behind an http middleware, which hands chunks over a
    memory stream) the generator stays suspended at a ``yield`` until garbage
    collection, while its requests run on to their end on the workers.
    """

    def __init__(self, content: Any, *, closing: Sequence[Any] = (), **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.closing = closing
        """Streams the body reads that run before it does (``EagerStream``):
        closed with it, also when the body never started."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
            for stream in self.closing:
                await stream.aclose()


def error_event(error: APIError) -> str:
    return f"data: {json.dumps(error.body())}\n\n"


class StreamDeadline:
    """The deadline of a streamed response, whose events the writer reads in
    its own task (``sse_stream``).

    Invariant: the deadline only ever interrupts the wait for the next event.
    A timeout around a loop that yields would also fire while the consumer
    (the server, sending the chunk) holds control, cancelling it instead of
    us: the stream would then end without its error event and ``[DONE]``. One
    timer serves the whole stream: when it fires during a wait (``waiting``)
    it cancels the task (as ``asyncio.timeout`` does), otherwise the next wait
    does not begin (``expired``).

    Invariant: a cancelled task stops reading at the next event even when a
    source below lost the cancellation (a stream that catches it and yields
    on): the events are read in the task itself, and a client that left must
    still close its requests at once.

    The reader checks ``expired`` before each wait, sets ``waiting`` around
    it, asks ``timed_out`` when the wait was cancelled or a cancel was lost
    below (``task.cancelling()`` above ``cancelling``), and ``close``s the
    deadline when it stops. Inline, not a generator around the events: the
    reader runs once per token."""

    __slots__ = ("task", "cancelling", "expired", "waiting", "_timer")

    def __init__(self, deadline: float) -> None:
        """``deadline``: on the ``time.monotonic`` clock."""
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        self.cancelling = task.cancelling()
        """The task's cancel requests from before: not the stream's to handle."""
        self.expired = False
        self.waiting = False
        loop = asyncio.get_running_loop()
        self._timer = loop.call_at(loop.time() + (deadline - time.monotonic()), self._fire)

    def _fire(self) -> None:
        self.expired = True
        if self.waiting:
            self.task.cancel()

    def timed_out(self) -> bool:
        """A cancel reached the reader: whether it was the deadline's (its
        request is then withdrawn: the caller raises ``TimeoutError``)."""
        return self.expired and self.task.uncancel() <= self.cancelling

    def close(self) -> None:
        self._timer.cancel()


class _ChoiceProgress:
    __slots__ = ("tokens", "cached", "reports_cache", "text_offset", "held", "prompt_sent", "tpl")

    def __init__(self, reports_cache: bool) -> None:
        self.tokens = 0
        self.cached = 0
        self.reports_cache = reports_cache
        """Whether the choice counts its prompt's cached tokens in the usage."""
        self.text_offset = 0
        """Where the choice's next token starts in its text (echo included)."""
        self.held: list[ChoiceEvent] = []
        """Events whose text is still held back (see ``StreamWriter.event``)."""
        self.prompt_sent = False
        self.tpl: tuple[str, str] | None = None
        """(before, after) the JSON string of the text in the choice's text-only chunks."""


_TEXT_SLOT = "\x00text\x00"
"""Stands for a chunk's text while its template is made (JSON-escaped, so it
cannot collide with the rest of the chunk)."""


class StreamWriter:
    """The chunks of one streamed response; with ``include_usage`` every chunk
    carries a ``usage`` (null but in the last one).

    The common chunk (text only: no logprobs, token ids or finish reason) is
    its choice's template around the JSON string of the text: the template is
    that chunk as ``chunk`` writes it, cut at the text, so both ways give the
    same bytes; only the text is encoded per token."""

    def __init__(self, ctx: ResponseContext, include_usage: bool) -> None:
        self.ctx = ctx
        self.include_usage = include_usage
        self.created = now()
        self.choices = [
            _ChoiceProgress(ctx.reports_cache(i)) for i in range(len(ctx.choice_prompts))
        ]
        self._plain = ctx.shape.top_k is None and not ctx.return_token_ids
        """Whether a chunk can be text alone (else every chunk has more)."""
        self.prompt_logprobs = wants_prompt_logprobs(ctx.shape)
        """The echoed prompt waits for its logprobs (``prompt_chunk``)."""
        self._prompt_written: set[int] = set()

    def _template(self, i: int) -> tuple[str, str]:
        """(before, after) the JSON string of the text in choice ``i``'s chunks."""
        progress = self.choices[i]
        tpl = progress.tpl
        if tpl is None:
            whole = self.chunk([self.ctx.shape.chunk_choice(i, _TEXT_SLOT, None, None)])
            before, _, after = whole.partition(json.dumps(_TEXT_SLOT, ensure_ascii=False))
            tpl = progress.tpl = (before, after)
        return tpl

    def chunk(
        self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None, **extra: Any
    ) -> str:
        body: dict[str, Any] = {
            "id": self.ctx.rid,
            "object": self.ctx.shape.chunk_object,
            "created": self.created,
            "model": self.ctx.model,
            "choices": choices,
            **extra,
        }
        if self.include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def opening(self) -> Iterator[str]:
        """The chunks before any token (the assistant role, the echoed prompt)."""
        for i, ids in enumerate(self.ctx.choice_prompts):
            text = self.ctx.shape.prompt_text(ids)
            self.choices[i].text_offset = len(text)
            choice = self.ctx.shape.opening_choice(i, text)
            if choice is not None and not self.prompt_logprobs:
                yield self.chunk([choice])

    def prompt_chunk(self, i: int, ev: ChoiceEvent) -> str | None:
        """The echoed prompt of choice ``i`` with its logprobs, which come with
        the choice's first event (None: not due, or already written)."""
        if not self.prompt_logprobs or i in self._prompt_written:
            return None
        self._prompt_written.add(i)
        ids = self.ctx.choice_prompts[i]
        choice = self.ctx.shape.opening_choice(i, self.ctx.shape.prompt_text(ids))
        assert choice is not None
        choice["logprobs"] = with_prompt_logprobs(self.ctx.shape, ids, [ev], None)
        return self.chunk([choice])

    def event(self, i: int, ev: ChoiceEvent) -> str | None:
        """The chunk of choice ``i``'s event ``ev`` (None: held back)."""
        progress = self.choices[i]
        progress.tokens += len(ev.token_ids)
        if ev.cached_tokens and progress.reports_cache:
            progress.cached = max(progress.cached, ev.cached_tokens)
        plain_event = ev.finish_reason is None and ev.tool_calls is None
        if plain_event and ev.text and self._plain and not progress.held:
            before, after = progress.tpl or self._template(i)
            return before + encode_basestring(ev.text) + after
        ctx = self.ctx
        # Invariant: a choice's streamed token_ids (and logprobs) add up to all
        # of its tokens. A token whose text is still held back (half a UTF-8
        # character, a possible stop-string prefix) sends no chunk of its own,
        # so its ids and logprobs ride on the choice's next chunk instead of
        # being lost.
        if not ev.text and plain_event:
            progress.held.append(ev)
            return None
        events, progress.held = [*progress.held, ev], []
        ids, lps, tops = join_events(events)
        logprobs = ctx.shape.logprobs(ids, lps, tops, progress.text_offset)
        progress.text_offset = ctx.shape.offset_after(progress.text_offset, logprobs)
        choice = ctx.shape.chunk_choice(i, ev.text, logprobs, ev.finish_reason, ev.tool_calls)
        extra = {}
        if ctx.return_token_ids:
            choice["token_ids"] = ids
            if not progress.prompt_sent:
                extra = {"prompt_token_ids": ctx.choice_prompts[i]}
                progress.prompt_sent = True
        return self.chunk([choice], **extra)

    def usage_chunk(self) -> str:
        counts = [p.tokens for p in self.choices]
        cached = [p.cached for p in self.choices]
        return self.chunk([], usage=usage(self.ctx.prompts, counts, cached))


async def sse_stream(
    ctx: ResponseContext,
    gens: list[AsyncIterator[ChoiceEvent]],
    *,
    include_usage: bool,
    metrics: GatewayMetrics,
    timeout_s: float,
    started: float,
    traces: list[RequestTrace] | None = None,
) -> AsyncIterator[str]:
    """The response's events: its chunks, then an error event if it failed
    (the OpenAI error body), then ``[DONE]``. ``traces``: one per choice,
    stamped when the choice's first chunk with text is written and finished
    when the stream ends."""
    writer = StreamWriter(ctx, include_usage)
    timing = RequestTiming(metrics, len(gens), started)
    observe, event = timing.observe, writer.event
    unwritten = set(range(len(gens))) if traces else set()
    """Choices whose first chunk with text is not written yet."""
    ok = False
    for chunk in writer.opening():
        yield chunk
    # One choice is read as it is (its events are choice 0's); several are
    # merged (a task and a queue each). Either way the events are read in
    # this task, under the stream's deadline (``StreamDeadline``).
    single = len(gens) == 1
    source = gens[0] if single else merge_choices(gens)
    try:
        # aclosing: leaving this generator (the client went away) must close the
        # source at once, which cancels the choices and aborts their requests.
        async with contextlib.aclosing(source):  # type: ignore[type-var]
            deadline = StreamDeadline(started + timeout_s)
            task, cancelling = deadline.task, deadline.cancelling
            try:
                while True:
                    if deadline.expired:
                        raise TimeoutError
                    deadline.waiting = True
                    try:
                        item = await anext(source)
                    except StopAsyncIteration:
                        break
                    except asyncio.CancelledError:
                        if deadline.timed_out():
                            raise TimeoutError from None
                        raise
                    finally:
                        deadline.waiting = False
                    if task.cancelling() > cancelling:  # a cancel was lost below us
                        if deadline.timed_out():
                            raise TimeoutError
                        raise asyncio.CancelledError
                    if single:
                        i, ev = 0, item
                    else:
                        i, ev = item
                    observe(i, len(ev.token_ids))
                    if writer.prompt_logprobs:
                        prompt = writer.prompt_chunk(i, ev)
                        if prompt is not None:
                            yield prompt
                    chunk = event(i, ev)
                    if chunk is not None:
                        yield chunk
                        if unwritten and i in unwritten and ev.text:
                            unwritten.discard(i)
                            traces[i].mark(FIRST_BYTE_WRITTEN)  # type: ignore[index]
            finally:
                deadline.close()
    except Exception as e:
        # The response is already out (200): a failure ends it with an error
        # event and [DONE], so the client reads a clean end and the connection
        # stays usable; only a failure the gateway did not expect is logged.
        if isinstance(e, APIError):
            error = e
        elif isinstance(e, TimeoutError):
            error = request_timeout(timeout_s)
        else:
            log.exception("stream %s failed", ctx.rid)
            error = internal_error(e)
        metrics.failures.inc(error.code or str(error.status))
        yield error_event(error)
    else:
        ok = True
        metrics.e2e.observe(time.monotonic() - started)
        if include_usage:
            yield writer.usage_chunk()
    finally:
        for trace in traces or ():
            metrics.stages.finish(trace, ok)
    yield DONE
