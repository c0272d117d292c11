"""OpenAI API request bodies (the subset this gateway serves)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

Prompt = str | list[str] | list[int] | list[list[int]]
"""A completions prompt: text, texts, token ids, or lists of token ids."""

_STRICT = ConfigDict(strict=True)
"""Fields take their own JSON type only: an integer field no boolean
(``true`` is not token id 1), float (``1.5``, ``2.0``) or string; a boolean
field no number or string. A float field still takes an integer."""


class _Request(BaseModel):
    # Unknown fields are accepted and ignored, as the OpenAI API does for
    # forward compatibility of clients.
    model_config = ConfigDict(extra="allow", **_STRICT)

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
    structured_outputs: dict[str, Any] | None = None
    """Extension (vLLM's name): one of json, json_object, regex, choice,
    grammar, structural_tag (``gateway.openai.structured``)."""


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False


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
    prompt: Prompt
    logprobs: int | None = None
    echo: bool = False


GenerationRequest = ChatCompletionRequest | CompletionRequest
"""A request that generates text, on either endpoint."""
