"""Decode step time of the engine's overlap loop with grammar-constrained rows.

The same batch runs twice: every request free, then ``--json-schema-fraction``
of them under a JSON schema (the rest unchanged). Reported: the mean and
median host-inclusive time of an overlapped decode step while the whole batch
decodes, and the ratio of the two runs::

    python benchmarks/bench_grammar.py --model llama-3.1-8b --device cuda:0 \
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
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import git_commit, host_info  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.grammar import GrammarBackend  # noqa: E402
from protocol.sampling import GrammarSpec, SamplingParams  # noqa: E402


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


def grammar_backend(engine: Engine, tokenizer: str | None) -> tuple[GrammarBackend, str]:
    mc = engine.model_config
    if tokenizer is None and (Path(engine.config.model) / "tokenizer.json").exists():
        tokenizer = engine.config.model
    if tokenizer is not None:
        return GrammarBackend.for_model(tokenizer, mc.vocab_size, mc.eos_token_ids), tokenizer
    import xgrammar as xgr

    stops = list(mc.eos_token_ids)
    info = xgr.TokenizerInfo(
        synthetic_vocab(mc.vocab_size, stops),
        xgr.VocabType.RAW,
        vocab_size=mc.vocab_size,
        stop_token_ids=stops,
    )
    return GrammarBackend(info, stops), "synthetic"


def run(engine: Engine, args: argparse.Namespace, n_grammar: int, spec: GrammarSpec) -> dict:
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
    steps = 0
    finished = 0
    while engine.has_unfinished() or inflight is not None:
        t0 = time.perf_counter()
        inflight, results = engine.overlap_step(inflight)
        dt = time.perf_counter() - t0
        finished += sum(r.finish_reason is not None for r in results)
        steps += 1
        if args.warmup_steps < steps <= args.warmup_steps + args.decode_steps and not finished:
            times.append(dt)
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
    }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint dir or preset (default: tiny)")
    ap.add_argument("--tokenizer", default=None, help="HF tokenizer dir for the grammar")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    ap.add_argument("--cuda-graph-max-bs", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--json-schema-fraction", type=float, default=0.5)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=32, help="timed decode steps")
    ap.add_argument("--warmup-steps", type=int, default=8)
    ap.add_argument("--min-items", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--output-file", default=None)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
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
    backend, tokenizer = grammar_backend(engine, args.tokenizer)
    engine._grammars = backend
    spec = GrammarSpec("json_schema", json.dumps(schema(args.min_items)))
    t0 = time.perf_counter()
    backend.compile(spec)
    compile_s = time.perf_counter() - t0
    n_grammar = round(args.batch_size * args.json_schema_fraction)
    # The free run twice: the first one warms the graphs and caches up.
    run(engine, args, 0, spec)
    free = run(engine, args, 0, spec)
    constrained = run(engine, args, n_grammar, spec)
    ratio = constrained["step_ms_mean"] / free["step_ms_mean"]
    record = {
        "benchmark": "bench_grammar",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "argv": sys.argv[1:],
        "model": args.model or "tiny",
        "tokenizer": tokenizer,
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "compile_s": compile_s,
        "free": free,
        "json_schema": constrained,
        "step_time_ratio": ratio,
        "machine": host_info(),
    }
    if args.device.startswith("cuda"):
        record["machine"]["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    print(
        f"batch {args.batch_size}: free {free['step_ms_mean']:.2f} ms/step, "
        f"{n_grammar} rows with a json_schema {constrained['step_ms_mean']:.2f} ms/step "
        f"(x{ratio:.3f}); schema compiled in {compile_s * 1e3:.1f} ms"
    )
    out = args.output_file or str(
        Path(__file__).resolve().parent
        / "results"
        / f"grammar-{Path(str(args.model or 'tiny')).name}-{datetime.now(UTC):%Y%m%d-%H%M%S}.json"
    )
    Path(out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
