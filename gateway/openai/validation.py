"""Request checks and translation: an OpenAI request's sampling fields,
stop strings and token limits, or the 400 error that says what is wrong."""

from __future__ import annotations

from gateway.openai.errors import APIError
from gateway.openai.requests import GenerationRequest, Prompt
from gateway.text import Tokenizer
from protocol.sampling import WIRE_INT_MAX, InvalidSamplingParams, SamplingParams

MAX_CHOICES = 16
"""Largest ``n``."""
MAX_STOP_STRINGS = 16
MAX_SEED = WIRE_INT_MAX
"""Largest seed: the engine folds any non-negative seed, the request plane
carries up to this."""


def completion_prompts(
    prompt: Prompt, tokenizer: Tokenizer, vocab_size: int | None = None
) -> list[list[int]]:
    """The token ids of each prompt of a completions request; given token ids
    must be in [0, ``vocab_size``) (None: the tokenizer's size)."""
    p = prompt
    if isinstance(p, str):
        prompts = [tokenizer.encode(p)]
    elif p and all(_token_id_type(x) for x in p):
        prompts = [list(p)]  # type: ignore[arg-type]
    elif p and all(isinstance(x, str) for x in p):
        prompts = [tokenizer.encode(x) for x in p]  # type: ignore[arg-type]
    elif p and all(isinstance(x, list) and all(_token_id_type(t) for t in x) for x in p):
        prompts = [list(x) for x in p]  # type: ignore[union-attr]
    else:
        raise APIError(
            400, "prompt must be a string, a list of strings or token ids", param="prompt"
        )
    vocab = tokenizer.vocab_size if vocab_size is None else vocab_size
    for ids in prompts:
        check_token_ids(ids, vocab, "prompt")
    return prompts


def _token_id_type(x: object) -> bool:
    # bool is an int subclass, but true is no token id.
    return isinstance(x, int) and not isinstance(x, bool)


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    """Token ids ``ids`` of field ``param`` are ints in [0, ``vocab_size``)."""
    for t in ids:
        if not _token_id_type(t) or not 0 <= t < vocab_size:
            raise APIError(400, f"{param}: token ids must be in [0, {vocab_size})", param=param)


def check_seed(seed: int | None) -> None:
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise APIError(400, f"seed must be in [0, {MAX_SEED}]", param="seed")


def requested_max_tokens(req: GenerationRequest, default: int | None) -> tuple[int | None, str]:
    """The request's token limit (``default`` when it sets none) and the field
    it came from: ``max_completion_tokens`` (chat) wins over ``max_tokens``.
    A limit below 1 is refused, not read as "unset"."""
    declared = type(req).model_fields
    for param in ("max_completion_tokens", "max_tokens"):
        # Declared fields only: an unknown field (kept as an extra) is ignored.
        value = getattr(req, param) if param in declared else None
        if value is None:
            continue
        if value < 1:
            raise APIError(400, f"{param} must be at least 1", param=param)
        return value, param
    return default, "max_tokens"


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
    max_tokens_param: str = "max_tokens",
) -> int:
    """The request's max_tokens for ``prompt`` (``max_tokens`` None: the rest
    of the context window); errors about it name ``max_tokens_param``."""
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
        raise APIError(400, f"{max_tokens_param} must be at least 1", param=max_tokens_param)
    if len(prompt) + max_tokens > context_length:
        raise APIError(
            400,
            f"this model's maximum context length is {context_length} tokens; the request has "
            f"{len(prompt)} prompt tokens and asks for {max_tokens} more",
            param=max_tokens_param if room > 0 else param,
        )
    return max_tokens
