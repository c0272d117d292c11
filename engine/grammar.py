"""Grammar-constrained decoding with xgrammar.

- ``GrammarBackend``: the model's tokenizer as xgrammar sees it and a cache of
  compiled grammars keyed by ``GrammarSpec`` (kind, spec), so a schema sent
  with many requests is compiled once.
- ``RequestGrammar``: one request's matcher and how many of its output tokens
  it has accepted. Tokens are accepted lazily, right before the next mask is
  filled, from the request's own output: a token that reached the output by
  another path (the first token of a disaggregated request, which the prefill
  worker sampled under the same grammar; a retracted request recomputed) is
  replayed the same way as one this engine sampled.
- ``GrammarStep``: the mask of one batch's grammar rows. The sampler calls it
  with the logits once the forward is queued, so the host fills the bitmask
  while the device runs the forward; with the overlap loop, the in-flight
  step's tokens are read first (its copy to the host is already queued).
- ``MaskBuffer``: the pinned host memory a step's mask is filled into (row
  indices and bitmask together) and its copy to the device.
- ``apply_packed_bitmask``: that mask on the logits, in one kernel on CUDA
  (``engine.grammar_triton``); ``apply_token_bitmask``: the same in tensor
  ops, on any device (the reference).

A grammar ends with one of the model's end-of-sequence tokens (the matcher's
stop tokens), which the scheduler already ends a request on ("stop").
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.request import EngineRequestError
from protocol.finish import GRAMMAR_PARAM
from protocol.host import usable_cores
from protocol.sampling import GrammarSpec

if TYPE_CHECKING:
    from engine.request import Request
    from engine.runner import ForwardOutput

log = logging.getLogger(__name__)

CACHE_SIZE = 256
"""Compiled grammars kept (least recently used dropped first)."""

_FREE_CHAR = r"[^\"\\\r\n]"
_JSON_CHAR = r"[^\0-\x1f\"\\\r\n]"
"""xgrammar 0.2.8 lets length- and pattern-limited JSON strings contain raw
control characters, which JSON forbids (``json.loads`` refuses them); its
plain string rule excludes them, and so do the compiled schemas here."""


class GrammarTimes:
    """Host seconds the grammar steps spent, summed (the benchmarks read them):
    waiting for the in-flight tokens, accepting tokens and filling the
    bitmask, queueing its copy to the device, and queueing the mask on the
    logits."""

    __slots__ = ("steps", "wait", "fill", "copy", "apply")

    def __init__(self) -> None:
        self.steps = 0
        self.wait = self.fill = self.copy = self.apply = 0.0

    def snapshot(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in self.__slots__}


class GrammarError(EngineRequestError):
    """A grammar that does not compile: the request's fault, not the worker's."""

    param = GRAMMAR_PARAM


def _max_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def _fill_threads() -> int:
    # Half the cores this process may run on: the mask is filled while the
    # loop's other threads (and the other workers on the host) keep theirs.
    return max(1, min(8, usable_cores() // 2))


def load_tokenizer(model_dir: str) -> Any:
    """The transformers tokenizer xgrammar reads the vocabulary from. Where
    ``tokenizer.json`` is present, the fast tokenizer's base class reads it
    as it is: xgrammar imports that class anyway, while ``AutoTokenizer``
    imports transformers' model registry, whose imports (torch.distributed's
    tensor ops, torch._dynamo, scikit-learn where installed) took seconds of
    a worker's start on a GPU host (docs/operating.md). Otherwise (a
    SentencePiece or tiktoken model) ``AutoTokenizer`` picks the class."""
    if os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


class GrammarBackend:
    """Compiles ``GrammarSpec``s for one tokenizer and makes request matchers.

    ``tokenizer_info`` is an ``xgrammar.TokenizerInfo`` whose vocabulary size
    is the model's (its logits' width); ``stop_token_ids`` end a grammar;
    ``fill_threads``: xgrammar's threads filling a step's bitmask (None: half
    the cores this process may use, at most 8)."""

    def __init__(
        self,
        tokenizer_info: Any,
        stop_token_ids: Sequence[int],
        cache_size: int = CACHE_SIZE,
        fill_threads: int | None = None,
    ) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.info = tokenizer_info
        self.vocab_size: int = tokenizer_info.vocab_size
        self.stop_token_ids = list(stop_token_ids)
        # Our own cache holds the compiled results (xgrammar's would key the
        # schema paths on text we rewrite anyway).
        self.compiler = xgr.GrammarCompiler(
            tokenizer_info, max_threads=_max_threads(), cache_enabled=False
        )
        self._cache: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._cache_size = cache_size
        self.fill_threads = fill_threads or _fill_threads()
        self._batch = xgr.BatchGrammarMatcher(self.fill_threads)
        self.mask_buffer = MaskBuffer(-(-self.vocab_size // 32))
        self.times = GrammarTimes()

    @classmethod
    def for_model(
        cls,
        model_dir: str,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        fill_threads: int | None = None,
        mark: Callable[[str], None] | None = None,
    ) -> GrammarBackend:
        """The backend of the HF tokenizer files in ``model_dir``. ``mark``
        (``runner.StartTimes.done``) is called with the name of each step as it
        ends: the imports, the tokenizer's loading, xgrammar's view of its
        vocabulary, the compiler."""
        done = mark or (lambda part: None)
        import xgrammar as xgr

        done("grammar imports")
        try:
            tokenizer = load_tokenizer(model_dir)
        except Exception as e:  # noqa: BLE001 (any loader failure means the same)
            raise GrammarError(
                f"structured output needs the model's tokenizer files, which {model_dir} "
                f"does not provide: {e}"
            ) from e
        done("tokenizer")
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        done("tokenizer vocabulary")
        backend = cls(info, stop_token_ids, fill_threads=fill_threads)
        done("grammar compiler")
        return backend

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar of ``spec`` (``GrammarError`` if it has none)."""
        hit = self._cache.get(spec)
        if hit is not None:
            self._cache.move_to_end(spec)
            return hit
        try:
            compiled = self._compile(spec)
        except GrammarError:
            raise
        except Exception as e:  # noqa: BLE001 (xgrammar raises RuntimeError and others)
            raise GrammarError(f"invalid {spec.kind}: {_short(e)}") from None
        self._cache[spec] = compiled
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: GrammarSpec) -> Any:
        xgr, kind = self._xgr, spec.kind
        if kind in ("json_object", "json_schema"):
            schema: Any = {"type": "object"}
            if kind == "json_schema":
                schema = _json(spec.spec, "json_schema")
                if not isinstance(schema, (dict, bool)):
                    raise GrammarError("invalid json_schema: a schema is a JSON object")
            # Compact separators and no free whitespace: a model cannot pad
            # the output with whitespace until it runs out of tokens.
            grammar = xgr.Grammar.from_json_schema(
                json.dumps(schema), any_whitespace=False, strict_mode=True
            )
            return self.compiler.compile_grammar(str(grammar).replace(_FREE_CHAR, _JSON_CHAR))
        if kind == "regex":
            return self.compiler.compile_regex(spec.spec)
        if kind == "ebnf":
            return self.compiler.compile_grammar(spec.spec)
        if kind == "choice":
            choices = _json(spec.spec, "choice")
            if (
                not isinstance(choices, list)
                or not choices
                or not all(isinstance(c, str) and c for c in choices)
            ):
                raise GrammarError("invalid choice: a non-empty list of non-empty strings")
            # EBNF string literals take JSON's escapes.
            return self.compiler.compile_grammar(
                "root ::= " + " | ".join(json.dumps(c) for c in dict.fromkeys(choices))
            )
        if kind == "structural_tag":
            return self.compiler.compile_structural_tag(spec.spec)
        raise GrammarError(f"unknown grammar kind {kind!r}")

    def request_grammar(self, spec: GrammarSpec) -> RequestGrammar:
        matcher = self._xgr.GrammarMatcher(
            self.compile(spec), override_stop_tokens=self.stop_token_ids
        )
        return RequestGrammar(matcher)

    def accept(self, grammars: list[RequestGrammar], owed: list[list[int]]) -> None:
        """Give each grammar its owed tokens, in order. One call per token:
        xgrammar's batched accept is no faster (it advances the matchers one
        after the other) and may let go of the GIL between them, where a
        thread that takes it holds the loop up for a switch interval."""
        for g, toks in zip(grammars, owed):
            for tok in toks:
                g.accepted(g.matcher.accept_token(tok), tok)

    def fill(self, grammars: list[RequestGrammar], bitmask: torch.Tensor) -> None:
        """Row ``k`` of ``bitmask`` ([len(grammars), ceil(V / 32)] int32 on the
        host): the tokens ``grammars[k]`` allows next, filled by xgrammar's
        threads for all rows at once."""
        live = [k for k, g in enumerate(grammars) if not g.matcher.is_terminated()]
        if len(live) < len(grammars):
            # Ended (its stop token is out): the request ends with this step,
            # whose token is dropped.
            bitmask.fill_(-1)
        if live:
            # Through numpy's view of the same memory: torch hands a pinned
            # tensor to DLPack as CUDA host memory, which xgrammar may refuse.
            self._batch.batch_fill_next_token_bitmask(
                [grammars[k].matcher for k in live], bitmask.numpy(), live
            )


