"""Engine micro-benchmark: prefill throughput and decode step time.

    python -m benchmarks.bench_engine --model llama-3.1-8b --device cuda:0 \
        --batch-sizes 1 8 32 --input-len 512 --decode-steps 32

A decode step is timed as a serving loop's step without overlap: the batch
built, the forward (a CUDA graph's replay where one runs the batch), the
sampling, the tokens copied back. Where a graph runs it, the replay alone is
timed too (``graph_replay_ms``: the device's part of the step).

``--prefetch-bytes`` runs the batch sizes once for each value given (values
may repeat, to alternate them), the decode graphs captured again with
``engine.layers.pdl.PREFETCH_BYTES`` set to it: the products' L2 weight
prefetch before their PDL wait, off by default; each row records its value.

``--model`` is a checkpoint dir or a preset name (presets use dummy weights).
``--hf`` then times HF transformers' own model of the same config in the same
run (random weights, batch 1: a forward of ``--input-len`` tokens, and greedy
``generate`` per new token), after this engine's model is freed. Prints a
table and writes a JSON record to ``--output-file``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import KERNEL_SETTINGS, add_engine_flag, machine, write_record
from engine.config import EngineConfig, resolve_device
from engine.forward_batch import ExtendSpec, ForwardBatch, build_forward_batch
from engine.layers import pdl
from engine.model_config import ModelConfig
from engine.presets import PRESETS
from engine.runner import ModelRunner
from engine.sampling import SamplingBatch
from protocol.sampling import SamplingParams


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


def graph_replay_ms(runner: ModelRunner, batch: ForwardBatch, reps: int = 20) -> float | None:
    """Device ms of one replay of the decode graph that runs ``batch``, timed
    over ``reps`` replays back to back (its inputs copied in and its attention
    planned once, before): the step without the host's part. None where no
    graph runs it."""
    graphs = runner.graphs
    rows = graphs.as_decode_rows(batch) if graphs is not None else None
    if rows is None:
        return None
    with torch.inference_mode():
        graph, _ = graphs.prepare(rows)
        graph.replay()  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
    return start.elapsed_time(end) / reps


def bench_one(runner: ModelRunner, batch_size: int, args: argparse.Namespace) -> dict:
    ps = runner.pool.page_size
    vocab = runner.model_config.vocab_size
    gen = torch.Generator().manual_seed(batch_size)
    total = args.input_len + args.decode_steps + 1
    tables = []
    for _ in range(batch_size):
        pages = runner.pool.allocator.alloc(-(-total // ps))
        if pages is None:
            raise SystemExit(
                f"KV pool too small for batch {batch_size}; raise --kv-cache-memory-gb"
            )
        tables.append(pages)
    prompts = [torch.randint(3, vocab, (args.input_len,), generator=gen).tolist() for _ in tables]

    # Prefill: the whole batch's prompts, split into forwards of at most
    # --prefill-tokens tokens (whole prompts per forward).
    per_fwd = max(1, args.prefill_tokens // args.input_len)
    groups = [list(range(i, min(i + per_fwd, batch_size))) for i in range(0, batch_size, per_fwd)]

    def prefill() -> None:
        for g in groups:
            specs = [ExtendSpec(prompts[i], 0, tables[i]) for i in g]
            runner.forward_logits(build_forward_batch(specs, ps, runner.device))

    prefill()  # warm-up
    sync(args.device)
    t0 = time.perf_counter()
    prefill()
    sync(args.device)
    prefill_s = time.perf_counter() - t0

    params = [SamplingParams(temperature=0.0)] * batch_size
    tokens = [p[-1] for p in prompts]
    step_times = []
    for step in range(args.decode_steps + 1):
        pos = args.input_len + step
        specs = [ExtendSpec([tokens[i]], pos, tables[i]) for i in range(batch_size)]
        sampling = SamplingBatch.build(
            params, [0] * batch_size, [step] * batch_size, vocab, runner.device
        )
        sync(args.device)
        t0 = time.perf_counter()
        fb = build_forward_batch(specs, ps, runner.device)
        out = runner.forward(fb, sampling)
        tokens = out.token_ids.tolist()
        step_times.append(time.perf_counter() - t0)
    step_times = step_times[1:]  # first step is warm-up
    replay = graph_replay_ms(runner, build_forward_batch(specs, ps, runner.device))
    for t in tables:
        runner.pool.allocator.free(t)
    step_ms = statistics.median(step_times) * 1e3
    return {
        "graph_replay_ms": replay,
        "batch_size": batch_size,
        "input_len": args.input_len,
        "prefill_tokens_per_s": batch_size * args.input_len / prefill_s,
        "prefill_s": prefill_s,
        "decode_step_ms_median": step_ms,
        "decode_step_ms_mean": statistics.mean(step_times) * 1e3,
        "decode_tokens_per_s": batch_size / (step_ms / 1e3),
    }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_engine",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--model",
        default=None,
        help=f"checkpoint dir or preset ({', '.join(PRESETS)}); default: the built-in tiny model",
    )
    ap.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "dummy"],
        help="dummy = random weights (implied for presets)",
    )
    ap.add_argument("--device", default="auto", help="torch device (default: %(default)s)")
    ap.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    ap.add_argument("--attention-backend", default="auto", help="auto, flashinfer or torch_native")
    ap.add_argument(
        "--cuda-graph-max-bs",
        type=int,
        default=None,
        help="largest decode batch run as a CUDA graph; 0 disables (default: auto)",
    )
    for setting in KERNEL_SETTINGS:
        add_engine_flag(ap, setting)
    ap.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    ap.add_argument("--kv-cache-memory-gb", type=float, default=4.0, help="KV pool size")
    ap.add_argument(
        "--batch-sizes", type=int, nargs="+", default=[1, 8, 32], help="decode batch sizes"
    )
    ap.add_argument("--input-len", type=int, default=512, help="prompt tokens per request")
    ap.add_argument("--decode-steps", type=int, default=16, help="timed decode steps")
    ap.add_argument(
        "--prefill-tokens",
        type=int,
        default=8192,
        help="largest number of prompt tokens per forward",
    )
    ap.add_argument(
        "--output-file",
        default=None,
        help="JSON file to write (default: benchmarks/results/engine-<model>-<date>.json)",
    )
    ap.add_argument(
        "--prefetch-bytes",
        type=int,
        nargs="+",
        default=None,
        help="L2 weight prefetch budgets to compare, each with its own decode graphs "
        "(default: the engine's, once)",
    )
    ap.add_argument(
        "--hf",
        action="store_true",
        help="also time HF transformers' model of the same config (batch 1), for the ratio",
    )
    return ap


def bench_hf(model: str, mc: ModelConfig, args: argparse.Namespace) -> dict:
    """HF transformers' model of ``model``'s config: prefill of
    ``--input-len`` tokens and greedy decode per token, batch 1."""
    import transformers

    raw = PRESETS.get(model)
    if raw is None:
        hf_cfg = transformers.AutoConfig.from_pretrained(model)
    else:
        cls = getattr(transformers, mc.architecture)
        hf_cfg = cls.config_class(**raw)
    with torch.device(args.device):
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=mc.dtype).eval()
    ids = torch.randint(3, mc.vocab_size, (1, args.input_len), device=args.device)
    with torch.inference_mode():
        hf(ids)  # warm-up
        sync(args.device)
        t0 = time.perf_counter()
        hf(ids)
        sync(args.device)
        prefill_s = time.perf_counter() - t0

        def generate(n: int) -> float:
            sync(args.device)
            t = time.perf_counter()
            hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
            sync(args.device)
            return time.perf_counter() - t

        generate(2)  # warm-up
        one, many = generate(1), generate(1 + args.decode_steps)
    return {
        "batch_size": 1,
        "input_len": args.input_len,
        "prefill_s": prefill_s,
        "prefill_tokens_per_s": args.input_len / prefill_s,
        "decode_ms_per_token": (many - one) / args.decode_steps * 1e3,
        "transformers": transformers.__version__,
    }


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    model = args.model
    if model is None:
        from engine.tiny import ensure_tiny_model

        model = str(ensure_tiny_model())
    args.device = resolve_device(args.device)
    load_format = "dummy" if model in PRESETS else args.load_format
    dtype = args.dtype
    if dtype == "auto" and not args.device.startswith("cuda"):
        dtype = "float32"
    cfg = EngineConfig(
        model=model,
        load_format=load_format,
        dtype=dtype,
        device=args.device,
        page_size=args.page_size,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        attention_backend=args.attention_backend,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        **{name: getattr(args, name) for name in KERNEL_SETTINGS},
    )
    mc = ModelConfig.load(model, cfg.torch_dtype)
    cfg = cfg.resolve(mc)
    t0 = time.perf_counter()
    runner = ModelRunner(cfg, mc)
    load_s = time.perf_counter() - t0

    runner_quantization = runner.model_config.quantization
    rows = []
    for budget in args.prefetch_bytes or [None]:
        if budget is not None:
            if runner.graphs is None:
                raise SystemExit("--prefetch-bytes compares decode graphs; none are captured")
            pdl.PREFETCH_BYTES = budget
            runner.capture_decode_graphs()
        for b in args.batch_sizes:
            rows.append({**bench_one(runner, b, args), "prefetch_bytes": pdl.PREFETCH_BYTES})
    print(
        f"model={model} dtype={mc.dtype} device={args.device} backend={cfg.attention_backend} "
        f"cuda_graph_max_bs={cfg.cuda_graph_max_bs} "
        f"page_size={cfg.page_size} load={load_s:.1f}s"
    )
    print(
        f"{'batch':>6} {'input':>6} {'prefill tok/s':>14} {'decode ms/step':>15} "
        f"{'graph replay ms':>16} {'decode tok/s':>13} {'prefetch':>9}"
    )
    for r in rows:
        replay = r["graph_replay_ms"]
        print(
            f"{r['batch_size']:>6} {r['input_len']:>6} {r['prefill_tokens_per_s']:>14.0f} "
            f"{r['decode_step_ms_median']:>15.2f} {'-' if replay is None else f'{replay:.2f}':>16} "
            f"{r['decode_tokens_per_s']:>13.0f} {r['prefetch_bytes']:>9}"
        )
    hf_row = None
    if args.hf:
        del runner
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        hf_row = bench_hf(model, mc, args)
        ours = next((r for r in rows if r["batch_size"] == 1), None)
        print(
            f"HF transformers {hf_row['transformers']}: prefill {hf_row['input_len']} tokens "
            f"{hf_row['prefill_s'] * 1e3:.1f} ms, decode {hf_row['decode_ms_per_token']:.2f} ms/token"
            + (
                f" ({hf_row['decode_ms_per_token'] / ours['decode_step_ms_median']:.1f}x ours)"
                if ours
                else ""
            )
        )
    name = Path(model).name if Path(model).exists() else model
    body = {
        "model": name,
        "dtype": str(mc.dtype).removeprefix("torch."),
        "device": args.device,
        "attention_backend": cfg.attention_backend,
        "cuda_graph_max_bs": cfg.cuda_graph_max_bs,
        "page_size": cfg.page_size,
        "quantization": runner_quantization,
        "kv_cache_dtype": cfg.kv_cache_dtype,
        "fuse_rope_kv_write": cfg.fuse_rope_kv_write,
        "decode_kernel": cfg.decode_kernel,
        "fresh_prefill_graphs": cfg.fresh_prefill_graphs,
        "results": rows,
        "hf_transformers": hf_row,
    }
    stem = f"engine-{name.replace('/', '_')}"
    write_record(
        "benchmarks.bench_engine", argv, body, args.output_file, stem, machine(args.device)
    )


if __name__ == "__main__":
    main()
