"""Per-request sampling parameters: one validated type for the gateway, the
request plane and the engine.

``SamplingParams`` is a frozen msgspec Struct, so it is also the wire form:
validation runs on construction and on decoding, and a decoded message with an
out-of-range value fails as a whole (the worker answers it with an error).
"""

from __future__ import annotations

import math

import msgspec

MAX_TOP_LOGPROBS = 20
WIRE_INT_MAX = (1 << 64) - 1
"""Largest integer the request plane carries (msgpack's uint64): a larger one
cannot be encoded, so it is refused here, where the value is made."""
SEED_MIN = -(1 << 63)
SEED_MAX = (1 << 63) - 1
"""Seeds are int64, as OpenAI's API takes them (negative ones too)."""
MAX_LOGIT_BIAS = 1024
"""Most ``logit_bias`` entries one request may carry (it is shipped with
every message and applied at every step)."""


class InvalidSamplingParams(ValueError):
    """A sampling parameter is out of range. ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "ebnf", "choice", "structural_tag")
"""What a ``GrammarSpec`` can constrain the output to."""


class GrammarSpec(msgspec.Struct, frozen=True):
    """A constraint on a request's output, compiled by the engine (xgrammar).

    ``spec`` by ``kind``: ``json_object``: ignored (any JSON object);
    ``json_schema``: the schema as JSON text; ``regex``: the pattern;
    ``ebnf``: the grammar (a ``root`` rule); ``choice``: a JSON list of
    strings, the output being exactly one of them; ``structural_tag``:
    xgrammar's structural tag as JSON text."""

    kind: str
    spec: str = ""


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1 (or 0) disables top-k."""
    min_p: float = 0.0
    seed: int | None = None
    """Fixes the random stream of this request: same seed, same tokens."""
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    top_logprobs: int = 0
    """Also return this many most likely tokens (and logprobs) at each step."""
    grammar: GrammarSpec | None = None
    """Constrain the output to this grammar; it ends (finish "stop") once complete."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits before sampling, sorted by
    id; a dict is accepted. Token ids are checked against the model's
    vocabulary by the engine."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already generated."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was generated."""
    repetition_penalty: float = 1.0
    """Divides positive (multiplies negative) logits of tokens seen in the
    prompt or the output (HF/vLLM); 1 is off."""
    prompt_logprobs: int | None = None
    """Also return the logprob of each prompt token given its prefix, with this
    many most likely alternatives (None: not asked for). Such a request does
    not reuse cached prompt KV: a cached prefix has no logits."""

    def __post_init__(self) -> None:
        # Lists are accepted for convenience but the stored value stays immutable
        # (and hashable).
        msgspec.structs.force_setattr(
            self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids)
        )
        for name in ("max_tokens", "top_k"):
            value = getattr(self, name)
            if _integer(value) and value > WIRE_INT_MAX:
                raise InvalidSamplingParams(name, f"must be at most {WIRE_INT_MAX}, got {value}")
        if not _integer(self.max_tokens) or self.max_tokens < 1:
            raise InvalidSamplingParams(
                "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}"
            )
        if not _finite(self.temperature) or self.temperature < 0:
            raise InvalidSamplingParams("temperature", f"must be >= 0, got {self.temperature!r}")
        if not _finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidSamplingParams("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _integer(self.top_k) or (self.top_k < 1 and self.top_k not in (0, -1)):
            raise InvalidSamplingParams(
                "top_k", f"must be -1, 0 (disabled) or >= 1, got {self.top_k!r}"
            )
        if not _finite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidSamplingParams("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (
            not _integer(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX
        ):
            raise InvalidSamplingParams(
                "seed", f"must be an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}"
            )
        if not _integer(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidSamplingParams(
                "top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}"
            )
        if any(not 0 <= t <= WIRE_INT_MAX for t in self.stop_token_ids):
            raise InvalidSamplingParams(
                "stop_token_ids", f"token ids must be in [0, {WIRE_INT_MAX}]"
            )

        if self.grammar is not None:
            _check_grammar(self.grammar, self.ignore_eos)
        _check_logit_adjustments(self)
        if self.prompt_logprobs is not None and (
            not _integer(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS
        ):
            raise InvalidSamplingParams(
                "prompt_logprobs",
                f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs!r}",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Some penalty needs the counts of the tokens seen so far."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def _check_grammar(grammar: GrammarSpec, ignore_eos: bool) -> None:
    if grammar.kind not in GRAMMAR_KINDS:
        raise InvalidSamplingParams(
            "grammar", f"kind must be one of {', '.join(GRAMMAR_KINDS)}, got {grammar.kind!r}"
        )
    if ignore_eos:
        # A complete grammar ends the output with an end-of-sequence token.
        raise InvalidSamplingParams("ignore_eos", "cannot be combined with a grammar")


def _check_logit_adjustments(p: SamplingParams) -> None:
    bias = p.logit_bias
    items = list(bias.items() if isinstance(bias, dict) else bias)
    if len(items) > MAX_LOGIT_BIAS:
        raise InvalidSamplingParams("logit_bias", f"at most {MAX_LOGIT_BIAS} entries")
    for pair in items:
        if (
            not isinstance(pair, (tuple, list))
            or len(pair) != 2
            or not _integer(pair[0])
            or isinstance(pair[0], bool)
            or not 0 <= pair[0] <= WIRE_INT_MAX
            or not _finite(pair[1])
        ):
            raise InvalidSamplingParams(
                "logit_bias", f"entries must be (token id >= 0, finite bias), got {pair!r}"
            )
    pairs = sorted(items, key=lambda x: x[0])
    if len({t for t, _ in pairs}) != len(pairs):
        raise InvalidSamplingParams("logit_bias", "a token id is listed twice")
    msgspec.structs.force_setattr(p, "logit_bias", tuple((t, float(b)) for t, b in pairs))
    for name in ("presence_penalty", "frequency_penalty"):
        if not _finite(getattr(p, name)):
            raise InvalidSamplingParams(name, f"must be a finite number, got {getattr(p, name)!r}")
    if not _finite(p.repetition_penalty) or p.repetition_penalty <= 0:
        raise InvalidSamplingParams(
            "repetition_penalty", f"must be > 0, got {p.repetition_penalty!r}"
        )


def _integer(x: object) -> bool:
    return isinstance(x, int)


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
