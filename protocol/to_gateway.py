"""Messages a worker sends back to the requester on the request plane."""

from __future__ import annotations

import msgspec

from protocol.finish import FinishReason
from protocol.kv_events import KvEvents


class TokenDelta(msgspec.Struct, array_like=True, frozen=True):
    rid: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason | None = None
    """None while running; set on the request's final delta (``protocol.finish``)."""
    num_cached_tokens: int = 0
    error: str | None = None
    """Set with finish_reason ERROR: why the request failed (``WORKER_STOPPED``:
    the worker stopped while serving it)."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """Per token: the most likely (token id, logprob) pairs, when asked for."""
    stages: dict[str, float] | None = None
    """On a request's final delta: the worker's stage stamps (``protocol.stages``)
    as seconds after it received the request. Older peers neither send nor read it."""
    prompt_logprobs: list[float] | None = None
    """With a request's first token, when it asked for them: the logprob of each
    prompt token but the first, given the tokens before it."""
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    """With ``prompt_logprobs``: the most likely (token id, logprob) pairs at each
    of those positions (empty lists when no alternatives were asked for)."""
    error_param: str | None = None
    """Set with finish_reason ERROR when the request itself is at fault: the
    parameter the worker refused (``PROMPT_PARAM``, ``GRAMMAR_PARAM`` for one
    that does not compile, or another sampling parameter's name). Not a
    failure of the worker."""
    retry: bool = False
    """Set with finish_reason ERROR when the worker did not take the request
    (it is draining before it stops): nothing of it ran, so the requester may
    send it to another worker."""


class Tokens(msgspec.Struct, tag="tokens", frozen=True):
    """The new tokens of every request of this requester, one frame per step."""

    deltas: list[TokenDelta]


ToGateway = Tokens | KvEvents
decoder = msgspec.msgpack.Decoder(ToGateway)
encoder = msgspec.msgpack.Encoder()
