"""Sends one request to a prefill and a decode worker and merges their streams:
the first token comes from prefill, the rest from decode, in order."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Callable

import msgspec
import zmq

from gateway import routing
from gateway.routing import Router, WorkerInfo
from gateway.stages import RequestTrace, current_trace
from protocol.auth import ClusterKeys
from protocol.client import (
    DEFAULT_CONNECT_TIMEOUT_S,
    WorkerClient,
    WorkerClientClosed,
    WorkerDisconnected,
    WorkerError,
    WorkerHandshakeFailed,
    WorkerTimeout,
    WorkerUnreachable,
)
from protocol.finish import ENDED, FAILED, WORKER_STOPPED, FinishReason
from protocol.roles import DECODE
from protocol.sampling import SamplingParams
from protocol.stages import DISPATCHED
from protocol.to_gateway import TokenDelta
from protocol.to_worker import Generate, Prefill

log = logging.getLogger("gateway.dispatch")


class NoWorkerAvailable(RuntimeError):
    """No healthy worker can take the request (HTTP 503)."""


class WorkerDraining(WorkerError):
    """The worker refused the request because it is stopping (nothing ran)."""


class _NotDispatched(Exception):
    """``worker`` failed before the request produced anything: it could not be
    handed over, or the connection dropped before the first delta. Safe to send
    the request to another worker."""

    def __init__(self, worker: WorkerInfo, cause: BaseException) -> None:
        super().__init__(f"{worker.url}: {cause}")
        self.worker, self.cause = worker, cause

    def error(self) -> WorkerError:
        """What the caller sees when no other worker is left to try."""
        return worker_error(self.worker, self.cause)


def worker_error(worker: WorkerInfo, e: BaseException) -> WorkerError:
    """``e``, a failure of ``worker``, told of the worker (its role and URL,
    not its request-plane endpoint); of the client's type where it has one."""
    what = f"{worker.role} worker {worker.url}"
    if isinstance(e, WorkerClientClosed):
        return e
    if isinstance(e, WorkerDisconnected):
        return WorkerDisconnected(f"{what} failed (connection lost)")
    if isinstance(e, WorkerTimeout):
        return WorkerTimeout(f"{what} failed ({e})")
    if isinstance(e, WorkerDraining):
        return WorkerDraining(f"{what} is shutting down (draining): it takes no new requests")
    if isinstance(e, WorkerUnreachable):
        return WorkerUnreachable(f"{what} cannot take requests: {e}")
    if isinstance(e, WorkerError):
        return WorkerError(f"{what} failed ({e})")
    return WorkerError(f"{what} cannot take requests: {e}")


def _failure_text(worker: WorkerInfo, error: str | None) -> str:
    """The error of a request that ``worker`` failed (its final delta's
    ``error``), told of the worker."""
    what = f"{worker.role} worker {worker.url}"
    if error == WORKER_STOPPED:
        # Whether it drained, the worker said (``WorkerInfo.stopping``).
        if worker.stopping:
            return f"{what} is shutting down: it stopped before the request ended"
        return f"{what} failed (it stopped while serving the request)"
    return f"{what} failed: {error or 'no reason given'}"


