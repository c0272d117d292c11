"""A request's state inside the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from protocol.finish import FinishReason
from protocol.sampling import SamplingParams

if TYPE_CHECKING:
    from engine.grammar import RequestGrammar
    from engine.kvcache.radix import RadixNode


class EngineRequestError(ValueError):
    """A request the engine refuses (bad prompt, does not fit, duplicate id)."""

    param: str | None = None
    """The request field at fault, when the error is about one: PROMPT_PARAM for
    a prompt that can never run (empty, too long, ids outside the
    vocabulary), a sampling parameter's name, or None (the request id)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        if param is not None:  # else the class's own (a subclass names its field)
            self.param = param


@dataclass(eq=False)
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    max_total_len: int
    """Prompt plus output never exceed this (max_tokens and the context window)."""
    fill_ids: list[int] = field(default_factory=list)
    """Prompt then output: the tokens whose KV the request needs."""
    output_logprobs: list[float] = field(default_factory=list)
    page_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    """Leading tokens of ``fill_ids`` whose KV is in the pool or being written
    by a launched forward."""
    num_cached_tokens: int = -1
    """Prefix-cache hit at first admission (-1 until admitted)."""
    cache_node: RadixNode | None = None
    finish_reason: FinishReason | None = None
    pending: int = 0
    """Tokens sampled by a launched forward but not yet appended (overlap)."""
    count_slot: int = -1
    """Row of this request's token counts on the device (penalties; -1: none)."""
    prompt_logprobs: list[float] = field(default_factory=list)
    """Logprob of prompt token ``i + 1`` given its prefix, at ``[i]`` (when asked for)."""
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_scored: bool = False
    """Every prompt token has its logprob (or none was asked for)."""
    grammar: RequestGrammar | None = None
    """The output's grammar, when its params carry one."""

    def __post_init__(self) -> None:
        if not self.fill_ids:
            self.fill_ids = list(self.prompt_ids)
        if self.params.prompt_logprobs is None:
            self.prompt_scored = True

    @property
    def scores_prompt(self) -> bool:
        """Its prompt logprobs are still to be computed: its prefill must run
        over the whole prompt (no cached prefix) with logits at every token.
        Not once it has a token: then they were sent with it, or computed by
        the prefill worker that sampled it (a decode worker's copy)."""
        return not self.prompt_scored and len(self.fill_ids) == len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.fill_ids[len(self.prompt_ids) :]

    @property
    def num_output(self) -> int:
        return len(self.fill_ids) - len(self.prompt_ids)

    @property
    def remaining(self) -> int:
        """Tokens still to run through the model before the next sample."""
        return len(self.fill_ids) + self.pending - self.num_computed

    @property
    def will_finish(self) -> bool:
        """The in-flight token already reaches max_tokens or the window."""
        return self.pending > 0 and (
            self.num_output + self.pending >= self.params.max_tokens
            or len(self.fill_ids) + self.pending >= self.max_total_len
        )


class StepOutput(NamedTuple):
    rid: str
    token_id: int
    logprob: float
    finish_reason: FinishReason | None
    """None while running; STOP, LENGTH or ABORT at the end."""
    num_cached_tokens: int
    top_logprobs: list[tuple[int, float]] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    """On a request's first token, when it asked for them."""


class PromptLogprobs(NamedTuple):
    """The logprob of each prompt token but the first given its prefix, and its
    most likely alternatives at that position (empty lists when none were asked)."""

    logprobs: list[float]
    top: list[list[tuple[int, float]]]