def _json(text: str, kind: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise GrammarError(f"invalid {kind}: not JSON ({e})") from None


def _short(e: Exception, limit: int = 500) -> str:
    # xgrammar prefixes its messages with a timestamp and a C++ source location.
    text = str(e).strip()
    if text.startswith("[") and ": " in text:
        parts = text.split(": ", 1)
        if ".cc:" in parts[0]:
            text = parts[1]
    return text[:limit]


class RequestGrammar:
    """One request's matcher; ``num_accepted`` output tokens are in it."""

    __slots__ = ("matcher", "num_accepted", "rejected")

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.num_accepted = 0
        self.rejected = False

    def owed(
        self, fill_ids: Sequence[int], start: int, upto: int, in_flight: int | None
    ) -> list[int]:
        """The output tokens it has yet to accept up to index ``upto``
        (excluded): output token ``i`` is ``fill_ids[start + i]``, and past the
        end of ``fill_ids`` the token still ``in_flight``."""
        owed = list(fill_ids[start + self.num_accepted : start + upto])
        if len(owed) < upto - self.num_accepted:
            assert in_flight is not None, "a token the mask depends on is unknown"
            # At most one token is in flight (the overlap loop runs one step ahead).
            owed.append(in_flight)
        assert len(owed) == max(0, upto - self.num_accepted)
        return owed

    def accepted(self, ok: bool, tok: int) -> None:
        """Count a token the matcher was given (``ok``: it fit)."""
        if not ok and not self.rejected:
            # Only a token sampled without this mask can get here (a worker of
            # another version, a bug): the matcher stays where it was, and
            # later masks follow the grammar from there.
            self.rejected = True
            log.warning("token %d does not fit the request's grammar", tok)
        self.num_accepted += 1


class MaskBuffer:
    """Host memory for the mask of a step: int32, the grammar rows' indices in
    the batch and then their bitmask (``[rows, ceil(V / 32)]``, xgrammar's
    layout), copied to the device in one go. For a GPU it is pinned and there
    are two, used in turn: the host fills one while the other's copy may still
    be queued; an event recorded after each copy guards the reuse. The copy
    runs on a stream of its own, so it overlaps the forward in flight instead
    of waiting behind it; the logits' stream waits for it before the mask."""

    def __init__(self, words: int) -> None:
        self.words = words
        self._host: list[torch.Tensor] = [torch.empty(0, dtype=torch.int32)] * 2
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._pinned = False
        self._next = 0
        self._stream: torch.cuda.Stream | None = None

    def take(self, rows: int, pinned: bool) -> tuple[int, torch.Tensor]:
        """A buffer (its slot and its tensor) for ``rows`` rows that no queued
        copy still reads."""
        if pinned != self._pinned:
            self._host = [torch.empty(0, dtype=torch.int32)] * 2
            self._pinned = pinned
        need = rows * (1 + self.words)
        slot = self._next
        self._next ^= 1
        event = self._copied[slot]
        if event is not None:
            event.synchronize()
            self._copied[slot] = None
        host = self._host[slot]
        if host.numel() < need:
            host = torch.empty(max(need, 2 * host.numel()), dtype=torch.int32, pin_memory=pinned)
            self._host[slot] = host
        return slot, host[:need]

    def to_device(self, slot: int, packed: torch.Tensor, device: torch.device) -> torch.Tensor:
        if device.type != "cuda":
            return packed.to(device)
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device)
        main = torch.cuda.current_stream(device)
        with torch.cuda.stream(self._stream):
            out = packed.to(device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        main.wait_event(event)
        # Allocated for the copy's stream, read on the logits' stream.
        out.record_stream(main)
        self._copied[slot] = event
        return out


class GrammarStep:
    """The logits mask of one batch: rows ``rows`` of its sampled requests have
    grammars. Called (by the sampler) with the logits of the batch, once their
    forward is queued: the host accepts the tokens and fills the bitmask of
    all rows in one call into xgrammar while the device runs it."""

    def __init__(
        self,
        backend: GrammarBackend,
        requests: list[Request],
        rows: list[int],
        in_flight: list[int | None],
        in_flight_out: ForwardOutput | None,
    ) -> None:
        self.backend = backend
        self.requests = requests
        self.rows = rows
        self.in_flight = in_flight
        self.in_flight_out = in_flight_out

    @classmethod
    def for_batch(
        cls,
        backend: GrammarBackend,
        sample_requests: list[Request],
        in_flight_requests: list[Request] | None,
        in_flight_out: ForwardOutput | None,
    ) -> GrammarStep | None:
        """The mask of a batch that samples ``sample_requests`` (None: no
        grammar among them), launched while the batch that sampled
        ``in_flight_requests`` into ``in_flight_out`` may still run."""
        rows = [i for i, r in enumerate(sample_requests) if r.grammar is not None]
        if not rows:
            return None
        requests = [sample_requests[i] for i in rows]
        src: dict[int, int] = {}
        if in_flight_requests:
            src = {id(r): i for i, r in enumerate(in_flight_requests)}
        # A request whose previous token is still in flight was sampled by
        # that batch (at most one token ahead of its output).
        in_flight = [src.get(id(r)) if r.pending > 1 else None for r in requests]
        return cls(backend, requests, rows, in_flight, in_flight_out)

    def __call__(self, logits: torch.Tensor) -> None:
        backend, times = self.backend, self.backend.times
        t0 = time.perf_counter()
        tokens: list[int] = []
        if any(i is not None for i in self.in_flight):
            assert self.in_flight_out is not None
            tokens = self.in_flight_out.to_host().token_ids
        t1 = time.perf_counter()
        grammars: list[RequestGrammar] = []
        owed: list[list[int]] = []
        for req, src in zip(self.requests, self.in_flight):
            grammar = req.grammar
            assert grammar is not None
            # The token being sampled has index num_output + pending - 1 (the
            # scheduler counted it as pending when it built this batch).
            upto = req.num_output + req.pending - 1
            flying = tokens[src] if src is not None else None
            grammars.append(grammar)
            owed.append(grammar.owed(req.fill_ids, len(req.prompt_ids), upto, flying))
        backend.accept(grammars, owed)
        device = logits.device
        n = len(self.rows)
        slot, packed = backend.mask_buffer.take(n, device.type == "cuda")
        packed[:n] = torch.tensor(self.rows, dtype=torch.int32)
        backend.fill(grammars, packed[n:].view(n, backend.mask_buffer.words))
        t2 = time.perf_counter()
        on_device = backend.mask_buffer.to_device(slot, packed, device)
        t3 = time.perf_counter()
        apply_packed_bitmask(logits, on_device, n)
        t4 = time.perf_counter()
        times.steps += 1
        times.wait += t1 - t0
        times.fill += t2 - t1
        times.copy += t3 - t2
        times.apply += t4 - t3


def apply_packed_bitmask(logits: torch.Tensor, packed: torch.Tensor, rows: int) -> None:
    """``apply_token_bitmask`` of a ``MaskBuffer``'s layout (``rows`` indices,
    then their bitmask) on the logits' device: one kernel on CUDA, one bit
    unpacking (numpy's) and a fill per row on the CPU."""
    if logits.is_cuda and _cuda_mask() is not None:
        _cuda_mask()(logits, packed, rows)
        return
    vocab = logits.shape[-1]
    words = -(-vocab // 32)
    bitmask = packed[rows : rows * (1 + words)].view(rows, words)
    if logits.device.type != "cpu" or sys.byteorder != "little":
        apply_token_bitmask(logits, bitmask.to(logits.device), packed[:rows].long())
        return
    # Little-endian words: token t is bit t % 8 of byte t // 8.
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
    forbidden = torch.from_numpy(bits[:, :vocab] == 0)
    low = torch.finfo(logits.dtype).min
    for k, row in enumerate(packed[:rows].tolist()):
        logits[row].masked_fill_(forbidden[k], low)


def warm_up(vocab_size: int, device: torch.device) -> None:
    """Compile the CUDA mask kernel now rather than under the first grammar
    request (the float32 logits the runner samples from)."""
    if device.type != "cuda" or _cuda_mask() is None:
        return
    words = -(-vocab_size // 32)
    packed = torch.full((1 + words,), -1, dtype=torch.int32, device=device)
    packed[0] = 0
    apply_packed_bitmask(torch.zeros(1, vocab_size, device=device), packed, 1)


@functools.cache
def _cuda_mask() -> Callable[[torch.Tensor, torch.Tensor, int], None] | None:
    """The Triton mask kernel, where Triton imports."""
    if importlib.util.find_spec("triton") is None:
        return None
    from engine.grammar_triton import apply_packed_bitmask as cuda_mask

    return cuda_mask


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None
) -> None:
    """Set, in place, the logits of the tokens whose bit in ``bitmask`` is 0 to
    the lowest finite value of their dtype (a finite value keeps the reported
    logprobs valid JSON; no sampler ever picks it while one token is allowed).

    ``bitmask``: ``[R, ceil(V / 32)]`` int32, bit ``t % 32`` of word ``t // 32``
    set when token ``t`` is allowed (xgrammar's layout); ``rows``: the rows of
    ``logits`` it covers (None: all, in order)."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()
    low = torch.finfo(logits.dtype).min
    if rows is None:
        logits.masked_fill_(~allowed, low)
        return
    logits[rows] = logits[rows].masked_fill(~allowed, low)
