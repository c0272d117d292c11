"""The dispatcher against fake workers on real ZMQ sockets: retry on another
worker only while nothing was produced, and clients of departed workers closed.
The merge of a prefill and a decode stream against scripted streams: order and
failures, whichever side answers first."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio
from workers import free_port

from gateway import routing
from gateway.dispatch import Dispatcher, NoWorkerAvailable, merge_prefill_decode
from gateway.routing import Router, RouterConfig, WorkerInfo
from protocol import to_gateway, to_worker
from protocol.client import WorkerDisconnected, WorkerError, WorkerUnreachable
from protocol.finish import FinishReason
from protocol.sampling import SamplingParams
from protocol.to_gateway import TokenDelta, Tokens
from protocol.to_worker import Abort, Heartbeat

CONNECT_TIMEOUT_S = 0.3


class FakeWorker:
    """A request-plane ROUTER that answers each request with ``tokens`` deltas;
    with ``die_after`` set it closes its socket after that many deltas."""

    def __init__(self, tokens: int = 3, die_after: int | None = None) -> None:
        self.tokens, self.die_after = tokens, die_after
        self.requests: list[str] = []
        self.aborts: list[str] = []
        self.endpoint = ""
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> FakeWorker:
        ctx = zmq.asyncio.Context.instance()
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self._task = asyncio.create_task(self._serve())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if not self.sock.closed:
            self.sock.close(linger=0)

    async def _serve(self) -> None:
        while True:
            ident, frame = await self.sock.recv_multipart()
            msg = to_worker.decoder.decode(frame)
            if isinstance(msg, Heartbeat):
                continue
            if isinstance(msg, Abort):
                self.aborts.append(msg.rid)
                continue
            self.requests.append(msg.rid)
            for i, delta in enumerate(self.replies(msg.rid)):
                if self.die_after is not None and i == self.die_after:
                    self.close()
                    return
                await self.sock.send_multipart([ident, to_gateway.encoder.encode(Tokens([delta]))])

    def replies(self, rid: str) -> list[TokenDelta]:
        """The deltas that answer request ``rid``, one frame each."""
        last = self.tokens - 1
        return [
            TokenDelta(rid, [10 + i], [-0.5], "length" if i == last else None)
            for i in range(self.tokens)
        ]


def router_with(*endpoints: str) -> tuple[Router, list[WorkerInfo]]:
    """Decode-pool workers ("both": no prefill needed) in this order; least_load
    picks the first of equally loaded ones."""
    router = Router(RouterConfig(decode_policy="least_load"))
    workers = []
    for i, ep in enumerate(endpoints):
        w = WorkerInfo(url=f"http://worker-{i}", role="both", request_endpoint=ep)
        workers.append(router.add(w))
    return router, workers


async def collect(stream: AsyncIterator[TokenDelta]) -> list[TokenDelta]:
    return [d async for d in stream]


SPEC = SamplingParams(max_tokens=3, temperature=0.0)


def run(coro) -> None:  # noqa: ANN001
    asyncio.run(coro)


def test_dead_worker_is_skipped_before_dispatch() -> None:
    async def go() -> None:
        async with FakeWorker() as live:
            dead = f"tcp://127.0.0.1:{free_port()}"
            router, (w_dead, w_live) = router_with(dead, live.endpoint)
            d = Dispatcher(router, timeout_s=10, connect_timeout_s=CONNECT_TIMEOUT_S)
            try:
                deltas = await collect(d.stream([1, 2, 3], SPEC, "cmpl-abc-0"))
            finally:
                await d.close()
            assert [t for x in deltas for t in x.token_ids] == [10, 11, 12]
            assert deltas[-1].finish_reason == "length"
            assert len(live.requests) == 1
            # The workers see the response's id (and which attempt this was).
            assert live.requests[0].startswith("cmpl-abc-0-1-")
            # The dead worker is blamed (breaker), the live one is not; loads are back.
            assert w_dead.breaker.failures == 1 and w_live.breaker.failures == 0
            assert w_dead.outstanding_requests == w_live.outstanding_requests == 0
            assert w_dead.outstanding_tokens == w_live.outstanding_tokens == 0

    run(go())


class DrainingWorker(FakeWorker):
    """Refuses every request as a draining worker does (retryable)."""

    def replies(self, rid: str) -> list[TokenDelta]:
        return [TokenDelta(rid, [], [], "error", error="draining", retry=True)]


def test_draining_worker_refusal_goes_to_another_worker() -> None:
    """A worker that refuses a request because it is stopping ran nothing of
    it: the request goes to another worker, and the draining one is out of
    routing at once (not after its health checks fail)."""

    async def go() -> None:
        async with DrainingWorker() as draining, FakeWorker() as live:
            router, (w_draining, w_live) = router_with(draining.endpoint, live.endpoint)
            d = Dispatcher(router, timeout_s=10, connect_timeout_s=CONNECT_TIMEOUT_S)
            try:
                deltas = await collect(d.stream([1, 2, 3], SPEC))
                assert [t for x in deltas for t in x.token_ids] == [10, 11, 12]
                assert len(draining.requests) == 1 and len(live.requests) == 1
                assert not router.is_available(w_draining)
                await collect(d.stream([1, 2, 3], SPEC))
                assert len(draining.requests) == 1 and len(live.requests) == 2
            finally:
                await d.close()

    run(go())


def test_no_worker_left_to_try() -> None:
    async def go() -> None:
        ends = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
        router, workers = router_with(*ends)
        d = Dispatcher(router, timeout_s=10, connect_timeout_s=CONNECT_TIMEOUT_S)
        try:
            with pytest.raises(WorkerUnreachable):
                await collect(d.stream([1], SPEC))
        finally:
            await d.close()
        assert [w.breaker.failures for w in workers] == [1, 1]
        empty = Router()
        with pytest.raises(NoWorkerAvailable):
            await collect(Dispatcher(empty, timeout_s=1).stream([1], SPEC))

    run(go())


def test_attempts_are_bounded() -> None:
    async def go() -> None:
        ends = [f"tcp://127.0.0.1:{free_port()}" for _ in range(4)]
        router, workers = router_with(*ends)
        d = Dispatcher(router, timeout_s=10, connect_timeout_s=0.2, max_attempts=2)
        try:
            with pytest.raises(WorkerUnreachable):
                await collect(d.stream([1], SPEC))
        finally:
            await d.close()
        assert sum(w.breaker.failures for w in workers) == 2

    run(go())


def test_no_retry_once_tokens_are_out() -> None:
    """A worker that dies after its first token ends the request with an error;
    the other worker never sees it."""

    async def go() -> None:
        async with FakeWorker(tokens=3, die_after=1) as dying, FakeWorker() as other:
            router, (w_dying, _) = router_with(dying.endpoint, other.endpoint)
            d = Dispatcher(router, timeout_s=10, connect_timeout_s=CONNECT_TIMEOUT_S)
            got: list[TokenDelta] = []
            try:
                with pytest.raises(WorkerDisconnected):
                    async for delta in d.stream([1, 2], SPEC):
                        got.append(delta)
            finally:
                await d.close()
            assert [t for x in got for t in x.token_ids] == [10]
            assert other.requests == []
            assert w_dying.breaker.failures == 1 and w_dying.outstanding_requests == 0

    run(go())


def test_prune_closes_clients_of_departed_workers() -> None:
    async def go() -> None:
        async with FakeWorker() as a, FakeWorker() as b:
            router, (wa, wb) = router_with(a.endpoint, b.endpoint)
            d = Dispatcher(router, timeout_s=10, connect_timeout_s=CONNECT_TIMEOUT_S)
            try:
                await collect(d.stream([1], SPEC))  # least load: a
                wa.outstanding_tokens = 100  # so that b takes the next one
                await collect(d.stream([1], SPEC))
                wa.outstanding_tokens = 0
                assert sorted(d.endpoints) == sorted([a.endpoint, b.endpoint])
                await d.prune()
                assert len(d.endpoints) == 2, "live workers keep their clients"
                router.remove(wb.url)  # nothing in flight: dropped at once
                wa.healthy = False
                await d.prune()
                assert d.endpoints == []
                # A worker that comes back gets a new client on its next request.
                wa.healthy = True
                await collect(d.stream([1], SPEC))
                assert d.endpoints == [a.endpoint]
            finally:
                await d.close()
            assert len(a.requests) == 2 and len(b.requests) == 1

    run(go())


def test_prune_keeps_the_client_a_verify_waits_on() -> None:
    """A worker being admitted is out of routing (not healthy) until its check
    passes: a health round's prune meanwhile must not close the client the
    check waits on (it did: "its request plane: client is closed")."""

    async def go() -> None:
        endpoint = f"tcp://127.0.0.1:{free_port()}"  # nothing listens: ready() waits
        router, (w,) = router_with(endpoint)
        w.healthy = False
        d = Dispatcher(router, timeout_s=10, connect_timeout_s=CONNECT_TIMEOUT_S)
        try:
            check = asyncio.create_task(d.verify(w))
            while endpoint not in d.endpoints:
                await asyncio.sleep(0.01)
            await d.prune()
            assert d.endpoints == [endpoint], "the client under a check was closed"
            with pytest.raises(routing.WorkerUnreachable) as e:
                await check
            assert "closed" not in str(e.value), e.value
            await d.prune()
            assert d.endpoints == [], "with no check on it, an unhealthy worker's client goes"
        finally:
            await d.close()

    run(go())


# -- merging prefill's first token with decode's stream ----------------------------------


class ScriptedStream:
    """A worker's delta stream fed by the test one item at a time: a
    ``TokenDelta`` is yielded, an exception raised. Notes how many items the
    merge took and whether it closed the stream before its last delta (what
    aborts the request on that worker)."""

    def __init__(self) -> None:
        self.items: asyncio.Queue[TokenDelta | BaseException] = asyncio.Queue()
        self.taken = 0
        self.finished = False
        self.aborted = False

    def send(self, item: TokenDelta | BaseException) -> None:
        self.items.put_nowait(item)

    async def stream(self) -> AsyncIterator[TokenDelta]:
        try:
            while True:
                item = await self.items.get()
                self.taken += 1
                if isinstance(item, BaseException):
                    raise item
                # Closed once its final delta is out: not an abort.
                self.finished = item.finish_reason is not None
                yield item
                if self.finished:
                    return
        finally:
            self.aborted = not self.finished


class MergeRun:
    """``merge_prefill_decode`` over two scripted streams, consumed by a task
    into ``out``."""

    def __init__(self) -> None:
        self.prefill, self.decode = ScriptedStream(), ScriptedStream()
        self.out: list[tuple[TokenDelta, str]] = []
        self.task = asyncio.create_task(self._consume())

    async def _consume(self) -> None:
        merged = merge_prefill_decode(self.prefill.stream(), self.decode.stream())
        async for item in merged:
            self.out.append(item)

    async def result(self) -> None:
        """The merge's end (its exception, if it failed)."""
        await asyncio.wait_for(self.task, 5)


