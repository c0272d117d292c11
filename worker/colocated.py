"""Role "both": prefill and decode in one ``Engine``, no KV transfer."""

from __future__ import annotations

from typing import Any

from engine.engine import Engine, InFlight
from engine.request import EngineRequestError
from protocol.roles import BOTH
from protocol.stages import ADMITTED
from protocol.to_gateway import TokenDelta
from protocol.to_worker import Generate, Prefill
from worker.config import WorkerConfig
from worker.loop import (
    Outbox,
    WorkerLoop,
    abort_delta,
    engine_stats,
    error_delta,
    step_delta,
    timed_overlap_step,
)


class ColocatedLoop(WorkerLoop):
    """Role "both": prefill and decode in one ``Engine``, no KV transfer."""

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.engine = Engine(config.engine_config())
        self._clients: dict[str, bytes] = {}
        self._outbox = Outbox()
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

    def prefix_cache(self) -> Any:
        return self.engine.scheduler.cache

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
            self.engine.add_request(msg.rid, list(msg.prompt_ids), msg.sampling)
        except (EngineRequestError, TypeError) as e:
            self._fail(client, msg.rid, str(e), getattr(e, "param", None))
            return
        self._clients[msg.rid] = client
        self.stages.mark(msg.rid, ADMITTED)
        self._counters["prompt_tokens_total"] += len(msg.prompt_ids)

    def abort(self, rid: str) -> None:
        out = self.engine.abort(rid)
        client = self._clients.pop(rid, None)
        if out is None or client is None:
            return
        self._counters["requests_aborted_total"] += 1
        self._outbox.put(client, abort_delta(rid, out.num_cached_tokens))

    def step(self) -> list[tuple[bytes, TokenDelta]]:
        out = self._outbox.take()
        if not self.engine.has_unfinished() and self._inflight is None:
            return out
        self._inflight, results = timed_overlap_step(self.engine, self.stages, self._inflight)
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
        return {**engine_stats(self.engine, BOTH), **self._counters}

    def close(self) -> None:
        for rid in list(self._clients):
            self.engine.abort(rid)
        self._clients.clear()
        self._outbox.clear()
        self.engine.close()

    def _fail(self, client: bytes, rid: str, message: str, param: str | None = None) -> None:
        self._counters["requests_failed_total"] += 1
        self._outbox.put(client, error_delta(rid, message, param))
