"""Disaggregated vs colocated serving on the same hardware, with one workload.

Runs ``benchmarks.bench_serving`` against (a) one ``python -m prefill_server`` worker
plus one ``python -m decode_server`` worker behind ``python -m gateway
--prefill URL --decode URL``, then (b) one ``python -m decode_server --role
both`` worker behind ``python -m gateway --decode URL``; prints both results
side by side and appends both JSON records (labels "pd" and "colocated") to
``--output-file``. Everything after ``--`` goes to ``benchmarks.bench_serving``::

    python -m benchmarks.compare_pd --dummy-preset llama-3.1-8b \\
        --prefill-device cuda:0 --decode-device cuda:1 --colocated-device cuda:0 cuda:1 \\
        --transfer-backend nixl --kv-cache-memory-gb 40 -- \\
        --random-input-len 2048 --random-output-len 256 --num-prompts 200 \\
        --request-rate 4 --ignore-eos

With a goodput sweep among the benchmark's options (``--slo ttft=500,tpot=30
--sweep-max-concurrency 8 16 32 64 128 256``, or ``--sweep-request-rates``),
each deployment runs the whole sweep and the table gives, side by side, the
highest point that held the objectives, what it gave, and the first that broke.

Each deployment's processes are stopped (SIGTERM, then SIGKILL after a
timeout) before the next one starts, also on errors and Ctrl-C; their logs'
tails are printed when one of them fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import secrets
import shlex
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks import bench_serving
from engine.config import LOAD_FORMATS, EngineConfig
from engine.dummy_model import write_dummy_model
from engine.presets import PRESETS
from harness.cluster import Gateway, Worker
from harness.loadgen import FIRST_TOKEN_ID
from harness.procs import Proc, running, start_all
from kvtransfer import TRANSFER_BACKENDS
from worker.config import CLUSTER_TOKEN_ENV, WorkerConfig

ENGINE_DEFAULTS = EngineConfig()
LABELS = {"pd": "disaggregated", "colocated": "colocated"}


def print_logs(procs: list[Proc]) -> None:
    for p in procs:
        state = "running" if p.alive else f"exited with {p.proc and p.proc.returncode}"
        print(f"----- {p.name} ({state}), {p.log_path} -----", file=sys.stderr)
        print(p.log_tail(40), file=sys.stderr)


def worker(
    name: str, role: str, device: str, args: argparse.Namespace, model: str | None, log_dir: Path
) -> tuple[str, Worker]:
    """(``role``, the worker) of a deployment, not started."""
    # A colocated worker moves no KV: it keeps the default backend.
    transfer = {} if role == "both" else {"transfer_backend": args.transfer_backend}
    return role, Worker.make(
        name,
        role,
        log_dir,
        model=model,
        flags=shlex.split(args.worker_args),
        device=device,
        load_format=args.load_format,
        page_size=args.page_size,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        **transfer,
    )


def gateway_args(workers: list[tuple[str, Worker]], args: argparse.Namespace) -> list[str]:
    """``workers``: (role, worker) pairs. Colocated ("both") workers join the decode pool."""
    prefill = [w.url for role, w in workers if role == "prefill"]
    out = ["--prefill", *prefill] if prefill else []
    out += ["--decode", *(w.url for role, w in workers if role != "prefill")]
    return out + shlex.split(args.gateway_args)


@contextlib.contextmanager
def deployment(
    label: str, args: argparse.Namespace, model: str | None, log_dir: Path
) -> Iterator[str]:
    """Start the workers and gateway of ``label``; yield the gateway URL; always stop them."""
    if label == "pd":
        roles = [
            worker("pd-prefill", "prefill", args.prefill_device, args, model, log_dir),
            worker("pd-decode", "decode", args.decode_device, args, model, log_dir),
        ]
    else:
        roles = [
            worker(f"{label}-both-{i}", "both", device, args, model, log_dir)
            for i, device in enumerate(args.colocated_device)
        ]
    workers = [w for _, w in roles]
    gateway = Gateway.make(log_dir / f"{label}-gateway.log", gateway_args(roles, args))
    token = {CLUSTER_TOKEN_ENV: secrets.token_hex(16)}
    procs: list[Proc] = [gateway, *workers]  # in stop order: the gateway first
    for p in procs:
        p.env.update(token)
    with running(procs):
        try:
            start_all(workers, args.start_timeout_s)
            start_all([gateway], args.start_timeout_s)
            yield gateway.url
            if dead := [p.name for p in procs if not p.alive]:
                raise RuntimeError(f"{', '.join(dead)} exited during the benchmark")
        except KeyboardInterrupt:
            raise
        except BaseException:
            print_logs(procs)
            raise


def token_id_limit(model_dir: str | None) -> int | None:
    """Largest id bound below the model's vocab and its special ids at the top of
    it (Llama-3, Qwen), so random token-id prompts hold ordinary tokens only."""
    if model_dir is None or not (Path(model_dir) / "config.json").is_file():
        return None
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    ids = []
    for key in ("bos_token_id", "eos_token_id"):
        v = cfg.get(key)
        ids += v if isinstance(v, list) else ([] if v is None else [v])
    high = [int(i) for i in ids if int(i) > FIRST_TOKEN_ID]
    return min([int(cfg["vocab_size"]), *high])


def deployment_metadata(args: argparse.Namespace, model: str | None) -> list[str]:
    """KEY=VALUE facts shared by both deployments, for the JSON records."""
    facts = {
        "model": args.dummy_preset or model or "tiny",
        "load_format": args.load_format,
        "transfer_backend": args.transfer_backend,
        "page_size": args.page_size,
        "kv_cache_memory_gb": args.kv_cache_memory_gb,
        "worker_args": args.worker_args,
        "gateway_args": args.gateway_args,
    }
    return [f"{k}={v}" for k, v in facts.items()]


ROWS: list[tuple[str, str]] = [
    ("Successful requests", "completed"),
    ("Failed requests", "failed"),
    ("Benchmark duration (s)", "duration"),
    ("Total input tokens", "total_input_tokens"),
    ("Total generated tokens", "total_output_tokens"),
    ("Request throughput (req/s)", "request_throughput"),
    ("Request goodput (req/s)", "request_goodput"),
    ("Output token throughput (tok/s)", "output_throughput"),
    ("Total token throughput (tok/s)", "total_token_throughput"),
    *(
        (f"{stat.capitalize() if stat != 'p99' else 'P99'} {m.upper()} (ms)", f"{stat}_{m}_ms")
        for m in ("ttft", "tpot", "itl", "e2el")
        for stat in ("mean", "median", "p99")
    ),
]


def comparison_table(results: dict[str, dict[str, Any]]) -> str:
    """Key metrics as rows, one column per deployment."""
    names = [LABELS[k] for k in results]
    lines = [f"{'':<34}" + "".join(f"{n:>16}" for n in names)]
    lines.append("-" * len(lines[0]))
    for title, key in ROWS:
        cells = "".join(f"{bench_serving.format_value(r.get(key)):>16}" for r in results.values())
        lines.append(f"{title:<34}{cells}")
    return "\n".join(lines)


def goodput_table(results: dict[str, dict[str, Any]]) -> str:
    """Each deployment's goodput sweep, side by side: the highest point that
    held its objectives and what it gave, and the first that broke."""
    names = [LABELS[k] for k in results]
    sweeps = [r["sweep"] for r in results.values()]
    over = bench_serving.SWEEP_NAMES[sweeps[0]["over"]]
    objectives = ", ".join(f"p99 {k} <= {v:g} ms" for k, v in sweeps[0]["slo_ms"].items())
    lines = [f"Goodput over {over} ({objectives})"]
    lines.append(f"{'':<34}" + "".join(f"{n:>16}" for n in names))
    lines.append("-" * len(lines[-1]))
    best = [s["summary"]["highest_holding"] or {} for s in sweeps]
    broke = [s["summary"]["first_broken"] or {} for s in sweeps]
    rows = [
        (f"Highest {over} that held", [b.get("value") for b in best]),
        ("  its output throughput (tok/s)", [b.get("output_throughput") for b in best]),
        ("  its request goodput (req/s)", [b.get("request_goodput") for b in best]),
        (f"First {over} that broke", [b.get("value") for b in broke]),
        ("  broken by", [",".join(b["broken"]) if b else None for b in broke]),
    ]
    for title, cells in rows:
        text = "".join(
            f"{'-' if c is None else c if isinstance(c, str) else bench_serving.format_value(c):>16}"
            for c in cells
        )
        lines.append(f"{title:<34}{text}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.compare_pd",
        usage="%(prog)s [options] [-- benchmarks.bench_serving options]",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    w = ap.add_argument_group("model and processes")
    add_deployment_flags(w, "both gateways")
    w.add_argument(
        "--load-format",
        choices=LOAD_FORMATS,
        default=ENGINE_DEFAULTS.load_format,
        help="auto: the checkpoint's weights; dummy: random weights (default: %(default)s)",
    )
    w.add_argument(
        "--prefill-device",
        default="auto",
        help="device of the prefill worker (default: %(default)s)",
    )
    w.add_argument(
        "--decode-device", default="auto", help="device of the decode worker (default: %(default)s)"
    )
    w.add_argument(
        "--colocated-device",
        nargs="+",
        default=["auto"],
        help="device of each colocated (--role both) worker, one worker per device; give "
        "the devices the disaggregated pair uses for a like-for-like comparison "
        "(default: auto)",
    )
    o = ap.add_argument_group("output")
    o.add_argument(
        "--output-file",
        default=str(bench_serving.DEFAULT_OUTPUT),
        help="append both JSON records here (default: %(default)s)",
    )
    o.add_argument("--no-output", action="store_true", help="do not write JSON records")
    return ap


def add_deployment_flags(group: Any, gateways: str) -> None:
    """The flags of the processes a benchmark starts (also bench_ttft_stages'):
    model, KV transfer, pool and extra flags of the workers and ``gateways``,
    how long they may take to start, where their logs go."""
    group.add_argument(
        "--model",
        default=None,
        help="checkpoint directory served by every worker (default: the built-in tiny model)",
    )
    group.add_argument(
        "--dummy-preset",
        default=None,
        metavar="NAME",
        help=f"serve a preset in real shapes with random weights ({', '.join(sorted(PRESETS))}, "
        "or a config.json path): builds a config + synthetic tokenizer directory "
        "(engine/dummy_model.py) in a temp folder and implies --load-format dummy",
    )
    group.add_argument(
        "--transfer-backend",
        choices=sorted(TRANSFER_BACKENDS),
        default=WorkerConfig().transfer_backend,
        help="KV transfer between the prefill and decode workers (default: %(default)s)",
    )
    group.add_argument(
        "--page-size",
        type=int,
        default=ENGINE_DEFAULTS.page_size,
        help="tokens per KV page (default: %(default)s)",
    )
    group.add_argument(
        "--kv-cache-memory-gb",
        type=float,
        default=ENGINE_DEFAULTS.kv_cache_memory_gb,
        help="KV pool of each worker (default: %(default)s)",
    )
    group.add_argument(
        "--worker-args",
        default="",
        help='extra flags for every worker, one string, e.g. "--max-running-requests 64"',
    )
    group.add_argument("--gateway-args", default="", help=f"extra flags for {gateways}, one string")
    group.add_argument(
        "--start-timeout-s",
        type=float,
        default=600.0,
        help="how long each process may take to answer /health (default: %(default)s)",
    )
    group.add_argument(
        "--log-dir",
        default=None,
        help="keep the processes' logs here (default: a temp folder, removed at the end)",
    )


def _interrupt(signum: int, frame: Any) -> None:
    # SIGTERM is handled like Ctrl-C, so that the started processes are stopped;
    # through SIGINT's own handler where there is one, as asyncio.run() then
    # cancels the running benchmark cleanly.
    if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL):
        raise KeyboardInterrupt
    signal.raise_signal(signal.SIGINT)


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Benchmark both deployments; return {"pd": record, "colocated": record}."""
    argv = sys.argv[1:] if argv is None else list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = build_parser()
    args = parser.parse_args(argv[:split])
    bench_args = argv[split + 1 :]
    if args.dummy_preset and args.model:
        parser.error("give --model or --dummy-preset, not both")
    if args.model in PRESETS:
        parser.error(f"a preset has no tokenizer for the gateway: use --dummy-preset {args.model}")
    # Bad benchmark flags must fail before any process starts.
    bench_parser = bench_serving.build_parser()
    checked = bench_parser.parse_args([*bench_args, "--base-url", "http://check"])
    sweep = bench_serving.sweep_of(bench_parser, checked)

    old_handler = signal.signal(signal.SIGTERM, _interrupt)
    with contextlib.ExitStack() as stack:
        stack.callback(signal.signal, signal.SIGTERM, old_handler)
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="compare_pd-")))
        log_dir = Path(args.log_dir) if args.log_dir else tmp
        log_dir.mkdir(parents=True, exist_ok=True)
        model = args.model
        if args.dummy_preset:
            name = (
                Path(args.dummy_preset).stem
                if args.dummy_preset.endswith(".json")
                else args.dummy_preset
            )
            try:
                model = str(write_dummy_model(args.dummy_preset, tmp / name))
            except (OSError, ValueError) as e:
                parser.error(f"--dummy-preset: {e}")
            args.load_format = "dummy"
        limit = token_id_limit(model)
        defaults = ["--vocab-size", str(limit)] if limit else []
        common = deployment_metadata(args, model)
        output = ["--no-output"] if args.no_output else ["--output-file", args.output_file]
        results: dict[str, dict[str, Any]] = {}
        for label in LABELS:
            print(f"== {LABELS[label]} ==", file=sys.stderr)
            devices = (
                [f"prefill_device={args.prefill_device}", f"decode_device={args.decode_device}"]
                if label == "pd"
                else [f"devices={','.join(args.colocated_device)}"]
            )
            with deployment(label, args, model, log_dir) as url:
                results[label] = bench_serving.main(
                    [*defaults, *bench_args, "--base-url", url, "--label", label, *output]
                    + ["--metadata", *common, *devices]
                )
    print()
    print(goodput_table(results) if sweep else comparison_table(results))
    return results


if __name__ == "__main__":
    try:
        records = main()
    except KeyboardInterrupt:
        sys.exit("interrupted; every started process was stopped")
    sys.exit(0 if all(bench_serving.completed_any(r) for r in records.values()) else 1)
