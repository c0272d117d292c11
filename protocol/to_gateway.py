"""Messages a worker sends back to the requester on the request plane."""

from __future__ import annotations

import msgspec


class TokenDelta(msgspec.Struct, array_like=True, frozen=True):
    rid: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None
    """None while running; "stop", "length", "abort" or "error" at the end."""
    num_cached_tokens: int = 0
    error: str | None = None
    """Set with finish_reason "error": why the request failed."""
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
    """Set with finish_reason "error" when the request itself is at fault: the
    sampling parameter the worker refused (e.g. "grammar", one that does not
    compile). Not a failure of the worker."""
    retry: bool = False
    """Set with finish_reason "error" when the worker did not take the request
    (it is draining before it stops): nothing of it ran, so the requester may
    send it to another worker."""


class Tokens(msgspec.Struct, tag="tokens", frozen=True):
    """The new tokens of every request of this requester, one frame per step."""

    deltas: list[TokenDelta]


ToGateway = Tokens
decoder = msgspec.msgpack.Decoder(ToGateway)
encoder = msgspec.msgpack.Encoder()
