"""Engine: validates requests and drives scheduler + runner one step at a time."""

from __future__ import annotations

import random

from engine.config import EngineConfig, ModelConfig
from engine.request import EngineRequestError, Request, StepOutput
from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler


class Engine:
    def __init__(self, config: EngineConfig, scheduler_cls: type[Scheduler] = Scheduler) -> None:
        model_config = ModelConfig.load(config.model, config.torch_dtype)
        self.config = config.resolve(model_config)
        self.model_config = model_config
        self.runner = ModelRunner(self.config, model_config)
        self.scheduler = scheduler_cls(self.config, model_config, self.runner.pool)
        self._rng = random.Random(config.seed)
        self._rids: set[str] = set()

    @property
    def context_length(self) -> int:
        assert self.config.context_length is not None
        return self.config.context_length

    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self.scheduler.add(self.build_request(rid, prompt_ids, params))

    def build_request(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> Request:
        """Validate and register a request id; the caller queues the request."""
        if rid in self._rids:
            raise EngineRequestError(f"request id {rid!r} is already in use")
        if not prompt_ids:
            raise EngineRequestError("prompt is empty: at least one token is required")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise EngineRequestError(
                f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})"
            )
        n = len(prompt_ids)
        if n >= self.context_length:
            raise EngineRequestError(
                f"prompt has {n} tokens; the context length is {self.context_length} "
                "and at least one token must be generated"
            )
        max_total = min(n + params.max_tokens, self.context_length)
        pages = -(-max_total // self.config.page_size)
        capacity = self.runner.pool.allocator.capacity
        if pages > capacity:
            raise EngineRequestError(
                f"prompt ({n}) plus max_tokens ({params.max_tokens}) needs {pages} KV pages "
                f"but the pool holds {capacity}"
            )
        # Unseeded requests still get a fixed stream of their own, so that a
        # retraction and recompute draws the same tokens again.
        seed = params.seed % (1 << 31) if params.seed is not None else self._rng.randrange(1 << 31)
        req = Request(rid, list(prompt_ids), params, seed, max_total)
        self._rids.add(rid)
        return req

    def forget(self, rid: str) -> None:
        """The request id may be used again."""
        self._rids.discard(rid)

    def abort(self, rid: str) -> StepOutput | None:
        req = self.scheduler.abort(rid)
        if req is None:
            return None
        self._rids.discard(rid)
        return StepOutput(rid, -1, 0.0, "abort", max(req.num_cached_tokens, 0))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[StepOutput]:
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        out = self.runner.forward(batch.forward, batch.sampling)
        results = self.scheduler.process(batch, out)
        for r in results:
            if r.finish_reason is not None:
                self._rids.discard(r.rid)
        return results
