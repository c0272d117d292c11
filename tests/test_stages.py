"""Stage timing without processes: the clock and its intervals, the histogram
family, the worker's stage book, the wire field, the spans hook, and the
gateway's fast streaming path (chunk templates, merged deltas, the stream
deadline) against the general one."""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from gateway.metrics import GatewayMetrics, RequestTiming
from gateway.openai.choices import ChoiceEvent, collect_choices
from gateway.openai.errors import APIError
from gateway.openai.responses import ResponseContext
from gateway.openai.shapes import ChatShape, CompletionShape
from gateway.openai.sse import StreamWriter, sse_stream
from gateway.stages import RequestTrace, StageMetrics
from protocol import stages as st
from protocol import to_gateway
from protocol.client import WorkerTimeout, merge_deltas
from protocol.finish import FinishReason
from protocol.prometheus import HistogramFamily
from protocol.to_gateway import TokenDelta, Tokens
from protocol.tracing import StageSpans, trace_ids
from worker.stages import StageBook

# -- the clock -----------------------------------------------------------------------


def test_clock_first_stamp_wins_and_offsets() -> None:
    clock = st.StageClock(10.0)
    clock.mark(st.ADMITTED, 10.5)
    clock.mark(st.ADMITTED, 11.0)  # a later stamp of the same stage is ignored
    clock.mark(st.FORWARD_STARTED, 10.75)
    assert clock.offsets() == {st.RECEIVED: 0.0, st.ADMITTED: 0.5, st.FORWARD_STARTED: 0.75}
    got = st.durations(clock.offsets(), st.WORKER_INTERVALS)
    assert got == {"admit": 0.5, "queue": 0.25}  # only intervals with both ends


def test_interval_stages_are_known_names() -> None:
    names = {v for k, v in vars(st).items() if k.isupper() and isinstance(v, str)}
    for iv in (*st.GATEWAY_INTERVALS, *st.WORKER_INTERVALS):
        assert iv.start in names and iv.end in names, iv


# -- histograms ------------------------------------------------------------------------


def test_histogram_family_renders_and_round_trips() -> None:
    fam = HistogramFamily("x_stage_seconds", "help", ("stage",))
    for v in (0.00005, 0.002, 0.002, 3.0, 100.0):
        fam.observe(("queue",), v)
    fam.observe(("admit",), 0.01)
    text = "\n".join(fam.render({"role": "both"}))
    assert "# TYPE x_stage_seconds histogram" in text
    assert 'x_stage_seconds_bucket{role="both",stage="queue",le="0.0001"} 1' in text
    assert 'x_stage_seconds_bucket{role="both",stage="queue",le="0.0025"} 3' in text
    assert 'x_stage_seconds_bucket{role="both",stage="queue",le="+Inf"} 5' in text
    assert 'x_stage_seconds_count{role="both",stage="queue"} 5' in text
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(fam.snapshot()))
    assert HistogramFamily.from_snapshot(wire).render() == fam.render()


# -- the wire ----------------------------------------------------------------------------


class _OldTokenDelta(msgspec.Struct, array_like=True, frozen=True):
    """TokenDelta as it was before it carried stages."""

    rid: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


class _OldTokens(msgspec.Struct, tag="tokens", frozen=True):
    deltas: list[_OldTokenDelta]


def test_stages_field_is_backward_tolerant() -> None:
    new = TokenDelta("r", [1], [-0.5], "stop", 3, stages={st.RECEIVED: 0.0, st.FINISHED: 0.2})
    old = msgspec.msgpack.decode(to_gateway.encoder.encode(Tokens([new])), type=_OldTokens)
    assert old.deltas[0].rid == "r" and old.deltas[0].finish_reason == "stop"
    frame = msgspec.msgpack.encode(_OldTokens([_OldTokenDelta("r", [1], [-0.5], "stop")]))
    assert to_gateway.decoder.decode(frame).deltas[0].stages is None


# -- the worker's stage book ---------------------------------------------------------------


def test_stage_book_stamps_and_attaches_stages_to_the_final_delta() -> None:
    book = StageBook("both")
    t = time.monotonic()
    book.open("a", t)
    book.mark("a", st.ADMITTED, t + 0.001)
    book.forward_started(["a", "unknown"], t + 0.002)
    book.forward_started(["a"], t + 0.5)  # a later forward is not the first one
    book.forward_finished(["a"], t + 0.003)
    book.tokens_sampled(["a"], t + 0.003)
    sent = book.on_send([TokenDelta("a", [7], [-0.1])], t + 0.004)
    assert sent[0].stages is None  # only the final delta carries them
    (final,) = book.on_send([TokenDelta("a", [8], [-0.1], "length")], t + 0.01)
    stages = final.stages
    assert stages is not None and len(book) == 0
    order = [
        st.RECEIVED,
        st.ADMITTED,
        st.FORWARD_STARTED,
        st.FORWARD_FINISHED,
        st.FIRST_TOKEN,
        st.FIRST_TOKEN_SENT,
        st.FINISHED,
    ]
    assert list(stages) == order
    assert [stages[s] for s in order] == sorted(stages[s] for s in order)
    assert stages[st.FIRST_TOKEN_SENT] == pytest.approx(0.004)
    assert book.histograms.count(("first_forward",)) == 1
    assert book.histograms.count(("total",)) == 1


