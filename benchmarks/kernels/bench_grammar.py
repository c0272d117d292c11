"""Decode step time of the engine's overlap loop with grammar-constrained rows.

The same batch runs twice: every request free, then ``--json-schema-fraction``
of them under a JSON schema (the rest unchanged). Reported: the mean and
median host-inclusive time of an overlapped decode step while the whole batch
decodes, and the ratio of the two runs::

    python -m benchmarks.kernels.bench_grammar --model llama-3.1-8b --device cuda:0 \
        --batch-size 64 --json-schema-fraction 0.5 --input-len 512 --decode-steps 64 \
        --kv-cache-memory-gb 40 --cuda-graph-max-bs 64

``--model`` is a checkpoint dir or a preset (dummy weights). The grammar needs
a tokenizer: the checkpoint's, ``--tokenizer DIR`` (HF tokenizer files, e.g.
the real Llama-3.1 tokenizer next to dummy weights), or else a synthetic one
of the model's vocabulary size (bytes, JSON punctuation, words, numbers: the
mask work scales with the vocabulary like a real one's, but a real tokenizer
is the faithful measurement). The schema is an array of at least
``--min-items`` small objects, so no row can complete it (and leave the batch)
within the timed steps. Writes a JSON record to ``--output-file``.

Each run also reports where the host's time per step goes: ``launch``
(schedule step N+1, queue its forward and sampling, the grammar mask
included), ``finish`` (process step N's tokens), ``device_wait`` (the part of
both spent waiting for sampled tokens to reach the host: near 0 means the
loop is host-bound), and the grammar's own parts inside ``launch``: ``wait``
for step N's tokens, ``fill`` (accept tokens, fill the bitmask), ``copy`` (the
bitmask to the device) and ``apply`` (queue the mask on the logits).

``--mask-only`` times the grammar mask alone, without a model: the batch's
grammar rows under the schema over a synthetic vocabulary of ``--vocab-size``
(each row takes an allowed token of its mask per step), the same host parts
per step, on the CPU or on ``--device``::

    python -m benchmarks.kernels.bench_grammar --mask-only --batch-size 64 \
        --json-schema-fraction 0.5
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import machine, write_record
from engine.config import EngineConfig
from engine.engine import Engine
from engine.grammar import GrammarBackend
from engine.runner import ForwardOutput
from protocol.sampling import GrammarSpec, SamplingParams

TOOL = "benchmarks.kernels.bench_grammar"


def schema(min_items: int) -> dict[str, Any]:
    item = {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "name": {"type": "string", "maxLength": 24},
            "kind": {"enum": ["alpha", "beta", "gamma"]},
            "score": {"type": "number"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        },
        "required": ["id", "name", "kind", "score", "tags"],
    }
    return {
        "type": "object",
        "properties": {"items": {"type": "array", "items": item, "minItems": min_items}},
        "required": ["items"],
    }


def synthetic_vocab(size: int, stop_ids: list[int]) -> list[bytes]:
    """Byte tokens, JSON punctuation runs, words with and without a leading
    space, numbers: the shapes of a BPE vocabulary, deterministically."""
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    punct = ['{"', '"}', '":', '",', '": "', '", "', "},", "],", "[{", "}]", ' "', '":"', "\\n"]
    vocab: list[bytes] = [bytes([b]) for b in range(256)]
    seen = set(vocab)
    while len(vocab) < size:
        r = rng.random()
        if r < 0.05:
            tok = rng.choice(punct) + rng.choice(["", " ", '"', "{", "["])
        elif r < 0.15:
            tok = str(rng.randrange(10 ** rng.randrange(1, 4)))
        else:
            word = "".join(rng.choice(letters) for _ in range(rng.randrange(2, 10)))
            tok = (" " if rng.random() < 0.5 else "") + word
        b = tok.encode()
        if b not in seen:
            seen.add(b)
            vocab.append(b)
    for i in stop_ids:
        if i < size:
            vocab[i] = f"<|stop{i}|>".encode()
    return vocab


def grammar_backend(
    engine: Engine, tokenizer: str | None, fill_threads: int | None
) -> tuple[GrammarBackend, str]:
    mc = engine.model_config
    if tokenizer is None and (Path(engine.config.model) / "tokenizer.json").exists():
        tokenizer = engine.config.model
    if tokenizer is not None:
        backend = GrammarBackend.for_model(
            tokenizer, mc.vocab_size, mc.eos_token_ids, fill_threads=fill_threads
        )
        return backend, tokenizer
    import xgrammar as xgr

    stops = list(mc.eos_token_ids)
    info = xgr.TokenizerInfo(
        synthetic_vocab(mc.vocab_size, stops),
        xgr.VocabType.RAW,
        vocab_size=mc.vocab_size,
        stop_token_ids=stops,
    )
    return GrammarBackend(info, stops, fill_threads=fill_threads), "synthetic"


class HostClock:
    """Host seconds spent in the engine's launch, finish and device waits,
    summed since the clock was made (wrapping the engine's own methods)."""

    def __init__(self, engine: Engine) -> None:
        self.totals = {"launch": 0.0, "finish": 0.0, "device_wait": 0.0}
        engine.launch = self._timed(engine.launch, "launch")  # type: ignore[method-assign]
        engine.finish = self._timed(engine.finish, "finish")  # type: ignore[method-assign]
        clock = self
        to_host = ForwardOutput.to_host

        def timed_to_host(out: ForwardOutput) -> Any:
            t0 = time.perf_counter()
            try:
                return to_host(out)
            finally:
                clock.totals["device_wait"] += time.perf_counter() - t0

        ForwardOutput.to_host = timed_to_host  # type: ignore[method-assign]

    def _timed(self, fn: Any, key: str) -> Any:
        @functools.wraps(fn)
        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.totals[key] += time.perf_counter() - t0

        return timed

    def snapshot(self, backend: GrammarBackend) -> dict[str, float]:
        grammar = backend.times.snapshot()
        return {**self.totals, **{f"grammar_{k}": v for k, v in grammar.items()}}


def host_breakdown(parts: list[dict[str, float]]) -> dict[str, float]:
    """Mean host ms per timed step of each part (``parts``: per-step deltas)."""
    keys = [k for k in parts[0] if k != "grammar_steps"]
    out = {k: 1e3 * statistics.mean(p[k] for p in parts) for k in keys}
    out["grammar_steps_per_step"] = statistics.mean(p["grammar_steps"] for p in parts)
    return out


def run(
    engine: Engine,
    args: argparse.Namespace,
    n_grammar: int,
    spec: GrammarSpec,
    clock: HostClock,
    backend: GrammarBackend,
) -> dict:
    """Time the decode steps of one batch, ``n_grammar`` of its rows under ``spec``."""
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    # Early requests decode while later ones still prefill: only the context
    # bounds them (the timed steps end with an abort).
    max_tokens = engine.context_length - args.input_len - 1
    for i in range(args.batch_size):
        prompt = torch.randint(3, vocab, (args.input_len,), generator=gen).tolist()
        grammar = spec if i % args.batch_size < n_grammar else None
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=args.temperature,
            seed=i,
            ignore_eos=grammar is None,
            grammar=grammar,
        )
        engine.add_request(f"r{i}", prompt, params)
    inflight = None
    # Prefill everything first: the timed steps are decode steps of the whole batch.
    while engine.scheduler.waiting or any(r.remaining > 1 for r in engine.scheduler.running):
        inflight, _ = engine.overlap_step(inflight)
    times: list[float] = []
    parts: list[dict[str, float]] = []
    steps = 0
    finished = 0
    while engine.has_unfinished() or inflight is not None:
        before = clock.snapshot(backend)
        t0 = time.perf_counter()
        inflight, results = engine.overlap_step(inflight)
        dt = time.perf_counter() - t0
        after = clock.snapshot(backend)
        finished += sum(r.finish_reason is not None for r in results)
        steps += 1
        if args.warmup_steps < steps <= args.warmup_steps + args.decode_steps and not finished:
            times.append(dt)
            parts.append({k: after[k] - before[k] for k in after})
        if steps >= args.warmup_steps + args.decode_steps:
            for r in list(engine.scheduler.running):
                engine.abort(r.rid)
    while inflight is not None:
        inflight, _ = engine.overlap_step(inflight)
    for i in range(args.batch_size):
        engine.forget(f"r{i}")
    if not times:
        raise SystemExit("a request finished before the timed steps; raise --min-items")
    return {
        "grammar_rows": n_grammar,
        "timed_steps": len(times),
        "step_ms_mean": 1e3 * statistics.mean(times),
        "step_ms_median": 1e3 * statistics.median(times),
        "host_ms": host_breakdown(parts),
    }


