"""OpenAI API request bodies (the subset this gateway serves)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, SkipValidation

Prompt = str | list[str] | list[int] | list[list[int]]
"""A completions prompt: text, texts, token ids, or lists of token ids."""

_STRICT = ConfigDict(strict=True)
"""Fields take their own JSON type only: an integer field no boolean
(``true`` is not token id 1), float (``1.5``, ``2.0``) or string; a boolean
field no number or string. A float field still takes an integer."""


class _Request(BaseModel):
    # Unknown fields are refused (a 400 naming the field), as the OpenAI API
    # does: a parameter that was silently ignored would give a client wrong
    # results without an error. docs/api.md (Request fields) lists every field.
    model_config = ConfigDict(extra="forbid", **_STRICT)

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    return_token_ids: bool = False
    """Extension: the response carries prompt_token_ids and each choice's token_ids."""
    logit_bias: dict[str, float] | None = None
    """Token id (a string: JSON object keys are) -> bias in [-100, 100]."""
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    """Extension (HF/vLLM): in (0, 2], 1 is off; covers prompt and output tokens."""
    metadata: dict[str, str] | None = None
    """Accepted and ignored on purpose, as ``user``, ``store`` and
    ``service_tier``: they ask nothing of the generation."""
    store: bool | None = None
    service_tier: str | None = None
    structured_outputs: dict[str, Any] | None = None
    """Extension (vLLM's name): one of json, json_object, regex, choice,
    grammar, structural_tag (``gateway.openai.structured``)."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", **_STRICT)

    include_usage: bool = False
    include_obfuscation: bool | None = None
    """Ignored on purpose: chunks carry no padding against length side channels."""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", **_STRICT)

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_Request):
    prompt: SkipValidation[Prompt]
    """Checked by ``validation.completion_prompts`` (a 400 naming ``prompt``):
    validating a union of lists here costs ~0.2 µs per token id, a
    millisecond of TTFT for a 4k-token prompt sent as ids."""
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    """Only ``n`` (or unset): ranking more samples than are returned is not served."""
    suffix: str | None = None
    """Only empty (or unset): insertion is not served."""


GenerationRequest = ChatCompletionRequest | CompletionRequest
"""A request that generates text, on either endpoint."""