class Dispatcher:
    def __init__(
        self,
        router: Router,
        timeout_s: float,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        max_attempts: int = 3,
        auth: ClusterKeys | None = None,
        wait_for_worker_s: float = 0.0,
    ) -> None:
        self.router = router
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_attempts = max_attempts
        """Workers tried for one request when they fail before it is dispatched."""
        self.auth = auth
        """CURVE keys of the cluster token (None: plaintext request plane)."""
        self.wait_for_worker_s = wait_for_worker_s
        """While no worker can take a request (none up yet, all down for a
        moment), a request waits this long for one before ``NoWorkerAvailable``."""
        self._clients: dict[str, WorkerClient] = {}
        self._verifying: collections.Counter[str] = collections.Counter()
        """Endpoints whose client a ``verify`` is using: ``prune`` keeps them
        (a worker being admitted is not healthy yet, and the health round's
        prune would otherwise close the client its check waits on)."""

    def _on_connection(self, endpoint: str, up: bool, reason: str) -> None:
        """Passive health: a worker whose request-plane connection dropped is
        out of routing at once (the health checker probes it back in)."""
        if up:
            return
        for worker in self.router.workers():
            if worker.request_endpoint == endpoint:
                self.router.mark_down(worker, reason)

    async def _client(self, worker: WorkerInfo) -> WorkerClient:
        endpoint = worker.request_endpoint
        if endpoint is None:
            raise _NotDispatched(worker, RuntimeError("no request endpoint yet"))
        client = self._clients.get(endpoint)
        if client is None:
            url = worker.url
            on_kv = None
            if self.router.config.kv_events and worker.role != DECODE:
                on_kv = lambda batch: self.router.kv_events(url, batch)  # noqa: E731
            client = WorkerClient(
                endpoint,
                timeout_s=self.timeout_s,
                connect_timeout_s=self.connect_timeout_s,
                auth=self.auth,
                on_connection=lambda up, why: self._on_connection(endpoint, up, why),
                on_kv_events=on_kv,
            )
            try:
                await client.start()
            except (zmq.ZMQError, WorkerError) as e:
                raise _NotDispatched(worker, e) from e
            self._clients[endpoint] = client
        return client

    async def prune(self) -> None:
        """Close the clients of workers that left (removed, restarted on another
        endpoint) or are unhealthy, once nothing is in flight on them. A worker
        that comes back gets a new client on its next request. A refused
        worker keeps its client: each health round checks its handshake
        (``verify``) on it, rather than on a new client each time."""
        live = {
            w.request_endpoint
            for w in self.router.workers()
            if (w.healthy or w.refused is not None) and w.request_endpoint
        }
        for endpoint, client in list(self._clients.items()):
            if endpoint not in live and endpoint not in self._verifying and client.in_flight == 0:
                del self._clients[endpoint]
                await client.close()

    async def connect_all(self) -> None:
        """Open a connection to every available worker ahead of its first
        request: its heartbeats then tell of a dead or paused worker before a
        request is routed to it."""
        for worker in self.router.workers():
            if self.router.is_available(worker) and worker.request_endpoint:
                with contextlib.suppress(_NotDispatched):
                    await self._client(worker)

    async def verify(self, worker: WorkerInfo) -> None:
        """Check ``worker``'s request plane as requests will use it: its
        connection comes up (with the cluster token's keys: the handshake
        proves that both sides hold the same token). Raises
        ``gateway.routing.WorkerRefused`` when the handshake fails, and
        ``gateway.routing.WorkerUnreachable`` when no connection comes up
        within the connect timeout. (A health-check hook: ``HealthChecker.checks``.)"""
        endpoint = worker.request_endpoint
        if not endpoint:
            raise routing.WorkerRefused("its /server_info names no request endpoint")
        self._verifying[endpoint] += 1
        try:
            client = await self._client(worker)
            await client.ready()
        except _NotDispatched as e:
            raise routing.WorkerUnreachable(f"its request plane: {e.cause}") from e
        except WorkerHandshakeFailed as e:
            raise routing.WorkerRefused(str(e)) from e
        except WorkerError as e:
            raise routing.WorkerUnreachable(f"its request plane: {e}") from e
        finally:
            self._verifying[endpoint] -= 1
            if not self._verifying[endpoint]:
                del self._verifying[endpoint]

    @property
    def endpoints(self) -> list[str]:
        """Request endpoints this dispatcher holds a client for."""
        return list(self._clients)

    async def close(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            await c.close()

    def _route(
        self, prompt_ids: list[int], exclude: set[str]
    ) -> tuple[WorkerInfo | None, WorkerInfo]:
        prefill = decode = None
        if not self.router.should_skip_prefill(len(prompt_ids), exclude):
            prefill = self.router.pick_prefill(prompt_ids, exclude=exclude)
            if prefill is not None:
                decode = self.router.pick_decode(prompt_ids, with_prefill=True, exclude=exclude)
        if decode is None:
            # Conditional disaggregation: the decode worker prefills locally.
            prefill = None
            decode = self.router.pick_decode(prompt_ids, exclude=exclude)
        if decode is None:
            raise NoWorkerAvailable(self._no_decode())
        return prefill, decode

    def _no_decode(self, within: str = "") -> str:
        """Why no decode worker takes the request (``within``: how long it waited)."""
        why = self.router.why_unavailable(self.router.decode)
        return f"no decode worker can take the request{within}" + (
            f" ({why})" if why else ": none is registered"
        )

    async def _route_or_wait(
        self, prompt_ids: list[int], exclude: set[str], wait: bool
    ) -> tuple[WorkerInfo | None, WorkerInfo]:
        """``_route``; with ``wait``, retried for up to ``wait_for_worker_s``
        while no worker is available (health checks bring workers back)."""
        try:
            return self._route(prompt_ids, exclude)
        except NoWorkerAvailable:
            # Every decode worker refused (no tokenizer, another model, a
            # handshake that fails): none comes without someone fixing it.
            if not wait or self.wait_for_worker_s <= 0 or self.router.refused(self.router.decode):
                raise
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_for_worker_s
        while True:
            await asyncio.sleep(0.05)
            try:
                return self._route(prompt_ids, exclude)
            except NoWorkerAvailable:
                if self.router.refused(self.router.decode):
                    raise
                if loop.time() >= deadline:
                    raise NoWorkerAvailable(
                        self._no_decode(f" within {self.wait_for_worker_s:g}s")
                    ) from None

    async def stream(
        self, prompt_ids: list[int], spec: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[TokenDelta]:
        """Yield the request's deltas; the last one has ``finish_reason`` set
        (``FinishReason``; ERROR with ``error``). Leaving the iterator early
        aborts the request on every worker that has it.

        A worker that fails before the request produced anything is left out
        and the request goes to another one (up to ``max_attempts`` workers);
        once a delta is out, a failure ends the request.

        ``request_id`` prefixes the id the workers see (and log), so that a
        response's id can be followed into the workers' logs."""
        base = request_id or secrets.token_hex(8)
        trace = current_trace.get()
        tried: set[str] = set()
        last: _NotDispatched | None = None
        while True:
            try:
                prefill, decode = await self._route_or_wait(prompt_ids, tried, last is None)
            except NoWorkerAvailable:
                if last is None:
                    raise
                raise last.error() from None
            started = False
            try:
                rid = f"{base}-{len(tried)}-{secrets.token_hex(4)}"
                if prefill is None:
                    # The decode worker alone (it prefills locally): its
                    # stream is read here, with no generator of its own in
                    # between (this loop runs once per token).
                    load = len(prompt_ids) + spec.max_tokens
                    self.router.begin(decode, load)
                    failed: set[WorkerInfo] = set()
                    try:
                        gen = await self._generate_alone(rid, prompt_ids, spec, decode, trace)
                        # What ``_watch`` does: only a request's first and
                        # final deltas need a look.
                        first = True
                        try:
                            async with contextlib.aclosing(gen):  # type: ignore[type-var]
                                async for delta in gen:
                                    if first or delta.finish_reason is not None:
                                        delta = _note(delta, first, decode, failed, trace)
                                        first = False
                                    started = True
                                    yield delta
                        except WorkerError as e:
                            not_dispatched = _failure(e, first, decode, failed)
                            if not_dispatched is not None:
                                raise not_dispatched from e
                            raise worker_error(decode, e) from e
                    except _NotDispatched as e:
                        failed.add(e.worker)  # also one that could not be handed the request
                        raise
                    finally:
                        # Only a worker that failed counts against its breaker;
                        # a client leaving early is nobody's fault.
                        self.router.end(decode, load, decode not in failed)
                    return
                async for delta in self._attempt(rid, prompt_ids, spec, prefill, decode, trace):
                    started = True
                    yield delta
                return
            except _NotDispatched as e:
                if isinstance(e.cause, WorkerDraining):
                    e.worker.stopping = True
                    self.router.mark_down(e.worker, str(e.cause))
                if started:  # prefill's token is out: the request cannot move
                    raise e.error() from None
                tried.add(e.worker.url)
                last = e
                if len(tried) >= self.max_attempts:
                    raise e.error() from None
                log.warning(
                    "request of %d tokens: retrying on another worker: %s", len(prompt_ids), e
                )

    async def _generate_alone(
        self,
        rid: str,
        prompt_ids: list[int],
        spec: SamplingParams,
        decode: WorkerInfo,
        trace: RequestTrace | None,
    ) -> AsyncIterator[TokenDelta]:
        """The request sent to ``decode`` alone (it prefills locally): its stream."""
        log.debug("rid=%s: prefill -, decode %s", rid, decode.url)
        client = await self._client(decode)
        _dispatched(trace, rid, "", {decode.role: decode.url})
        # merge: deltas that piled up while the gateway was busy go on as one
        # (fewer, larger SSE chunks when a client falls behind).
        stages = trace.clock if trace is not None else None
        return client.generate(Generate(rid, prompt_ids, spec), stages=stages, merge=True)

    async def _attempt(
        self,
        rid: str,
        prompt_ids: list[int],
        spec: SamplingParams,
        prefill: WorkerInfo,
        decode: WorkerInfo,
        trace: RequestTrace | None = None,
    ) -> AsyncIterator[TokenDelta]:
        """The request on a prefill and a decode worker: prefill's first
        token, then decode's stream (``merge_prefill_decode``)."""
        log.debug("rid=%s: prefill %s, decode %s", rid, prefill.url, decode.url)
        load = len(prompt_ids) + spec.max_tokens
        self.router.begin(decode, load)
        self.router.begin(prefill, len(prompt_ids))
        failed: set[WorkerInfo] = set()
        stages = trace.clock if trace is not None else None
        # aclosing: leaving this iterator early closes the worker streams now
        # (which aborts the request on the workers), not when the inner
        # generators happen to be garbage-collected.
        try:
            room = secrets.token_hex(16)
            dclient, pclient = await self._client(decode), await self._client(prefill)
            p_msg = Prefill(rid, prompt_ids, spec, room, decode.bootstrap_endpoint)
            d_msg = Generate(rid, prompt_ids, spec, room, prefill.bootstrap_endpoint)
            _dispatched(trace, rid, room, {prefill.role: prefill.url, decode.role: decode.url})
            merged = merge_prefill_decode(
                _watch(pclient.generate(p_msg, stages=stages), prefill, failed, trace),
                _watch(dclient.generate(d_msg, stages=stages, merge=True), decode, failed, trace),
                pclient.loss,
                prefill.url,
            )
            async with contextlib.aclosing(merged):
                async for delta, _source in merged:
                    yield delta
        except _NotDispatched as e:
            failed.add(e.worker)  # also one that could not be handed the request
            raise
        finally:
            # Only a worker that failed counts against its breaker; a client
            # leaving early is nobody's fault.
            self.router.end(decode, load, decode not in failed)
            self.router.end(prefill, len(prompt_ids), prefill not in failed)


def _dispatched(trace: RequestTrace | None, rid: str, room: str, workers: dict[str, str]) -> None:
    """Note in ``trace`` the attempt being sent: its request id, room, workers."""
    if trace is not None:
        trace.rid, trace.room, trace.workers = rid, room, workers
        trace.mark(DISPATCHED)


async def _watch(
    gen: AsyncIterator[TokenDelta],
    worker: WorkerInfo,
    failed: set[WorkerInfo],
    trace: RequestTrace | None = None,
) -> AsyncIterator[TokenDelta]:
    """``gen``, noting in ``failed`` whether ``worker`` failed the request and
    in ``trace`` the stages it reported; a lost connection before the first
    delta, or a refusal marked retryable (a draining worker), is raised as
    ``_NotDispatched`` (the worker produced nothing, so another may take the
    request)."""
    first = True
    try:
        async for delta in gen:
            delta = _note(delta, first, worker, failed, trace)
            first = False
            yield delta
    except WorkerError as e:
        not_dispatched = _failure(e, first, worker, failed)
        if not_dispatched is not None:
            raise not_dispatched from e
        raise worker_error(worker, e) from e
    finally:
        await gen.aclose()  # type: ignore[attr-defined]


def _note(
    delta: TokenDelta,
    first: bool,
    worker: WorkerInfo,
    failed: set[WorkerInfo],
    trace: RequestTrace | None,
) -> TokenDelta:
    """``_watch``'s look at one delta of ``worker`` (``first``: the request's
    first): a refusal marked retryable is raised as ``_NotDispatched``; a final
    delta notes whether the worker failed and the stages it reported. Returns
    the delta, with the error of one the worker failed told of the worker."""
    if first and delta.retry and delta.finish_reason == FinishReason.ERROR:
        raise _NotDispatched(worker, WorkerDraining(delta.error or "worker is draining"))
    if delta.finish_reason is not None:
        if delta.stages is not None and trace is not None:
            trace.report(worker.role, delta.stages)
        # A request refused for itself is no failure of the worker.
        if delta.finish_reason == FinishReason.ERROR and delta.error_param is None:
            failed.add(worker)
            return msgspec.structs.replace(delta, error=_failure_text(worker, delta.error))
    return delta


def _failure(
    e: WorkerError, first: bool, worker: WorkerInfo, failed: set[WorkerInfo]
) -> _NotDispatched | None:
    """``worker``'s stream failed with ``e``: the worker failed; a lost
    connection before the first delta is ``_NotDispatched`` (returned to be
    raised; None: ``e`` goes on as it is)."""
    failed.add(worker)
    if first and isinstance(e, (WorkerUnreachable, WorkerDisconnected, WorkerClientClosed)):
        return _NotDispatched(worker, e)
    return None


async def merge_prefill_decode(
    p_gen: AsyncIterator[TokenDelta],
    d_gen: AsyncIterator[TokenDelta],
    prefill_lost: Callable[[], asyncio.Event] | None = None,
    prefill_name: str = "prefill",
) -> AsyncIterator[tuple[TokenDelta, str]]:
    """Prefill's one delta, then decode's stream. Both start at once; decode's
    deltas are held until prefill's token is out. Either side failing first
    ends the request (the other side is aborted by closing its iterator).

    Prefill's request ends with its first token, but the room does not: its
    KV is still on the way to decode until decode's next delta. If the prefill
    worker's connection drops in between (``prefill_lost()``), the KV will never
    land: the request ends at once with an error (closing decode's iterator
    aborts the room there) instead of waiting out decode's transfer timeout."""
    p_task = asyncio.ensure_future(_next(p_gen))
    d_task = asyncio.ensure_future(_next(d_gen))
    try:
        done, _ = await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
        if d_task in done and p_task not in done:
            d_first = d_task.result()
            # Decode refused or failed. (A final STOP or LENGTH here is a
            # success: decode's whole stream, merged while the gateway was
            # behind; prefill's token still goes first.)
            if d_first.finish_reason in FAILED:
                yield d_first, "decode"
                return
            p_delta = await p_task
        else:
            p_delta = p_task.result()
        if p_delta.finish_reason != FinishReason.PREFILL_DONE:
            # Error or abort at prefill, or the first token ends the request.
            final = p_delta.finish_reason in ENDED
            yield p_delta, "prefill"
            if final:
                # Decode learns of it with Done and ends with no tokens.
                with contextlib.suppress(
                    WorkerError, _NotDispatched, asyncio.TimeoutError, StopAsyncIteration
                ):
                    d = await asyncio.wait_for(d_task, 30)
                    while d.finish_reason is None:
                        d = await asyncio.wait_for(_next(d_gen), 30)
            return
        yield (
            TokenDelta(
                p_delta.rid,
                p_delta.token_ids,
                p_delta.logprobs,
                None,
                p_delta.num_cached_tokens,
                top_logprobs=p_delta.top_logprobs,
                prompt_logprobs=p_delta.prompt_logprobs,
                prompt_top_logprobs=p_delta.prompt_top_logprobs,
            ),
            "prefill",
        )
        if prefill_lost is not None and not d_task.done():
            lost = asyncio.ensure_future(prefill_lost().wait())
            try:
                await asyncio.wait({d_task, lost}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                lost.cancel()
            if not d_task.done():
                raise WorkerDisconnected(
                    f"prefill worker {prefill_name} was lost before the prompt's KV "
                    "reached the decode worker"
                )
        d = await d_task
        while True:
            yield d, "decode"
            if d.finish_reason is not None:
                return
            d = await anext(d_gen)
    finally:
        for task in (p_task, d_task):
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        for gen in (p_gen, d_gen):
            with contextlib.suppress(BaseException):
                await gen.aclose()  # type: ignore[attr-defined]


async def _next(gen: AsyncIterator[TokenDelta]) -> TokenDelta:
    return await gen.__anext__()
