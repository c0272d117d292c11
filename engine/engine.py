"""Engine: validates requests and drives scheduler + runner one step at a time."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from typing import NamedTuple

import torch

from engine.config import EngineConfig
from engine.grammar import GrammarBackend, GrammarStep
from engine.host_copy import to_device
from engine.model_config import ModelConfig
from engine.parallel.ranks import make_runner
from engine.prompt_logprobs import PromptScores
from engine.request import EngineRequestError, Request, StepOutput
from engine.runner import ForwardOutput
from engine.sampling import SamplingBatch
from engine.scheduler import ScheduledBatch, Scheduler
from protocol.finish import PROMPT_PARAM, FinishReason
from protocol.sampling import SamplingParams

log = logging.getLogger(__name__)


class InFlight(NamedTuple):
    batch: ScheduledBatch
    out: ForwardOutput
    scores: PromptScores | None = None
    """Prompt logprobs computed by this forward, when some request asked."""


class Engine:
    def __init__(self, config: EngineConfig, scheduler_cls: type[Scheduler] = Scheduler) -> None:
        # The model as a local directory, whoever built the config: a
        # preset's name becomes its dummy directory, which holds the
        # tokenizer files the grammar backend reads (from a name alone it
        # would look the model up on the Hub). A resolved config (a
        # worker's) stays as it is.
        config = config.resolve_model_and_device()
        model_config = ModelConfig.load(config.model, config.torch_dtype)
        self.model_config = model_config
        self._grammars: GrammarBackend | Exception | None = None
        """The grammar compiler, or the error making it raised (raised again at
        every grammar request: a model without tokenizer files serves all
        other requests); None until made."""
        self.runner = make_runner(config.resolve(model_config), model_config)
        self.config = self.runner.config
        """Resolved, with the KV pool's size (the runner may size it from the device)."""
        times = getattr(self.runner, "start_times", None)
        mark = times.done if times is not None else None
        self.scheduler = scheduler_cls(self.config, model_config, self.runner.pool)
        if mark is not None:
            mark("scheduler")
        if self.config.device.startswith("cuda"):
            # Made now, before the worker reports healthy, so that the first
            # grammar request does not wait seconds for it (on a CPU, on first
            # use: tests need it rarely). Not in a thread beside the weights'
            # loading and the graph capture: there the start took 10 s longer
            # on an H100, the two contending for the GIL.
            self._grammars = self._make_grammars(mark)
        self.start_seconds: dict[str, float] = {}
        """Seconds of each part of this engine's start, in order (/server_info;
        none where a tensor-parallel lead starts its ranks)."""
        if times is not None:
            self.start_seconds = {part: round(s, 2) for part, s in times.parts.items()}
            log.info("engine %s", times.describe())
        self._rng = random.Random(config.seed)
        self._rids: set[str] = set()
        self._grammar_rids: set[str] = set()
        """Live requests with a grammar: while there are none, a step does no
        grammar work at all."""
        self._adjusted_rids: set[str] = set()
        """Live requests with a logit bias or a penalty (the same idea)."""

    def close(self) -> None:
        """Stop what the engine started outside this process (tensor-parallel ranks)."""
        self.runner.close()

    @property
    def context_length(self) -> int:
        assert self.config.context_length is not None
        return self.config.context_length

    @property
    def max_model_len(self) -> int:
        """Longest prompt plus output one request may have: the context length,
        or fewer where the KV pool cannot hold that many tokens."""
        pool_tokens = self.runner.pool.allocator.capacity * self.config.page_size
        return min(self.context_length, pool_tokens)

    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self.scheduler.add(self.build_request(rid, prompt_ids, params))

    def build_request(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> Request:
        """Validate and register a request id; the caller queues the request."""
        if rid in self._rids:
            raise EngineRequestError(f"request id {rid!r} is already in use")
        if not prompt_ids:
            raise EngineRequestError(
                "prompt is empty: at least one token is required", PROMPT_PARAM
            )
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise EngineRequestError(
                f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})", PROMPT_PARAM
            )
        n = len(prompt_ids)
        limit = self.max_model_len
        if n >= limit:
            what = (
                f"the context length is {limit}"
                if limit == self.context_length
                else f"the KV pool holds at most {limit} tokens of prompt plus output "
                f"(context length {self.context_length})"
            )
            raise EngineRequestError(
                f"prompt has {n} tokens; {what} and at least one token must be generated",
                PROMPT_PARAM,
            )
        # Like the context length, the pool caps the output: the request ends
        # with finish_reason LENGTH where the pool would run out.
        max_total = min(n + params.max_tokens, limit)
        # Unseeded requests still get a fixed stream of their own, so that a
        # retraction and recompute draws the same tokens again.
        seed = params.seed % (1 << 31) if params.seed is not None else self._rng.randrange(1 << 31)
        bad = next((t for t, _ in params.logit_bias if t >= vocab), None)
        if bad is not None:
            raise EngineRequestError(
                f"logit_bias token id {bad} is outside the vocabulary [0, {vocab})", "logit_bias"
            )
        req = Request(rid, list(prompt_ids), params, seed, max_total)
        if params.logit_bias or params.penalized:
            self._adjusted_rids.add(rid)
        if params.grammar is not None:
            req.grammar = self.grammar_backend().request_grammar(params.grammar)
            self._grammar_rids.add(rid)
        self._rids.add(rid)
        return req

    def grammar_backend(self) -> GrammarBackend:
        """The model's grammar compiler (xgrammar and the tokenizer, which an
        engine without grammar requests skips on a CPU): made at start-up on
        CUDA, else on first use."""
        if self._grammars is None:
            self._grammars = self._make_grammars()
        if isinstance(self._grammars, Exception):
            raise self._grammars
        return self._grammars

    def _make_grammars(
        self, mark: Callable[[str], None] | None = None
    ) -> GrammarBackend | Exception:
        mc = self.model_config
        try:
            return GrammarBackend.for_model(
                self.config.model, mc.vocab_size, mc.eos_token_ids, mark=mark
            )
        except Exception as e:  # noqa: BLE001 (handed to every request that asks)
            return e

    def forget(self, rid: str) -> None:
        """The request id may be used again."""
        self._rids.discard(rid)
        self._grammar_rids.discard(rid)
        self._adjusted_rids.discard(rid)

    def abort(self, rid: str) -> StepOutput | None:
        req = self.scheduler.abort(rid)
        if req is None:
            return None
        self._rids.discard(rid)
        self._grammar_rids.discard(rid)
        self._adjusted_rids.discard(rid)
        return StepOutput(rid, -1, 0.0, FinishReason.ABORT, max(req.num_cached_tokens, 0))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def launch(self, inflight: InFlight | None = None) -> InFlight | None:
        """Schedule and start the next forward; with ``inflight`` it is built
        while that one runs and takes its sampled tokens on the device."""
        batch = self.scheduler.schedule(inflight.batch if inflight else None)
        if batch is None:
            return None
        return self.launch_batch(batch, inflight)

    def launch_batch(self, batch: ScheduledBatch, inflight: InFlight | None = None) -> InFlight:
        """Start the forward of an already scheduled batch."""
        if batch.future_rows:
            assert inflight is not None
            # Queued copies (pinned): a plain one would wait for the forward in
            # flight, and this one is built while it runs.
            index = to_device(
                torch.tensor([batch.future_src, batch.future_rows], dtype=torch.int64),
                batch.forward.input_ids.device,
            )
            batch.forward.input_ids[index[1]] = inflight.out.token_ids[index[0]]
        sampling = batch.sampling
        if self._grammar_rids and sampling is not None:
            sampling = self._with_grammar_mask(batch, sampling, inflight)
        if self._adjusted_rids and sampling is not None:
            adjust = self.scheduler.token_counts.adjust(batch.sample_requests)
            sampling = sampling._replace(adjust=adjust)
        if batch.scoring is None:
            return InFlight(batch, self.runner.forward(batch.forward, sampling, batch.top_logprobs))
        # Some rows score prompt tokens: those are read here, the rest sampled.
        logits = self.runner.forward_logits(batch.forward)
        scores = batch.scoring.score(logits)
        rows = logits.index_select(0, batch.scoring.sample_rows)
        out = self.runner.sample_logits(rows, sampling, batch.top_logprobs)
        return InFlight(batch, out, scores)

    def _with_grammar_mask(
        self, batch: ScheduledBatch, sampling: SamplingBatch, inflight: InFlight | None
    ) -> SamplingBatch:
        """``sampling`` with the mask of the batch's grammar rows, if it has any."""
        step = GrammarStep.for_batch(
            self.grammar_backend(),
            batch.sample_requests,
            inflight.batch.sample_requests if inflight is not None else None,
            inflight.out if inflight is not None else None,
        )
        return sampling if step is None else sampling._replace(logits_mask=step)

    def finish(self, inflight: InFlight) -> list[StepOutput]:
        """Wait for a launched forward and apply its tokens."""
        results = self.scheduler.process(inflight.batch, inflight.out)
        if inflight.scores is not None:
            results = inflight.scores.apply(results)
        for r in results:
            if r.finish_reason is not None:
                self._rids.discard(r.rid)
                self._grammar_rids.discard(r.rid)
                self._adjusted_rids.discard(r.rid)
        return results

    def overlap_step(self, inflight: InFlight | None) -> tuple[InFlight | None, list[StepOutput]]:
        """Launch step N+1, then finish step N: the host's scheduling and
        bookkeeping overlap the device's forward. After a starved schedule the
        next step runs without overlap, where retraction is allowed."""
        nxt = None if self.scheduler.starved else self.launch(inflight)
        results = self.finish(inflight) if inflight is not None else []
        if nxt is None:
            self.scheduler.starved = False
        return nxt, results

    def step(self) -> list[StepOutput]:
        """One forward without overlap."""
        inflight = self.launch()
        return [] if inflight is None else self.finish(inflight)
