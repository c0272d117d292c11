"""Response bodies: a whole (not streamed) completion, usage, and the model list."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field

from gateway.openai.choices import ChoiceEvent, join_events
from gateway.openai.prompt_scoring import with_prompt_logprobs
from gateway.openai.shapes import ResponseShape
from gateway.openai.tools import whole_tool_calls
from protocol.finish import FinishReason


def now() -> int:
    return int(time.time())


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "disagg-serve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


@dataclass(frozen=True)
class ResponseContext:
    """What a response says about its request, streamed or not."""

    shape: ResponseShape
    rid: str
    model: str
    prompts: list[list[int]]
    choice_prompts: list[list[int]]
    """The prompt ids of each choice (``n`` choices per prompt, in order)."""
    n: int
    return_token_ids: bool

    def reports_cache(self, index: int) -> bool:
        """Whether choice ``index`` counts its prompt's cached tokens in the
        usage: only the first of a prompt's ``n`` choices does."""
        return index % self.n == 0


def usage(prompts: list[list[int]], counts: list[int], cached: list[int]) -> dict[str, Any]:
    prompt_tokens = sum(len(p) for p in prompts)
    completion = sum(counts)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": sum(cached)},
    }


def full_response(ctx: ResponseContext, results: list[list[ChoiceEvent]]) -> dict[str, Any]:
    """The whole response, from every choice's events."""
    shape = ctx.shape
    choices = []
    counts, cached = [], []
    for index, (ids, events) in enumerate(zip(ctx.choice_prompts, results)):
        text = "".join(e.text for e in events)
        toks, lps, tops = join_events(events)
        finish = events[-1].finish_reason if events else FinishReason.STOP
        counts.append(len(toks))
        cached.append(
            max((e.cached_tokens for e in events), default=0) if ctx.reports_cache(index) else 0
        )
        prefix = shape.prompt_text(ids)
        calls = whole_tool_calls([c for e in events for c in e.tool_calls or ()])
        logprobs = shape.logprobs(toks, lps, tops, len(prefix))
        logprobs = with_prompt_logprobs(shape, ids, events, logprobs)
        choice = shape.choice(index, prefix + text, logprobs, finish, calls)
        if ctx.return_token_ids:
            choice["token_ids"] = toks
        choices.append(choice)
    body: dict[str, Any] = {
        "id": ctx.rid,
        "object": shape.object,
        "created": now(),
        "model": ctx.model,
        "choices": choices,
        "usage": usage(ctx.prompts, counts, cached),
    }
    if ctx.return_token_ids:
        body["prompt_token_ids"] = ctx.prompts[0] if len(ctx.prompts) == 1 else ctx.prompts
    return body