def test_stage_book_held_record_closes_when_released() -> None:
    book = StageBook("prefill")
    t = time.monotonic()
    book.open("p", t)
    book.hold("p")
    (final,) = book.on_send([TokenDelta("p", [5], [-0.2], FinishReason.PREFILL_DONE)], t + 0.01)
    assert final.stages is not None and st.FIRST_TOKEN_SENT in final.stages
    assert len(book) == 1  # the room's KV is still moving
    book.mark("p", st.LAST_CHUNK_PUSHED, t + 0.011)
    book.mark("p", st.WRITES_LANDED, t + 0.02)
    book.release("p")
    assert len(book) == 0
    assert book.histograms.count(("kv_tail",)) == 1


def test_stage_book_leaves_failed_requests_out_of_the_histograms() -> None:
    book = StageBook("both")
    book.open("e", time.monotonic())
    book.on_send([TokenDelta("e", [], [], "error", 0, "bad")], time.monotonic())
    assert len(book) == 0 and book.histograms.count(("total",)) == 0


# -- the spans hook -----------------------------------------------------------------------


class _Span:
    def __init__(self, name: str, context: Any, start_time: int, attributes: Any) -> None:
        self.name, self.context, self.start, self.attributes = name, context, start_time, attributes
        self.end_time: int | None = None

    def end(self, end_time: int) -> None:
        self.end_time = end_time


class _Tracer:
    def __init__(self) -> None:
        self.spans: list[_Span] = []

    def start_span(self, name: str, context: Any, start_time: int, attributes: Any) -> _Span:
        span = _Span(name, context, start_time, attributes)
        self.spans.append(span)
        return span