async def settle() -> None:
    """Let every ready task run until all wait again (nothing here does I/O)."""
    for _ in range(20):
        await asyncio.sleep(0)


RID = "cmpl-merge-0"


def test_merge_holds_a_decode_stream_that_ends_before_prefill_answers() -> None:
    """Decode's deltas, its final one included, arrive before prefill's first
    token: they wait, and go out in order after prefill's token."""

    async def go() -> None:
        run = MergeRun()
        d1 = TokenDelta(RID, [11], [-0.5])
        d2 = TokenDelta(RID, [12], [-0.25], "length")
        run.decode.send(d1)
        run.decode.send(d2)
        await settle()
        assert run.out == [], "decode's tokens went out before prefill's"
        assert not run.task.done()
        run.prefill.send(
            TokenDelta(RID, [10], [-1.0], FinishReason.PREFILL_DONE, num_cached_tokens=4)
        )
        await run.result()
        # Prefill's delta goes out as a running one: the request goes on at decode.
        first = TokenDelta(RID, [10], [-1.0], None, num_cached_tokens=4)
        assert run.out == [(first, "prefill"), (d1, "decode"), (d2, "decode")]
        assert run.prefill.taken == 1 and not run.prefill.aborted
        assert run.decode.taken == 2 and not run.decode.aborted

    asyncio.run(go())


