"""Request checks and translation: an OpenAI request's sampling fields,
stop strings and token limits, or the 400 error that says what is wrong."""

from __future__ import annotations

import contextlib
import functools
from typing import Annotated, Any

import msgspec

from gateway.openai.errors import APIError
from gateway.openai.requests import ChatMessage, CompletionRequest, GenerationRequest, Prompt
from gateway.text import Tokenizer
from protocol.sampling import (
    SEED_MAX,
    SEED_MIN,
    InvalidSamplingParams,
    SamplingParams,
)

MAX_CHOICES = 16
"""Largest ``n``."""
MAX_STOP_STRINGS = 16
MAX_TEMPERATURE = 2.0
MAX_PENALTY = 2.0
"""OpenAI's ranges: temperature in [0, 2], presence and frequency penalties
in [-2, 2]; the repetition penalty (an extension) in (0, 2]."""
MAX_LOGIT_BIAS = 100.0
"""Logit bias values lie in [-100, 100]."""
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
"""The roles OpenAI takes (``function`` is its deprecated form of ``tool``)."""


def completion_prompts(
    prompt: Prompt, tokenizer: Tokenizer, vocab_size: int | None = None
) -> list[list[int]]:
    """The token ids of each prompt of a completions request; given token ids
    must be in [0, ``vocab_size``) (None: the tokenizer's size)."""
    p: Any = prompt
    vocab = tokenizer.vocab_size if vocab_size is None else vocab_size
    if isinstance(p, list) and p and isinstance(p[0], int):
        # The common case of ids, checked and copied in one pass in C; any
        # failure takes the full path below, which says what is wrong.
        with contextlib.suppress(msgspec.ValidationError):
            return [msgspec.convert(p, _ids_below(vocab))]
    if isinstance(p, str):
        prompts = [tokenizer.encode(p)]
    elif not isinstance(p, list) or not p:
        prompts = []
    elif _all_token_ids(p):
        prompts = [list(p)]
    elif all(isinstance(x, str) for x in p):
        prompts = [tokenizer.encode(x) for x in p]
    elif all(isinstance(x, list) and _all_token_ids(x) for x in p):
        prompts = [list(x) for x in p]
    else:
        prompts = []
    if not prompts:
        raise APIError(
            400,
            "prompt must be a string, a list of strings, a list of token ids or a list of "
            "lists of token ids, none empty",
            param="prompt",
        )
    for ids in prompts:
        # Every id is an int by now (given, or from the tokenizer).
        _check_range(ids, vocab, "prompt")
    return prompts


@functools.lru_cache(maxsize=8)
def _ids_below(vocab_size: int) -> Any:
    """A list of token ids in [0, ``vocab_size``), as msgspec checks it: exact
    ints only (no bool, float or string), as ``_all_token_ids`` takes them."""
    return list[Annotated[int, msgspec.Meta(ge=0, lt=vocab_size)]]


def _all_token_ids(xs: list[Any]) -> bool:
    # The exact type: bool is an int subclass, but true is no token id. One
    # pass in C (set of types) rather than two isinstance calls per id.
    return bool(xs) and set(map(type, xs)) == {int}


def check_messages(messages: list[ChatMessage]) -> None:
    """Each chat message is one OpenAI takes: a known role, and the fields that
    role needs, or a 400 naming the first wrong one (``messages[2].role``).
    A template would otherwise render an unknown role or a missing content
    into some prompt, and the client would get an answer to a question it
    never asked."""
    if not messages:
        raise APIError(400, "messages must not be empty", param="messages")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.role not in CHAT_ROLES:
            raise APIError(
                400,
                f"{where}.role: invalid value {m.role!r}; supported values are "
                + ", ".join(repr(r) for r in CHAT_ROLES),
                param=f"{where}.role",
                code="invalid_value",
            )
        extra = m.model_extra or {}
        # An assistant turn that only calls tools carries no content.
        calls = m.role == "assistant" and (
            extra.get("tool_calls") is not None or extra.get("function_call") is not None
        )
        if m.content is None and not calls:
            raise APIError(
                400,
                f"missing required parameter: {where}.content",
                param=f"{where}.content",
                code="missing_required_parameter",
            )
        required = {"tool": "tool_call_id", "function": "name"}.get(m.role)
        for key in (required, "name"):
            if key is None or (key not in extra and key != required):
                continue
            if not isinstance(extra.get(key), str):
                why = f" (a {m.role} message needs one)" if key == required else ""
                raise APIError(400, f"{where}.{key} must be a string{why}", param=f"{where}.{key}")


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    """Token ids ``ids`` of field ``param`` are ints in [0, ``vocab_size``)."""
    if ids and not _all_token_ids(ids):
        raise APIError(400, f"{param}: token ids must be in [0, {vocab_size})", param=param)
    _check_range(ids, vocab_size, param)


def _check_range(ids: list[int], vocab_size: int, param: str) -> None:
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        raise APIError(400, f"{param}: token ids must be in [0, {vocab_size})", param=param)


def check_seed(seed: int | None) -> None:
    """Seeds are int64, as OpenAI takes them (a negative one too)."""
    if seed is not None and not SEED_MIN <= seed <= SEED_MAX:
        raise APIError(400, f"seed must be in [{SEED_MIN}, {SEED_MAX}]", param="seed")


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
        if value == 0 and scores_prompt_only(req):
            # One token is generated (and dropped): its prefill scores the prompt.
            return 1, param
        if value < 1:
            raise APIError(400, f"{param} must be at least 1", param=param)
        return value, param
    return default, "max_tokens"