def describe(name: str, result: dict) -> str:
    h = result["host_ms"]
    line = (
        f"  {name}: {result['step_ms_mean']:.2f} ms/step; host ms/step: launch {h['launch']:.3f}, "
        f"finish {h['finish']:.3f}, device wait {h['device_wait']:.3f}"
    )
    if h["grammar_steps_per_step"]:
        line += (
            f"; grammar (in launch): wait {h['grammar_wait']:.3f}, fill {h['grammar_fill']:.3f}, "
            f"copy {h['grammar_copy']:.3f}, apply {h['grammar_apply']:.3f}"
        )
    return line


def mask_only(args: argparse.Namespace, argv: list[str] | None) -> None:
    """Host ms per step of the grammar mask of a batch, without a model."""
    import numpy as np
    import xgrammar as xgr

    from engine.grammar import GrammarStep
    from engine.request import Request

    vocab, stops = args.vocab_size, [args.vocab_size - 1]
    info = xgr.TokenizerInfo(
        synthetic_vocab(vocab, stops), xgr.VocabType.RAW, vocab_size=vocab, stop_token_ids=stops
    )
    backend = GrammarBackend(info, stops, fill_threads=args.fill_threads)
    spec = GrammarSpec("json_schema", json.dumps(schema(args.min_items)))
    backend.compile(spec)
    n_grammar = round(args.batch_size * args.json_schema_fraction)
    reqs = []
    for i in range(args.batch_size):
        req = Request(f"r{i}", [1], SamplingParams(max_tokens=1 << 20), i, 1 << 21)
        if i < n_grammar:
            req.grammar = backend.request_grammar(spec)
        reqs.append(req)
    logits = torch.zeros(args.batch_size, vocab, device=args.device)
    # Tokens come from a fixed sample of the vocabulary where the mask allows
    # one (else from all it allows): cheap next to the mask, so the timed parts
    # run with warm caches as they would between forwards.
    cand = np.random.default_rng(0).permutation(vocab)[:4096]
    words = backend.mask_buffer.words
    parts: list[dict[str, float]] = []
    for step in range(args.warmup_steps + args.decode_steps):
        for r in reqs:
            r.pending = 1
        step_mask = GrammarStep.for_batch(backend, reqs, None, None)
        assert step_mask is not None
        before = backend.times.snapshot()
        step_mask(logits)
        if logits.is_cuda:
            torch.cuda.synchronize(logits.device)
        after = backend.times.snapshot()
        if step >= args.warmup_steps:
            parts.append({k: after[k] - before[k] for k in after})
        host = backend.mask_buffer._host[backend.mask_buffer._next ^ 1]
        bits = host[n_grammar : n_grammar * (1 + words)].view(n_grammar, words).numpy()
        for k, req in enumerate(reqs):
            tok = 0
            if k < n_grammar:
                ok = cand[((bits[k, cand >> 5] >> (cand & 31)) & 1).astype(bool)]
                if len(ok) == 0:
                    flat = np.unpackbits(bits[k].view(np.uint8), bitorder="little")[:vocab]
                    ok = np.nonzero(flat)[0]
                tok = int(ok[(step * 7919 + k) % len(ok)])
            req.pending = 0
            req.fill_ids.append(tok)
    keys = ("wait", "fill", "copy", "apply")
    body = {
        "mask_only": True,
        "batch_size": args.batch_size,
        "grammar_rows": n_grammar,
        "vocab_size": vocab,
        "device": args.device,
        "fill_threads": backend.fill_threads,
        "timed_steps": len(parts),
        "host_ms_median": {k: 1e3 * statistics.median(p[k] for p in parts) for k in keys},
        "host_ms_mean": {k: 1e3 * statistics.mean(p[k] for p in parts) for k in keys},
    }
    med = body["host_ms_median"]
    print(
        f"mask of {n_grammar} rows of {args.batch_size}, vocab {vocab}, {backend.fill_threads} "
        f"fill threads, host ms/step (median): "
        + ", ".join(f"{k} {med[k]:.3f}" for k in keys)
        + f"; total {sum(med.values()):.3f}"
    )
    write_record(TOOL, argv, body, args.output_file, "grammar-mask", machine(args.device))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=f"python -m {TOOL}",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument("--model", default=None, help="checkpoint dir or preset (default: tiny)")
    ap.add_argument("--tokenizer", default=None, help="HF tokenizer dir for the grammar")
    ap.add_argument("--device", default="cpu", help="cpu or cuda:N")
    ap.add_argument("--dtype", default="auto", help="model dtype (auto: the checkpoint's)")
    ap.add_argument("--page-size", type=int, default=16, help="KV page size in tokens")
    ap.add_argument("--kv-cache-memory-gb", type=float, default=1.0, help="KV pool size")
    ap.add_argument(
        "--cuda-graph-max-bs", type=int, default=None, help="largest decode batch with a CUDA graph"
    )
    ap.add_argument("--batch-size", type=int, default=64, help="requests decoding together")
    ap.add_argument(
        "--json-schema-fraction", type=float, default=0.5, help="share of the rows with a schema"
    )
    ap.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--decode-steps", type=int, default=32, help="timed decode steps")
    ap.add_argument("--warmup-steps", type=int, default=8, help="decode steps before timing")
    ap.add_argument(
        "--min-items", type=int, default=64, help="items the schema's array needs at least"
    )
    ap.add_argument(
        "--fill-threads",
        type=int,
        default=None,
        help="xgrammar threads filling the bitmask (default: the engine's, half the cores, <= 8)",
    )
    ap.add_argument(
        "--mask-only", action="store_true", help="time the grammar mask alone, without a model"
    )
    ap.add_argument(
        "--vocab-size", type=int, default=128_256, help="synthetic vocabulary (--mask-only)"
    )
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    ap.add_argument(
        "--output-file", default=None, help="record path (default: results/grammar-MODEL-DATE.json)"
    )
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.mask_only:
        mask_only(args, argv)
        return
    model = args.model
    if model is None:
        from engine.tiny import ensure_tiny_model

        model = str(ensure_tiny_model())
    cfg = EngineConfig(
        model=model,
        load_format="auto" if Path(model).exists() else "dummy",
        dtype=args.dtype,
        device=args.device,
        page_size=args.page_size,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        max_running_requests=max(args.batch_size, 1),
    )
    engine = Engine(cfg)
    backend, tokenizer = grammar_backend(engine, args.tokenizer, args.fill_threads)
    engine._grammars = backend
    spec = GrammarSpec("json_schema", json.dumps(schema(args.min_items)))
    t0 = time.perf_counter()
    backend.compile(spec)
    compile_s = time.perf_counter() - t0
    n_grammar = round(args.batch_size * args.json_schema_fraction)
    clock = HostClock(engine)
    # The free run twice: the first one warms the graphs and caches up.
    run(engine, args, 0, spec, clock, backend)
    free = run(engine, args, 0, spec, clock, backend)
    constrained = run(engine, args, n_grammar, spec, clock, backend)
    ratio = constrained["step_ms_mean"] / free["step_ms_mean"]
    body = {
        "model": args.model or "tiny",
        "tokenizer": tokenizer,
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "compile_s": compile_s,
        "fill_threads": getattr(backend, "fill_threads", None),
        "free": free,
        "json_schema": constrained,
        "step_time_ratio": ratio,
    }
    print(
        f"batch {args.batch_size}: free {free['step_ms_mean']:.2f} ms/step, "
        f"{n_grammar} rows with a json_schema {constrained['step_ms_mean']:.2f} ms/step "
        f"(x{ratio:.3f}); schema compiled in {compile_s * 1e3:.1f} ms"
    )
    print(describe("free", free))
    print(describe("json_schema", constrained))
    stem = f"grammar-{Path(str(args.model or 'tiny')).name}"
    write_record(TOOL, argv, body, args.output_file, stem, machine(args.device))


if __name__ == "__main__":
    main()