def test_spans_share_the_trace_of_the_request_id(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("opentelemetry")
    from opentelemetry.trace import get_current_span

    monkeypatch.delenv("DISAGG_SERVE_OTEL", raising=False)
    assert StageSpans.from_env("gateway") is None  # off unless asked for
    monkeypatch.setenv("DISAGG_SERVE_OTEL", "1")
    assert StageSpans.from_env("gateway") is not None

    tracer = _Tracer()
    t = time.monotonic()
    stamps = {st.RECEIVED: t, st.ADMITTED: t + 0.001, st.FINISHED: t + 0.01}
    StageSpans(tracer, "decode worker").emit("rid-1", stamps, st.WORKER_INTERVALS)
    root, *children = tracer.spans
    assert root.name == "decode worker"
    assert {c.name for c in children} == {"admit", "total"}
    trace_id, parent_id = trace_ids("rid-1")
    parent = get_current_span(root.context).get_span_context()
    assert (parent.trace_id, parent.span_id) == (trace_id, parent_id)
    assert all(c.end_time is not None and c.end_time >= c.start for c in children)
    assert root.end_time - root.start == pytest.approx(1e7, rel=0.01)


# -- the gateway: merged deltas, chunk templates, deadline -------------------------------------


def test_merge_deltas_takes_what_is_queued_and_stops_before_errors() -> None:
    first = TokenDelta("r", [1], [-0.1])
    rest: deque[Any] = deque(
        [
            TokenDelta("r", [2], [-0.2], None, 4),
            TokenDelta("r", [3], [-0.3], "length", 4, stages={st.RECEIVED: 0.0}),
        ]
    )
    merged = merge_deltas(first, rest)
    assert merged.token_ids == [1, 2, 3] and merged.logprobs == [-0.1, -0.2, -0.3]
    assert merged.finish_reason == "length" and merged.num_cached_tokens == 4
    assert merged.stages == {st.RECEIVED: 0.0} and not rest

    rest = deque([TokenDelta("r", [2], [-0.2]), TokenDelta("r", [], [], "abort")])
    merged = merge_deltas(first, rest)
    assert merged.token_ids == [1, 2] and merged.finish_reason is None
    assert len(rest) == 1  # the abort comes on its own, after the tokens

    rest = deque([WorkerTimeout("x")])
    assert merge_deltas(first, rest) is first and len(rest) == 1

    tops = TokenDelta("r", [1], [-0.1], top_logprobs=[[(1, -0.1)]])
    rest = deque([TokenDelta("r", [2], [-0.2], top_logprobs=[[(2, -0.2)]])])
    assert merge_deltas(tops, rest).top_logprobs == [[(1, -0.1)], [(2, -0.2)]]


class _Tok:
    """The bit of a tokenizer the response shapes use."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(0x61 + i % 26) for i in ids)

    def token_bytes(self, token_id: int) -> bytes:
        return self.decode([token_id]).encode()


def _ctx(shape: Any, return_token_ids: bool = False) -> ResponseContext:
    return ResponseContext(shape, "cmpl-x", "m", [[1, 2]], [[1, 2]], 1, return_token_ids)


TEXTS = ["a", " the", 'quo"te', "back\\slash", "new\nline", "tab\t", "\x01", "é ü ☃ 😀", "\ufffd"]


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("chat", [True, False])
def test_chunk_template_matches_the_general_chunk(chat: bool, include_usage: bool) -> None:
    tok: Any = _Tok()
    shape = ChatShape(tok, None) if chat else CompletionShape(tok, None)
    fast = StreamWriter(_ctx(shape), include_usage)
    for text in TEXTS:
        ev = ChoiceEvent(text, [3], [-0.5], None, 0)
        got = fast.event(0, ev)
        want = fast.chunk([shape.chunk_choice(0, text, None, None)])
        assert got == want
        assert json.loads(got[len("data: ") :])["choices"][0]  # valid JSON


def test_chunks_with_more_than_text_take_the_general_path() -> None:
    tok: Any = _Tok()
    shape = CompletionShape(tok, 0)  # logprobs asked for
    writer = StreamWriter(_ctx(shape, return_token_ids=True), False)
    chunk = writer.event(0, ChoiceEvent("ab", [0, 1], [-0.1, -0.2], None, 0))
    assert chunk is not None
    body = json.loads(chunk[len("data: ") :])
    assert body["prompt_token_ids"] == [1, 2]
    assert body["choices"][0]["token_ids"] == [0, 1]
    assert body["choices"][0]["logprobs"]["tokens"] == ["a", "b"]


def test_itl_counts_every_token_of_a_merged_event() -> None:
    metrics = GatewayMetrics()
    timing = RequestTiming(metrics, 1, time.monotonic())
    timing.observe(0, 1)
    timing.observe(0, 3)
    assert metrics.ttft.n == 1 and metrics.itl.n == 3


async def _slow_source(swallow_cancel: bool = False) -> Any:
    """One event, a long wait, another event. ``swallow_cancel``: a source
    below that loses a cancel of the wait and yields on (then waits again)."""
    yield ChoiceEvent("a", [1], [0.0], None, 0)
    try:
        await asyncio.sleep(10)
    except asyncio.CancelledError:
        if not swallow_cancel:
            raise
    yield ChoiceEvent("b", [2], [0.0], None, 0)
    await asyncio.sleep(10)
    yield ChoiceEvent("c", [3], [0.0], FinishReason.LENGTH, 0)


def _sse(source: Any, timeout_s: float) -> AsyncIterator[str]:
    shape = CompletionShape(_Tok(), None)  # type: ignore[arg-type]
    return sse_stream(
        _ctx(shape),
        [source],
        include_usage=False,
        metrics=GatewayMetrics(),
        timeout_s=timeout_s,
        started=time.monotonic(),
    )


def _texts(chunks: list[str]) -> list[str]:
    """What each SSE event is: the text of a chunk, the error code, or DONE."""
    out = []
    for chunk in chunks:
        data = chunk.removeprefix("data: ").strip()
        if data == "[DONE]":
            out.append("DONE")
            continue
        body = json.loads(data)
        out.append(body["error"]["code"] if "error" in body else body["choices"][0]["text"])
    return out


def test_stream_deadline_interrupts_only_the_wait() -> None:
    async def consumer_busy_past_the_deadline() -> list[str]:
        chunks = []
        async for chunk in _sse(_slow_source(), 0.05):
            chunks.append(chunk)
            await asyncio.sleep(0.1)  # the deadline passes here: not interrupted
        assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
        return _texts(chunks)

    assert asyncio.run(consumer_busy_past_the_deadline()) == ["a", "timeout", "DONE"]

    async def waiting_at_the_deadline() -> tuple[list[str], float]:
        t0 = time.monotonic()
        chunks = [chunk async for chunk in _sse(_slow_source(), 0.05)]
        assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
        return _texts(chunks), time.monotonic() - t0

    texts, took = asyncio.run(waiting_at_the_deadline())
    assert texts == ["a", "timeout", "DONE"] and took < 5

    async def cancel_lost_below() -> tuple[list[str], float]:
        t0 = time.monotonic()
        chunks = [chunk async for chunk in _sse(_slow_source(swallow_cancel=True), 0.05)]
        return _texts(chunks), time.monotonic() - t0

    texts, took = asyncio.run(cancel_lost_below())
    assert texts == ["a", "timeout", "DONE"] and took < 5  # "b" is not read


def test_collect_choices_times_out_the_wait_and_a_lost_cancel() -> None:
    async def collect(source: Any, timeout_s: float) -> tuple[APIError, float]:
        t0 = time.monotonic()
        timing = RequestTiming(GatewayMetrics(), 1, t0)
        with pytest.raises(APIError) as e:
            await collect_choices([source], timing, timeout_s)
        assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
        return e.value, time.monotonic() - t0

    for swallow in (False, True):
        error, took = asyncio.run(collect(_slow_source(swallow), 0.05))
        assert error.status == 504 and took < 5, swallow

    async def cancelled_from_outside() -> float:
        timing = RequestTiming(GatewayMetrics(), 1, time.monotonic())
        task = asyncio.ensure_future(collect_choices([_slow_source(True)], timing, 60))
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task  # at the next event: the source lost the cancel
        return time.monotonic() - t0

    assert asyncio.run(cancelled_from_outside()) < 5


def test_trace_finish_observes_gateway_and_worker_stages() -> None:
    metrics = StageMetrics()
    t = time.monotonic()
    trace = RequestTrace(t, t + 0.001)
    trace.mark(st.DISPATCHED, t + 0.002)
    trace.mark(st.FIRST_TOKEN_RECEIVED, t + 0.01)
    trace.mark(st.FIRST_BYTE_WRITTEN, t + 0.011)
    trace.report("decode", {st.RECEIVED: 0.0, st.ADMITTED: 0.001, st.FINISHED: 0.05})
    metrics.finish(trace, ok=True)
    for name in ("tokenize", "route", "dispatch_to_first_token", "first_token_to_first_byte"):
        assert metrics.gateway.count((name,)) == 1, name
    assert metrics.workers.count(("decode", "admit")) == 1
    text = "\n".join(metrics.render())
    assert 'gateway_worker_stage_seconds_count{role="decode",stage="total"} 1' in text
    failed = RequestTrace(t, t)
    metrics.finish(failed, ok=False)
    assert metrics.gateway.count(("total",)) == 1  # failures are left out


class _Deltas:
    """A dispatcher that streams the given deltas."""

    def __init__(self, deltas: list[TokenDelta]) -> None:
        self.deltas = deltas

    async def stream(self, prompt_ids: Any, spec: Any, request_id: Any = None) -> Any:
        for d in self.deltas:
            yield d


@pytest.mark.parametrize("stop", ["quick", "fox jumps", "dog", "never there"])
def test_merged_delta_ends_at_the_token_that_completes_a_stop(model_dir: str, stop: str) -> None:
    """A stop string inside a merged delta ends the choice at the same token,
    with the same text, token ids and logprobs, as one delta per token."""
    from gateway.openai.choices import choice_stream
    from gateway.text import Tokenizer
    from protocol.sampling import SamplingParams

    tok = Tokenizer.from_dir(model_dir)
    ids = tok.encode("The quick brown fox jumps over the lazy dog", add_special_tokens=False)
    lps = [-0.1 * (i + 1) for i in range(len(ids))]

    def run(deltas: list[TokenDelta]) -> tuple[str, list[int], list[float], str | None]:
        async def go() -> list[ChoiceEvent]:
            gen = choice_stream(
                _Deltas(deltas),
                tok,
                [1],
                SamplingParams(max_tokens=64),
                [stop],
                "r",  # type: ignore[arg-type]
            )
            return [ev async for ev in gen]

        events = asyncio.run(go())
        text = "".join(e.text for e in events)
        got_ids = [t for e in events for t in e.token_ids]
        got_lps = [x for e in events for x in e.logprobs]
        return text, got_ids, got_lps, events[-1].finish_reason

    one_by_one = [
        TokenDelta("r", [t], [lp], "length" if i == len(ids) - 1 else None)
        for i, (t, lp) in enumerate(zip(ids, lps))
    ]
    merged = [TokenDelta("r", ids[:2], lps[:2]), TokenDelta("r", ids[2:], lps[2:], "length")]
    want = run(one_by_one)
    assert run(merged) == want
    assert stop not in want[0]
    assert want[3] == ("length" if stop == "never there" else "stop")
    if stop in ("quick", "fox jumps"):  # the tokens after the stop are not the choice's
        assert len(want[1]) < len(ids)
