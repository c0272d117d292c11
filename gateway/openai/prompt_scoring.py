"""Echoed prompts with their logprobs, on the completions endpoint.

A completions request with ``echo`` and ``logprobs`` gets the logprob of every
prompt token given the tokens before it (the first token's is null, as OpenAI
answers), computed by the worker that prefills the prompt and sent with the
first token (``TokenDelta.prompt_logprobs``). They lead the choice's
``logprobs`` (tokens, token_logprobs, top_logprobs, text_offset from the start
of the echoed text), followed by those of the generated tokens.

With ``max_tokens`` 0 the request only scores its prompt, which is how
evaluation harnesses ask for a loglikelihood: one token is generated, since
the prefill that scores the prompt samples it anyway, and dropped here.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from gateway.openai.choices import ChoiceEvent
from gateway.openai.shapes import CompletionShape, ResponseShape
from protocol.finish import FinishReason

LOGPROB_KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def wants_prompt_logprobs(shape: ResponseShape) -> bool:
    """The shape's choices start with the echoed prompt's logprobs."""
    return isinstance(shape, CompletionShape) and shape.echo and shape.top_k is not None


def prompt_logprobs(
    shape: CompletionShape, prompt_ids: list[int], events: list[ChoiceEvent]
) -> dict[str, Any] | None:
    """The logprobs object of the echoed prompt, from the event that carries
    them (None when no event does)."""
    ev = next((e for e in events if e.prompt_logprobs is not None), None)
    if ev is None or ev.prompt_logprobs is None:
        return None
    lps, tops = ev.prompt_logprobs
    decode = shape.tokenizer.decode
    tokens = [decode([t]) for t in prompt_ids]
    offsets, offset = [], 0
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    top_dicts: list[dict[str, float] | None] = [None]
    for tok, lp, top in zip(tokens[1:], lps, tops):
        d = {decode([a]): b for a, b in top[: shape.top_k]} if shape.top_k else {}
        d.setdefault(tok, lp)  # the prompt's own token is always listed
        top_dicts.append(d)
    return {
        "tokens": tokens,
        "token_logprobs": [None, *lps],
        "top_logprobs": top_dicts,
        "text_offset": offsets,
    }


def with_prompt_logprobs(
    shape: ResponseShape,
    prompt_ids: list[int],
    events: list[ChoiceEvent],
    logprobs: dict[str, Any] | None,
) -> dict[str, Any] | None:
    """A whole choice's ``logprobs``: the prompt's (when echoed), then ``logprobs``."""
    if not isinstance(shape, CompletionShape) or not wants_prompt_logprobs(shape):
        return logprobs
    prompt = prompt_logprobs(shape, prompt_ids, events)
    if prompt is None:
        return logprobs
    if logprobs is None:
        return prompt
    return {k: [*prompt[k], *logprobs[k]] for k in LOGPROB_KEYS}


async def prompt_only(events: AsyncIterator[ChoiceEvent]) -> AsyncIterator[ChoiceEvent]:
    """A choice that only scores its prompt (``max_tokens`` 0): its events
    without the token generated to get there; it ends with "length"."""
    async with contextlib.aclosing(events):  # type: ignore[type-var]
        async for ev in events:
            yield ev._replace(
                text="",
                token_ids=[],
                logprobs=[],
                top_logprobs=None,
                finish_reason=None if ev.finish_reason is None else FinishReason.LENGTH,
            )