def test_merge_holds_a_whole_decode_stream_in_one_final_delta() -> None:
    """Decode's whole stream, merged into one final delta (the gateway fell
    behind and its client merges what piled up), is read before prefill's
    first token: a success, not a refusal; prefill's token still goes first
    (it was dropped, found by the fault matrix)."""

    async def go() -> None:
        run = MergeRun()
        whole = TokenDelta(RID, [11, 12, 13], [-0.5, -0.25, -0.1], "length")
        run.decode.send(whole)
        await settle()
        assert run.out == [] and not run.task.done()
        run.prefill.send(TokenDelta(RID, [10], [-1.0], FinishReason.PREFILL_DONE))
        await run.result()
        first = TokenDelta(RID, [10], [-1.0], None)
        assert run.out == [(first, "prefill"), (whole, "decode")]
        assert not run.prefill.aborted and not run.decode.aborted

    asyncio.run(go())


@pytest.mark.parametrize("how", ["error_delta", "exception"])
def test_merge_decode_failing_before_prefill_answers_aborts_prefill(how: str) -> None:
    """Decode refuses or fails before prefill's first token: the request ends
    with decode's error, and prefill's stream is closed (its request aborted)
    without ever being read; a token it sends later never goes out."""

    async def go() -> None:
        run = MergeRun()
        await settle()
        if how == "error_delta":
            refused = TokenDelta(RID, [], [], "error", error="no room for the KV")
            run.decode.send(refused)
            await run.result()
            assert run.out == [(refused, "decode")]
        else:
            run.decode.send(WorkerDisconnected("decode worker went away"))
            with pytest.raises(WorkerDisconnected, match="decode worker went away"):
                await run.result()
            assert run.out == []
        assert run.prefill.aborted and run.prefill.taken == 0
        run.prefill.send(TokenDelta(RID, [10], [-1.0], FinishReason.PREFILL_DONE))
        await settle()
        assert run.prefill.taken == 0 and len(run.out) == (1 if how == "error_delta" else 0)

    asyncio.run(go())


@pytest.mark.parametrize("how", ["error_delta", "exception"])
def test_merge_prefill_failing_after_decode_started_aborts_decode(how: str) -> None:
    """Decode has sent its first token, still held, when prefill fails: the
    request ends with prefill's error, decode's held token never goes out, and
    decode's stream is closed (its request aborted)."""

    async def go() -> None:
        run = MergeRun()
        run.decode.send(TokenDelta(RID, [11], [-0.5]))
        await settle()
        assert run.decode.taken == 1 and run.out == []
        if how == "error_delta":
            failed = TokenDelta(RID, [], [], "error", error="prefill ran out of pages")
            run.prefill.send(failed)
            await run.result()
            assert run.out == [(failed, "prefill")]
        else:
            run.prefill.send(WorkerError("prefill worker crashed"))
            with pytest.raises(WorkerError, match="prefill worker crashed"):
                await run.result()
            assert run.out == []
        assert run.decode.aborted and run.decode.taken == 1

    asyncio.run(go())
