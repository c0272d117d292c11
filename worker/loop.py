"""Engine-process side of a worker: the ``WorkerLoop`` interface the request
plane drives, and the helpers every role's loop shares."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import msgspec

from engine.engine import Engine, InFlight
from engine.request import StepOutput
from protocol.finish import FinishReason
from protocol.to_gateway import TokenDelta
from protocol.to_worker import Generate, Prefill
from protocol.tracing import StageSpans
from worker.config import WorkerConfig
from worker.stages import StageBook

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
    finished, failed validation (ERROR) or was aborted (ABORT).
    Request-level failures never raise out of the loop.
    """

    def __init__(self, config: WorkerConfig) -> None:
        """Build the engine for ``config`` (resolved: model path and device set).
        Raising here is a startup failure reported to the front."""
        self.config = config
        self.stages = StageBook(config.role, StageSpans.from_env(f"{config.role} worker"))
        """Stage records of this loop's requests; the engine server opens and
        closes them, the loop stamps what happens inside."""
        self.deliver: Callable[[list[tuple[bytes, TokenDelta]]], None] | None = None
        """Set by the engine server: sends deltas at once, in the middle of a
        step, for the deltas that must not wait for the rest of it (a prefill
        worker's first token goes out before its KV is pushed)."""

    def prefix_cache(self) -> Any:
        """The engine's prefix cache (``RadixCache``) whose KV events this
        worker publishes, or None (no cache, or a role that routes nothing)."""
        return None

    @abstractmethod
    def submit(self, msg: Generate | Prefill, client: bytes) -> None:
        """Accept a request from requester ``client`` (a ZMQ identity). Invalid
        requests are answered by an ERROR delta from the next ``step``."""

    @abstractmethod
    def abort(self, rid: str) -> None:
        """Stop request ``rid`` and free its pages; the next ``step`` returns its
        final ABORT delta. Unknown or finished ids are ignored."""

    @abstractmethod
    def step(self) -> list[tuple[bytes, TokenDelta]]:
        """Run at most one forward and return the new deltas, each addressed to
        its requester, plus any pending error/abort deltas."""

    @abstractmethod
    def has_work(self) -> bool:
        """True while ``step`` would run a forward or return deltas."""

    def busy(self) -> bool:
        """True while ``step`` must run again at once; False when the work
        left only waits for a message on the request plane or on one of
        ``wait_sockets`` (the engine process then blocks on them)."""
        return self.has_work()

    def wait_sockets(self) -> list[Any]:
        """ZMQ sockets whose messages the loop waits for while it is not
        ``busy`` (its KV plane): the engine process polls them with its own."""
        return []

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
        """Static facts for /server_info (model, page size, context length,
        how the KV pool was sized...)."""
        facts: dict[str, Any] = {
            "model": self.config.engine.model,
            "page_size": self.config.engine.page_size,
        }
        engine = getattr(self, "engine", None)
        if isinstance(engine, Engine):
            cfg, mc = engine.config, engine.model_config
            facts.update(
                context_length=engine.context_length,
                max_model_len=engine.max_model_len,
                num_pages=cfg.num_pages,
                kv_pool=engine.runner.pool_sizing,
                start_seconds=engine.start_seconds,
                device=cfg.device,
                dtype=str(mc.dtype).removeprefix("torch."),
                attention_backend=cfg.attention_backend,
                cuda_graph_max_bs=engine.runner.graph_max_bs,
                cuda_graph_max_tokens=cfg.cuda_graph_max_tokens,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                chunk_size=cfg.effective_chunk_size,
                max_running_requests=cfg.max_running_requests,
                enable_prefix_cache=cfg.enable_prefix_cache,
                vocab_size=mc.vocab_size,
                eos_token_ids=list(mc.eos_token_ids),
            )
            facts.update(tp_info(engine))
        return facts

    def failure(self) -> str | None:
        """Why the loop can serve no more (a tensor-parallel rank died), or None.
        The engine server fails every request and stops the worker then."""
        engine = getattr(self, "engine", None)
        return engine.runner.failure() if isinstance(engine, Engine) else None

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release sockets, transfer agents and device memory."""


def tp_info(engine: Engine) -> dict[str, Any]:
    """The engine's tensor-parallel size and the process ids of its other ranks."""
    return {"tp_size": engine.config.tp_size, "rank_pids": engine.runner.rank_pids}


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


def timed_overlap_step(
    engine: Engine, stages: StageBook, inflight: InFlight | None
) -> tuple[InFlight | None, list[StepOutput]]:
    """``engine.overlap_step(inflight)``, stamping the stages it reaches: the
    batch it launches started now, the one it finishes (``inflight``) ended
    when it returns, and that batch's sampled requests got a token then."""
    t0 = time.monotonic()
    launched, results = engine.overlap_step(inflight)
    t1 = time.monotonic()
    if launched is not None:
        stages.forward_started((r.rid for r in launched.batch.requests), t0)
    if inflight is not None:
        stages.forward_finished((r.rid for r in inflight.batch.requests), t1)
    if results:
        stages.tokens_sampled((r.rid for r in results), t1)
    return launched, results


def step_delta(r: StepOutput) -> TokenDelta:
    """The wire form of one sampled token."""
    top = None if r.top_logprobs is None else [r.top_logprobs]
    delta = TokenDelta(
        r.rid, [r.token_id], [r.logprob], r.finish_reason, r.num_cached_tokens, None, top
    )
    if r.prompt_logprobs is None:
        return delta
    return msgspec.structs.replace(
        delta,
        prompt_logprobs=r.prompt_logprobs.logprobs,
        prompt_top_logprobs=r.prompt_logprobs.top,
    )


def error_delta(rid: str, message: str, param: str | None = None) -> TokenDelta:
    """A failed request's final delta; ``param``: the request's own parameter
    at fault, when it is the request that is wrong."""
    return TokenDelta(rid, [], [], FinishReason.ERROR, 0, message, error_param=param)


def abort_delta(rid: str, num_cached_tokens: int = 0) -> TokenDelta:
    return TokenDelta(rid, [], [], FinishReason.ABORT, num_cached_tokens)


class Outbox:
    """Deltas the next ``step`` returns, each addressed to its requester.

    ``submit`` and ``abort`` run between steps and cannot answer directly, so
    their deltas wait here; a loop's ``has_work`` stays True while it is not
    empty, or they would never leave."""

    def __init__(self) -> None:
        self._deltas: list[tuple[bytes, TokenDelta]] = []

    def put(self, client: bytes, delta: TokenDelta) -> None:
        self._deltas.append((client, delta))

    def take(self) -> list[tuple[bytes, TokenDelta]]:
        """Everything queued so far, oldest first; the outbox is left empty."""
        out, self._deltas = self._deltas, []
        return out

    def clear(self) -> None:
        self._deltas.clear()

    def __bool__(self) -> bool:
        return bool(self._deltas)

    def __len__(self) -> int:
        return len(self._deltas)
