"""The OpenAI API as the gateway speaks it: request bodies and their checks,
errors, the choices of a request, and the response shapes of the chat and
completions endpoints, whole or streamed.

- ``errors``: ``APIError``, the OpenAI error body.
- ``requests``: the request bodies.
- ``validation``: sampling fields, stop strings and token limits.
- ``choices``: ``ChoiceEvent`` streams, one per choice, and their merge.
- ``shapes``: ``ChatShape`` and ``CompletionShape``, one ``ResponseShape`` each.
- ``responses``: whole response bodies, usage, the model list.
- ``sse``: streamed responses as server-sent events.
"""

from gateway.openai.choices import ChoiceEvent, choice_stream, collect_choices, merge_choices
from gateway.openai.errors import APIError, internal_error, request_timeout
from gateway.openai.requests import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    GenerationRequest,
    StreamOptions,
)
from gateway.openai.responses import (
    ModelCard,
    ModelList,
    ResponseContext,
    full_response,
    now,
    usage,
)
from gateway.openai.shapes import ChatShape, CompletionShape, ResponseShape
from gateway.openai.sse import ClosingStreamingResponse, StreamWriter, sse_stream
from gateway.openai.validation import (
    check_choices,
    check_lengths,
    check_seed,
    check_token_ids,
    choice_seed,
    completion_prompts,
    requested_max_tokens,
    sampling_params,
    stop_strings,
)

__all__ = [
    "APIError",
    "ChatCompletionRequest",
    "ChatMessage",
    "ChatShape",
    "ChoiceEvent",
    "ClosingStreamingResponse",
    "CompletionRequest",
    "CompletionShape",
    "GenerationRequest",
    "ModelCard",
    "ModelList",
    "ResponseContext",
    "ResponseShape",
    "StreamOptions",
    "StreamWriter",
    "check_choices",
    "check_lengths",
    "check_seed",
    "check_token_ids",
    "choice_seed",
    "choice_stream",
    "collect_choices",
    "completion_prompts",
    "full_response",
    "internal_error",
    "merge_choices",
    "now",
    "request_timeout",
    "requested_max_tokens",
    "sampling_params",
    "sse_stream",
    "stop_strings",
    "usage",
]
