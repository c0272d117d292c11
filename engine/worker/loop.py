"""Engine-process side of a worker: the ``WorkerLoop`` interface the request
plane drives, and ``ColocatedLoop`` (role "both") over ``engine.engine.Engine``."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any

import msgspec

from engine.engine import Engine, InFlight
from engine.protocol.to_gateway import TokenDelta
from engine.protocol.to_worker import Generate, Prefill, SamplingSpec
from engine.request import EngineRequestError, StepOutput
from engine.sampling_params import InvalidSamplingParams, SamplingParams
from engine.worker.config import WorkerConfig

IDLE_WAIT_S = 0.0005


def idle_wait() -> None:
    """Back off briefly when only rooms waiting on the KV plane are left: the
    engine process polls the request socket, not the KV plane's, so the loop
    would otherwise spin a core."""
    time.sleep(IDLE_WAIT_S)


class WorkerLoop(ABC):
    """The scheduler-plus-model state machine of one worker role.

    The engine process owns one loop and calls it from a single thread:
    ``submit``/``abort`` as messages arrive, ``step`` whenever ``has_work``.
    Every submitted request ends with exactly one final ``TokenDelta``
    (``finish_reason`` set) returned by some later ``step``, whether it
    finished, failed validation ("error") or was aborted ("abort").
    Request-level failures never raise out of the loop.
    """

    def __init__(self, config: WorkerConfig) -> None:
        """Build the engine for ``config`` (resolved: model path and device set).
        Raising here is a startup failure reported to the front."""
        self.config = config

    @abstractmethod
    def submit(self, msg: Generate | Prefill, client: bytes) -> None:
        """Accept a request from requester ``client`` (a ZMQ identity). Invalid
        requests are answered by an "error" delta from the next ``step``."""

    @abstractmethod
    def abort(self, rid: str) -> None:
        """Stop request ``rid`` and free its pages; the next ``step`` returns its
        final "abort" delta. Unknown or finished ids are ignored."""

    @abstractmethod
    def step(self) -> list[tuple[bytes, TokenDelta]]:
        """Run at most one forward and return the new deltas, each addressed to
        its requester, plus any pending error/abort deltas."""

    @abstractmethod
    def has_work(self) -> bool:
        """True while ``step`` would run a forward or return deltas."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Numbers for /server_info and /metrics. Must include ``free_pages``
        (allocator free list), ``total_pages`` (allocator capacity),
        ``cached_pages`` (held by the prefix cache), ``available_pages`` (free
        plus evictable), ``running`` and ``waiting``. Keys ending in ``_total``
        (and the ``COUNTER_STATS`` names of the front) are exported as counters."""

    @property
    def bootstrap_endpoint(self) -> str | None:
        """Where peers reach this worker's KV plane; None when it has none."""
        return None

    def info(self) -> dict[str, Any]:
        """Static facts for /server_info (model, page size, context length...)."""
        facts: dict[str, Any] = {"model": self.config.model, "page_size": self.config.page_size}
        engine = getattr(self, "engine", None)
        if isinstance(engine, Engine):
            facts["context_length"] = engine.context_length
        return facts

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release sockets, transfer agents and device memory."""


def to_sampling_params(spec: SamplingSpec) -> SamplingParams:
    """Wire sampling spec to engine parameters (raises ``InvalidSamplingParams``)."""
    return SamplingParams(**msgspec.structs.asdict(spec))


def engine_stats(engine: Engine, role: str) -> dict[str, Any]:
    """Pool, queue and prefix-cache numbers every role reports."""
    sched = engine.scheduler
    alloc = engine.runner.pool.allocator
    cache = sched.cache
    cstats = cache.stats() if cache is not None else None
    return {
        "role": role,
        "free_pages": alloc.num_free,
        "total_pages": alloc.capacity,
        "cached_pages": cstats.cached_pages if cstats else 0,
        "evictable_pages": cstats.evictable_pages if cstats else 0,
        "locked_pages": cstats.locked_pages if cstats else 0,
        "available_pages": sched.num_free_pages,
        "running": len(sched.running),
        "waiting": len(sched.waiting),
        "retracted_total": sched.num_retracted,
        "prefix_cache_hit_tokens": cstats.hit_tokens if cstats else 0,
        "prefix_cache_query_tokens": cstats.query_tokens if cstats else 0,
    }


def step_delta(r: StepOutput) -> TokenDelta:
    """The wire form of one sampled token."""
    top = None if r.top_logprobs is None else [r.top_logprobs]
    return TokenDelta(
        r.rid, [r.token_id], [r.logprob], r.finish_reason, r.num_cached_tokens, None, top
    )


def error_delta(rid: str, message: str) -> TokenDelta:
    return TokenDelta(rid, [], [], "error", 0, message)


class ColocatedLoop(WorkerLoop):
    """Role "both": prefill and decode in one ``Engine``, no KV transfer."""

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.engine = Engine(config.engine_config())
        self._clients: dict[str, bytes] = {}
        self._outbox: list[tuple[bytes, TokenDelta]] = []
        self._inflight: InFlight | None = None
        self._counters = {
            "requests_total": 0,
            "requests_finished_total": 0,
            "requests_aborted_total": 0,
            "requests_failed_total": 0,
            "prompt_tokens_total": 0,
            "generation_tokens_total": 0,
            "forward_steps_total": 0,
        }

    def submit(self, msg: Generate | Prefill, client: bytes) -> None:
        self._counters["requests_total"] += 1
        if isinstance(msg, Prefill):
            self._fail(
                client, msg.rid, "role 'both' does not serve Prefill requests; send Generate"
            )
            return
        if msg.prefill_bootstrap is not None:
            self._fail(
                client,
                msg.rid,
                "role 'both' cannot take KV from a prefill worker; "
                "send Generate without prefill_bootstrap",
            )
            return
        try:
            params = to_sampling_params(msg.sampling)
            self.engine.add_request(msg.rid, list(msg.prompt_ids), params)
        except (EngineRequestError, InvalidSamplingParams, TypeError) as e:
            self._fail(client, msg.rid, str(e))
            return
        self._clients[msg.rid] = client
        self._counters["prompt_tokens_total"] += len(msg.prompt_ids)

    def abort(self, rid: str) -> None:
        out = self.engine.abort(rid)
        client = self._clients.pop(rid, None)
        if out is None or client is None:
            return
        self._counters["requests_aborted_total"] += 1
        self._outbox.append((client, TokenDelta(rid, [], [], "abort", out.num_cached_tokens)))

    def step(self) -> list[tuple[bytes, TokenDelta]]:
        out, self._outbox = self._outbox, []
        if not self.engine.has_unfinished() and self._inflight is None:
            return out
        self._inflight, results = self.engine.overlap_step(self._inflight)
        self._counters["forward_steps_total"] += 1
        for r in results:
            client = self._clients.get(r.rid)
            if client is None:
                continue
            self._counters["generation_tokens_total"] += 1
            if r.finish_reason is not None:
                del self._clients[r.rid]
                self._counters["requests_finished_total"] += 1
            out.append((client, step_delta(r)))
        return out

    def has_work(self) -> bool:
        return bool(self._outbox) or self._inflight is not None or self.engine.has_unfinished()

    def stats(self) -> dict[str, Any]:
        return {**engine_stats(self.engine, "both"), **self._counters}

    def info(self) -> dict[str, Any]:
        cfg = self.engine.config
        return {
            "model": cfg.model,
            "page_size": cfg.page_size,
            "context_length": self.engine.context_length,
            "num_pages": cfg.num_pages,
            "device": cfg.device,
            "dtype": str(self.engine.model_config.dtype).removeprefix("torch."),
            "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "chunk_size": cfg.effective_chunk_size,
            "max_running_requests": cfg.max_running_requests,
            "enable_prefix_cache": cfg.enable_prefix_cache,
            "vocab_size": self.engine.model_config.vocab_size,
            "eos_token_ids": list(self.engine.model_config.eos_token_ids),
        }

    def close(self) -> None:
        for rid in list(self._clients):
            self.engine.abort(rid)
        self._clients.clear()
        self._outbox.clear()

    def _fail(self, client: bytes, rid: str, message: str) -> None:
        self._counters["requests_failed_total"] += 1
        self._outbox.append((client, error_delta(rid, message)))
