"""How a request ends on the wire: its finish reason, and for a failure the
values of the error fields that the requester compares. Torch-free.

A worker's engine produces them, its request plane carries them to the
gateway (``TokenDelta``) and its KV plane from a prefill to a decode worker
(``kvtransfer.to_decode.Done``); the gateway reads them. No side writes
them as bare strings.
"""

from __future__ import annotations

from enum import StrEnum


class FinishReason(StrEnum):
    """``TokenDelta.finish_reason`` of a request's final delta (None before it).

    A str enum: a member is its value wherever a str goes (compared, logged,
    written as JSON), and msgspec carries it as that string."""

    STOP = "stop"
    """A stop token (end of sequence, ``stop_token_ids``; a complete grammar
    ends with one). The gateway also ends a choice with it at a stop string."""
    LENGTH = "length"
    """``max_tokens``, the context length or the KV pool's limit reached."""
    ABORT = "abort"
    """Aborted: the requester asked (``Abort``), left, or fell silent."""
    ERROR = "error"
    """Failed; ``TokenDelta.error`` says why (``error_param``: the request's
    own fault; ``retry``: nothing of it ran)."""
    PREFILL_DONE = "prefill_done"
    """A prefill worker's only delta: the first token is out, and decoding
    continues on the decode worker (the request has not ended)."""


ENDED = frozenset({FinishReason.STOP, FinishReason.LENGTH})
"""The reasons of a request that ran to its end (the others: it did not, or
it goes on elsewhere)."""

FAILED = frozenset({FinishReason.ERROR, FinishReason.ABORT})
"""The reasons of a request that failed or was aborted: a delta with one
carries no tokens, and the tokens before it are not merged into it."""

WORKER_STOPPED = "worker is shutting down"
"""``TokenDelta.error`` of every request an engine process still has when it
stops on request: after a drain that ran out of time, or with no drain (one
that crashed, or whose front process died, says so instead). The gateway
tells by it that the worker stopped while serving, rather than failed."""

PROMPT_PARAM = "prompt"
"""``TokenDelta.error_param`` of a request refused for its prompt (empty, too
long for the worker, a token id outside the vocabulary)."""

GRAMMAR_PARAM = "grammar"
"""``TokenDelta.error_param`` of a request refused for its grammar
(``SamplingParams.grammar``: one the engine cannot compile). The other values
are the names of the other sampling parameters a worker refuses."""
