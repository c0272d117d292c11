"""Offline API: ``LLM(model).generate(prompts, sampling_params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from engine.config import EngineConfig
from engine.engine import Engine
from protocol.sampling import SamplingParams


@dataclass
class GenerationOutput:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    text: str | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """Per token, the most likely (token id, logprob) pairs when asked for."""
    prompt_logprobs: list[float | None] | None = None
    """Per prompt token, its logprob given the tokens before it (None for the
    first), when ``SamplingParams.prompt_logprobs`` asked for them."""
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None


class LLM:
    def __init__(self, model: str | None = None, **engine_kwargs: Any) -> None:
        if model is None:
            from engine.tiny import ensure_tiny_model

            model = str(ensure_tiny_model())
        self.engine = Engine(EngineConfig(model=str(model), **engine_kwargs))
        self._tokenizer = None
        self._ids = itertools.count()

    @property
    def tokenizer(self):  # noqa: ANN201 (transformers type)
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.engine.config.model)
        return self._tokenizer

    def generate(
        self,
        prompts: Sequence[Sequence[int]] | Sequence[str] | str,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationOutput]:
        """Run every prompt to completion; outputs are in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        is_text = bool(prompts) and isinstance(prompts[0], str)
        ids = [self.tokenizer.encode(p) if is_text else list(p) for p in prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(ids)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(ids):
            raise ValueError(f"{len(params)} sampling params for {len(ids)} prompts")
        outputs: dict[str, GenerationOutput] = {}
        order: list[str] = []
        try:
            for p_ids, p in zip(ids, params):
                rid = f"offline-{next(self._ids)}"
                self.engine.add_request(rid, p_ids, p)
                outputs[rid] = GenerationOutput(prompt_token_ids=p_ids)
                order.append(rid)
            inflight = None
            while self.engine.has_unfinished() or inflight is not None:
                if self.engine.config.overlap:
                    inflight, results = self.engine.overlap_step(inflight)
                else:
                    results = self.engine.step()
                for r in results:
                    o = outputs[r.rid]
                    o.token_ids.append(r.token_id)
                    o.logprobs.append(r.logprob)
                    if r.top_logprobs is not None:
                        if o.top_logprobs is None:
                            o.top_logprobs = []
                        o.top_logprobs.append(r.top_logprobs)
                    o.num_cached_tokens = r.num_cached_tokens
                    if r.prompt_logprobs is not None:
                        o.prompt_logprobs = [None, *r.prompt_logprobs.logprobs]
                        o.prompt_top_logprobs = [None, *r.prompt_logprobs.top]
                    if r.finish_reason is not None:
                        o.finish_reason = r.finish_reason
        finally:
            for rid in order:
                if outputs[rid].finish_reason is None:
                    self.engine.abort(rid)
        results = [outputs[rid] for rid in order]
        if is_text:
            results = [replace(o, text=self.tokenizer.decode(o.token_ids)) for o in results]
        return results