def scores_prompt_only(req: GenerationRequest) -> bool:
    """A completions request that only scores its prompt: ``echo`` with
    ``logprobs`` and ``max_tokens`` 0 (what evaluation harnesses send for a
    loglikelihood). Its choices hold the prompt alone."""
    return (
        isinstance(req, CompletionRequest)
        and req.echo
        and req.logprobs is not None
        and req.max_tokens == 0
    )


def check_choices(n: int) -> None:
    if not 1 <= n <= MAX_CHOICES:
        raise APIError(400, f"n must be between 1 and {MAX_CHOICES}", param="n")


def sampling_params(
    req: GenerationRequest,
    max_tokens: int,
    seed: int | None,
    top_logprobs: int,
    vocab_size: int | None = None,
) -> SamplingParams:
    """The request's sampling fields, checked against OpenAI's ranges (and
    ``logit_bias`` ids against ``vocab_size``), or a 400 naming the field."""
    check_unsupported(req)
    check_ranges(req)
    prompt_logprobs = None
    if isinstance(req, CompletionRequest) and req.echo and req.logprobs is not None:
        prompt_logprobs = req.logprobs
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
            logit_bias=logit_bias(req.logit_bias, vocab_size),
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=(1.0 if req.repetition_penalty is None else req.repetition_penalty),
            prompt_logprobs=prompt_logprobs,
        )
    except InvalidSamplingParams as e:
        raise APIError(400, str(e), param=e.param) from None
    return params


def check_unsupported(req: GenerationRequest) -> None:
    """Fields of the OpenAI API this server declares but does not serve are
    refused when they ask for something (unknown fields never get this far)."""
    if isinstance(req, CompletionRequest):
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(
                400,
                "best_of is not supported (only best_of equal to n, which ranks nothing)",
                param="best_of",
            )
        if req.suffix:
            raise APIError(400, "suffix (insertion) is not supported", param="suffix")


def check_ranges(req: GenerationRequest) -> None:
    """OpenAI's ranges of the sampling fields (the engine takes wider ones)."""
    t = req.temperature
    if t is not None and not 0.0 <= t <= MAX_TEMPERATURE:
        raise APIError(
            400, f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {t}", param="temperature"
        )
    for param in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, param)
        if value is not None and not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise APIError(
                400,
                f"{param} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}",
                param=param,
            )
    r = req.repetition_penalty
    if r is not None and not 0.0 < r <= MAX_PENALTY:
        raise APIError(
            400,
            f"repetition_penalty must be in (0, {MAX_PENALTY:g}], got {r}",
            param="repetition_penalty",
        )


def logit_bias(bias: dict[str, float] | None, vocab_size: int | None) -> dict[int, float]:
    """``logit_bias`` with token ids as integers, each in [0, ``vocab_size``)
    and each bias in [-100, 100]."""
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        token = _token_key(key)
        if token is None or (vocab_size is not None and token >= vocab_size):
            bound = f"[0, {vocab_size})" if vocab_size is not None else "[0, vocab)"
            raise APIError(
                400,
                f"logit_bias: {key!r} is not a token id in {bound}",
                param="logit_bias",
            )
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise APIError(
                400,
                f"logit_bias: the bias of token {token} must be in "
                f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value}",
                param="logit_bias",
            )
        out[token] = value
    return out


def _token_key(key: str) -> int | None:
    """The token id a ``logit_bias`` key names: decimal digits only (no sign,
    space or underscore, which ``int()`` would take)."""
    if not key.isascii() or not key.isdigit() or len(key) > 20:
        return None
    return int(key)


def choice_seed(seed: int | None, choice: int) -> int | None:
    """The seed of the ``choice``-th choice of a prompt: with ``n`` > 1 and a
    seed, distinct but reproducible streams per choice."""
    if seed is None:
        return None
    # Wrapped around within int64, as the seeds themselves are.
    return (seed + choice - SEED_MIN) % (1 << 64) + SEED_MIN


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
    max_model_len: int | None = None,
) -> int:
    """The request's max_tokens for ``prompt`` (``max_tokens`` None: the rest
    of the window); errors about it name ``max_tokens_param``. The window is
    ``max_model_len`` where it is less than the context length (the workers'
    KV pools hold fewer tokens): a prompt that does not fit it could never
    run, and is refused here rather than by a worker."""
    if not prompt:
        raise APIError(400, "the prompt is empty", param=param)
    n = len(prompt)
    if max_prompt_tokens and n > max_prompt_tokens:
        raise APIError(
            400,
            f"prompt has {n} tokens; the limit is {max_prompt_tokens}",
            param=param,
        )
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, f"{max_tokens_param} must be at least 1", param=max_tokens_param)
    limit = context_length
    if max_model_len is not None and 0 < max_model_len < context_length:
        limit = max_model_len
    room = limit - n
    if room < 1 or (max_tokens is not None and max_tokens > room):
        if limit < context_length:
            window = (
                f"this server takes at most {limit} tokens of prompt plus output per request "
                f"(what its workers' KV pools hold; the model's context length is "
                f"{context_length})"
            )
        else:
            window = f"this model's maximum context length is {limit} tokens"
        asks = "" if max_tokens is None else f" and asks for {max_tokens} more"
        if room < 1:
            asks += "; at least one token must be generated"
        raise APIError(
            400,
            f"{window}; the request has {n} prompt tokens{asks}",
            param=max_tokens_param if room > 0 else param,
        )
    return room if max_tokens is None else max_tokens
