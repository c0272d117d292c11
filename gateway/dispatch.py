"""Sends one request to a prefill and a decode worker and merges their streams:
the first token comes from prefill, the rest from decode, in order."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator

from engine.protocol.client import WorkerClient, WorkerError
from engine.protocol.to_gateway import TokenDelta
from engine.protocol.to_worker import Generate, Prefill, SamplingSpec
from gateway.router import Router, WorkerInfo

PREFILL_DONE = "prefill_done"
"""Finish reason of prefill's single delta when decoding continues elsewhere."""


class NoWorkerAvailable(RuntimeError):
    """No healthy worker can take the request (HTTP 503)."""


class Dispatcher:
    def __init__(self, router: Router, timeout_s: float) -> None:
        self.router = router
        self.timeout_s = timeout_s
        self._clients: dict[str, WorkerClient] = {}

    async def _client(self, worker: WorkerInfo) -> WorkerClient:
        endpoint = worker.request_endpoint
        if endpoint is None:
            raise NoWorkerAvailable(f"worker {worker.url} has no request endpoint yet")
        client = self._clients.get(endpoint)
        if client is None:
            client = WorkerClient(endpoint, timeout_s=self.timeout_s)
            await client.start()
            self._clients[endpoint] = client
        return client

    async def close(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            await c.close()

    async def stream(self, prompt_ids: list[int], spec: SamplingSpec) -> AsyncIterator[TokenDelta]:
        """Yield the request's deltas; the last one has ``finish_reason`` set
        ("stop", "length", "abort" or "error" with ``error``). Leaving the
        iterator early aborts the request on every worker that has it."""
        rid = secrets.token_hex(16)
        prefill = decode = None
        if not self.router.should_skip_prefill(len(prompt_ids)):
            prefill = self.router.pick_prefill(prompt_ids)
            if prefill is not None:
                decode = self.router.pick_decode(prompt_ids, with_prefill=True)
        if decode is None:
            # Conditional disaggregation: the decode worker prefills locally.
            prefill = None
            decode = self.router.pick_decode(prompt_ids)
        if decode is None:
            raise NoWorkerAvailable("no healthy decode worker")
        load = len(prompt_ids) + spec.max_tokens
        self.router.begin(decode, load)
        if prefill is not None:
            self.router.begin(prefill, len(prompt_ids))
        ok_d = ok_p = False
        # aclosing: leaving this iterator early closes the worker streams now
        # (which aborts the request on the workers), not when the inner
        # generators happen to be garbage-collected.
        try:
            if prefill is None:
                gen = (await self._client(decode)).generate(Generate(rid, prompt_ids, spec))
                async with contextlib.aclosing(gen):  # type: ignore[type-var]
                    async for delta in gen:
                        ok_d = delta.finish_reason != "error"
                        yield delta
                return
            room = secrets.token_hex(16)
            dclient, pclient = await self._client(decode), await self._client(prefill)
            merged = _merge(
                pclient.generate(Prefill(rid, prompt_ids, spec, room, decode.bootstrap_endpoint)),
                dclient.generate(Generate(rid, prompt_ids, spec, room, prefill.bootstrap_endpoint)),
            )
            async with contextlib.aclosing(merged):
                async for delta, source in merged:
                    if source == "prefill":
                        ok_p = delta.finish_reason != "error"
                    else:
                        ok_d = delta.finish_reason != "error"
                    yield delta
        finally:
            self.router.end(decode, load, ok_d)
            if prefill is not None:
                self.router.end(prefill, len(prompt_ids), ok_p)


async def _merge(
    p_gen: AsyncIterator[TokenDelta], d_gen: AsyncIterator[TokenDelta]
) -> AsyncIterator[tuple[TokenDelta, str]]:
    """Prefill's one delta, then decode's stream. Both start at once; decode's
    deltas are held until prefill's token is out. Either side failing first
    ends the request (the other side is aborted by closing its iterator)."""
    p_task = asyncio.ensure_future(_next(p_gen))
    d_task = asyncio.ensure_future(_next(d_gen))
    try:
        done, _ = await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
        if d_task in done and p_task not in done:
            d_first = d_task.result()
            if d_first.finish_reason is not None:  # decode refused or failed
                yield d_first, "decode"
                return
            p_delta = await p_task
        else:
            p_delta = p_task.result()
        if p_delta.finish_reason not in (PREFILL_DONE,):
            # Error or abort at prefill, or the first token ends the request.
            final = p_delta.finish_reason in ("stop", "length")
            yield p_delta, "prefill"
            if final:
                # Decode learns of it with Done and ends with no tokens.
                with contextlib.suppress(WorkerError, asyncio.TimeoutError, StopAsyncIteration):
                    d = await asyncio.wait_for(d_task, 30)
                    while d.finish_reason is None:
                        d = await asyncio.wait_for(_next(d_gen), 30)
            return
        yield (
            TokenDelta(
                p_delta.rid, p_delta.token_ids, p_delta.logprobs, None, p_delta.num_cached_tokens
            ),
            "prefill",
        )
        d = await d_task
        while True:
            yield d, "decode"
            if d.finish_reason is not None:
                return
            d = await _next(d_gen)
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
