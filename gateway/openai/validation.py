"""Request checks and translation: an OpenAI request's sampling fields,
stop strings and token limits, or the 400 error that says what is wrong."""

from __future__ import annotations

from gateway.openai.errors import APIError
from gateway.openai.requests import GenerationRequest, Prompt
from gateway.text import Tokenizer
from protocol.sampling import InvalidSamplingParams, SamplingParams

MAX_CHOICES = 16
"""Largest ``n``."""
MAX_STOP_STRINGS = 16


def completion_prompts(prompt: Prompt, tokenizer: Tokenizer) -> list[list[int]]:
    """The token ids of each prompt of a completions request."""
    p = prompt
    if isinstance(p, str):
        prompts = [tokenizer.encode(p)]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [list(p)]  # type: ignore[arg-type]
    elif p and all(isinstance(x, str) for x in p):
        prompts = [tokenizer.encode(x) for x in p]  # type: ignore[arg-type]
    elif p and all(isinstance(x, list) for x in p):
        prompts = [list(x) for x in p]  # type: ignore[union-attr]
    else:
        raise APIError(
            400, "prompt must be a string, a list of strings or token ids", param="prompt"
        )
    vocab = tokenizer.vocab_size
    for ids in prompts:
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
    return prompts


def check_choices(n: int) -> None:
    if not 1 <= n <= MAX_CHOICES:
        raise APIError(400, f"n must be between 1 and {MAX_CHOICES}", param="n")


def sampling_params(
    req: GenerationRequest, max_tokens: int, seed: int | None, top_logprobs: int
) -> SamplingParams:
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            seed=seed,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            top_logprobs=top_logprobs,
        )
    except InvalidSamplingParams as e:
        raise APIError(400, str(e), param=e.param) from None
    return params


def choice_seed(seed: int | None, choice: int) -> int | None:
    """The seed of the ``choice``-th choice of a prompt: with ``n`` > 1 and a
    seed, distinct but reproducible streams per choice."""
    return None if seed is None else (seed + choice) % (1 << 63)


def stop_strings(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        raise APIError(400, "stop strings must not be empty", param="stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings", param="stop")
    return stops


def check_lengths(
    prompt: list[int],
    max_tokens: int | None,
    param: str,
    *,
    context_length: int,
    max_prompt_tokens: int | None,
) -> int:
    """The request's max_tokens for ``prompt`` (``max_tokens`` None: the rest
    of the context window)."""
    if not prompt:
        raise APIError(400, "the prompt is empty", param=param)
    if max_prompt_tokens and len(prompt) > max_prompt_tokens:
        raise APIError(
            400,
            f"prompt has {len(prompt)} tokens; the limit is {max_prompt_tokens}",
            param=param,
        )
    room = context_length - len(prompt)
    if max_tokens is None:
        max_tokens = room
    if max_tokens < 1:
        raise APIError(400, "max_tokens must be at least 1", param="max_tokens")
    if len(prompt) + max_tokens > context_length:
        raise APIError(
            400,
            f"this model's maximum context length is {context_length} tokens; the request has "
            f"{len(prompt)} prompt tokens and asks for {max_tokens} more",
            param="max_tokens" if room > 0 else param,
        )
    return max_tokens
