r"""KV transfer benchmark: move the KV cache of N tokens between two processes.

    python benchmarks/bench_kvtransfer.py --model llama-3.1-8b --tokens 8192 \
        --page-size 16 --backend all --layout all --src-device cuda:0 --dst-device cuda:1

Two spawned processes each own a page-major KV pool (``engine.kvcache.pool``)
on their device and register it with the backend; the source process writes
the pages of N tokens into the destination's pool, timing ``write`` until
``poll`` says DONE (bytes landed in the peer). ``contiguous`` maps src pages
1..n to dst pages 1..n (one descriptor); ``scattered`` maps n random pages to n
random pages of a pool twice that size (about one descriptor per page).
Prints a table and writes a JSON record under benchmarks/results/.

``--pd-requests N`` also runs N disaggregated requests through a real prefill
and a real decode worker on ``--device`` (``--pd-model``: a model directory,
e.g. dummy weights from ``engine/dummy_model.py``; default the built-in
tiny model) and reports each request's decode-side KV wait, p50/p99
(``benchmarks/kv_wait.py``); ``--pd-only`` skips the pool-to-pool cases.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import multiprocessing as mp
import random
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.agent_process import AgentProcess  # noqa: E402
from benchmarks.common import git_commit, host_info  # noqa: E402
from benchmarks.kv_wait import print_summary, run_kv_wait  # noqa: E402
from engine.kvcache.pool import KVPool, KVPoolConfig  # noqa: E402
from engine.model_config import DTYPES, ModelConfig  # noqa: E402
from engine.presets import PRESETS  # noqa: E402
from kvtransfer import TRANSFER_BACKENDS, make_backend  # noqa: E402
from kvtransfer.backend import TransferState  # noqa: E402
from kvtransfer.layout import page_ranges  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
CALL_TIMEOUT_S = 600.0


# ------------------------------------------------------------ worker process


def _sync(kv: torch.Tensor) -> None:
    if kv.is_cuda:
        torch.cuda.synchronize(kv.device)


def _serve(state: dict[str, Any], cmd: str, *args: Any) -> Any:
    if cmd == "setup":
        backend, name, kwargs, cfg, seed = args
        if cfg.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(cfg.device))
        pool = KVPool(cfg)
        gen = torch.Generator(device=pool.kv.device).manual_seed(seed)
        u8 = pool.kv.view(-1).view(torch.uint8)
        u8.copy_(
            torch.randint(0, 256, u8.shape, dtype=torch.uint8, device=u8.device, generator=gen)
        )
        _sync(pool.kv)
        state["kv"] = pool.kv
        state["backend"] = make_backend(backend, name, **kwargs)
        state["backend"].register(pool.kv)
        return state["backend"].metadata()
    be = state["backend"]
    if cmd == "connect":
        be.connect(*args)
        return be.route(args[0]) if hasattr(be, "route") else None
    if cmd == "path":
        return be.path(*args) if hasattr(be, "path") else be.name
    if cmd == "run":
        peer, ranges, warmup, iters, poll_s = args
        times = []
        for i in range(warmup + iters):
            t0 = time.perf_counter()
            handle = be.write(peer, ranges)
            while (st := be.poll(handle)) is TransferState.PENDING:
                if poll_s:
                    time.sleep(poll_s)
            dt = time.perf_counter() - t0
            if st is not TransferState.DONE:
                raise RuntimeError(f"write ended {st.value}: {getattr(be, 'last_error', '')}")
            if i >= warmup:
                times.append(dt)
        return times
    if cmd == "idle_cpu":  # share of a core this process used while nothing moved
        seconds = args[0]
        c0, t0 = time.process_time(), time.perf_counter()
        time.sleep(seconds)
        return (time.process_time() - c0) / (time.perf_counter() - t0)
    if cmd == "digest":  # hash of the given pages, in order
        pages = args[0]
        kv = state["kv"]
        h = hashlib.blake2b(digest_size=16)
        for i in range(0, len(pages), 256):
            idx = torch.tensor(pages[i : i + 256], device=kv.device)
            chunk = kv.index_select(0, idx).contiguous().view(-1).view(torch.uint8).cpu()
            h.update(chunk.numpy().tobytes())
        return h.hexdigest()
    raise ValueError(f"unknown command {cmd!r}")


# ------------------------------------------------------------------ driver


RUN_PAGES = 8
"""Pages per run of the ``runs`` layout."""


def page_map(layout: str, n: int, seed: int) -> tuple[list[int], list[int]]:
    if layout == "contiguous":
        return list(range(1, n + 1)), list(range(1, n + 1))
    rng = random.Random(seed)
    if layout == "scattered":
        return rng.sample(range(1, 2 * n + 1), n), rng.sample(range(1, 2 * n + 1), n)

    # runs: RUN_PAGES-page runs, consecutive on both sides, at random places.
    def runs() -> list[int]:
        blocks = rng.sample(range(2 * n // RUN_PAGES), -(-n // RUN_PAGES))
        return [1 + b * RUN_PAGES + i for b in blocks for i in range(RUN_PAGES)][:n]

    return runs(), runs()


def shapes(args: argparse.Namespace) -> tuple[str, int, int, int, torch.dtype]:
    label, layers, kv_heads, head_dim, dtype = "custom", None, None, None, None
    if args.model:
        mc = ModelConfig.from_dict(PRESETS[args.model])
        label, layers, kv_heads, head_dim, dtype = (
            args.model,
            mc.num_layers,
            mc.num_kv_heads,
            mc.head_dim,
            mc.dtype,
        )
    layers = args.layers or layers
    kv_heads = args.kv_heads or kv_heads
    head_dim = args.head_dim or head_dim
    if args.dtype:
        dtype = DTYPES[args.dtype]
    if None in (layers, kv_heads, head_dim):
        raise SystemExit("give --model, or all of --layers --kv-heads --head-dim")
    return label, layers, kv_heads, head_dim, dtype or torch.bfloat16


def bench_backend(
    backend: str, args: argparse.Namespace, shape: tuple, layouts: list[str]
) -> list[dict]:
    _, layers, kv_heads, head_dim, dtype = shape
    n = -(-args.tokens // args.page_size)
    num_pages = n + 1 if layouts == ["contiguous"] else 2 * n + RUN_PAGES + 1
    backend, _, route = backend.partition("/")
    kwargs: dict[str, Any] = {"timeout": args.timeout}
    if route:
        kwargs["cuda_ipc"] = route != "ucx"
    if backend == "tcp" and args.chunk_mib:
        kwargs["chunk_bytes"] = int(args.chunk_mib * (1 << 20))

    def cfg(device: str) -> KVPoolConfig:
        return KVPoolConfig(num_pages, args.page_size, layers, kv_heads, head_dim, dtype, device)

    ctx = mp.get_context("spawn")
    src, dst = (
        AgentProcess(ctx, f"{backend}-{side}", _serve, CALL_TIMEOUT_S) for side in ("src", "dst")
    )
    rows = []
    try:
        src.call("setup", backend, "bench-src", kwargs, cfg(args.src_device), 1)
        dst_md = dst.call("setup", backend, "bench-dst", kwargs, cfg(args.dst_device), 2)
        src.call("connect", "bench-dst", dst_md)
        page_bytes = cfg("cpu").page_bytes
        idle = {}
        if args.idle_s > 0:  # both agents set up and connected, no transfer yet
            idle = {
                side: p.call("idle_cpu", args.idle_s) for side, p in (("src", src), ("dst", dst))
            }
        for layout in layouts:
            src_pages, dst_pages = page_map(layout, n, args.seed)
            ranges = page_ranges(src_pages, dst_pages, page_bytes)
            path = src.call("path", "bench-dst", ranges)
            nbytes = n * page_bytes
            times = src.call(
                "run", "bench-dst", ranges, args.warmup, args.iters, args.poll_interval_us * 1e-6
            )
            verified = None
            if not args.no_verify:
                verified = src.call("digest", src_pages) == dst.call("digest", dst_pages)
            med = statistics.median(times)
            rows.append(
                {
                    "backend": backend,
                    "route": path,
                    "layout": layout,
                    "src_device": args.src_device,
                    "dst_device": args.dst_device,
                    "tokens": args.tokens,
                    "page_size": args.page_size,
                    "pages": n,
                    "page_bytes": page_bytes,
                    "descriptors": len(ranges),
                    "bytes": nbytes,
                    "iters": len(times),
                    "median_ms": med * 1e3,
                    "min_ms": min(times) * 1e3,
                    "mean_ms": statistics.fmean(times) * 1e3,
                    "gbps": nbytes / med / 1e9,
                    "gbps_best": nbytes / min(times) / 1e9,
                    "verified": verified,
                    "idle_cpu_core_fraction": idle,
                }
            )
            if verified is False:
                print(f"!! {backend}/{layout}: destination pages differ from source", flush=True)
    finally:
        src.stop()
        dst.stop()
    return rows


def machine_info(devices: list[str]) -> dict:
    info: dict[str, Any] = {**host_info(), "torch": torch.__version__}
    gpus = sorted({d for d in devices if d.startswith("cuda")})
    if gpus:
        info["gpus"] = {d: torch.cuda.get_device_name(torch.device(d)) for d in gpus}
    try:
        from importlib.metadata import version

        info["nixl"] = version("nixl")
    except Exception:
        pass
    return info


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'backend':<7} {'route':<8} {'tokens':>6} {'layout':<10} {'src->dst':<16} {'descs':>7} {'MiB':>9} "
        f"{'median ms':>10} {'GB/s':>8} {'best GB/s':>9} {'ok':>4} {'idle CPU src/dst':>16}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        ok = {True: "yes", False: "NO", None: "-"}[r["verified"]]
        idle = r.get("idle_cpu_core_fraction") or {}
        idle_s = f"{idle['src']:.0%}/{idle['dst']:.0%}" if idle else "-"
        print(
            f"{r['backend']:<7} {r.get('route', '-'):<8} {r['tokens']:>6} {r['layout']:<10} "
            f"{r['src_device'] + '->' + r['dst_device']:<16} {r['descriptors']:>7} "
            f"{r['bytes'] / 2**20:>9.1f} {r['median_ms']:>10.3f} {r['gbps']:>8.2f} "
            f"{r['gbps_best']:>9.2f} {ok:>4} {idle_s:>16}"
        )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=[4096],
        help="tokens whose KV is moved; several sizes run one after another (default 4096)",
    )
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    p.add_argument(
        "--model",
        choices=sorted(PRESETS),
        default=None,
        help="preset whose layers/kv heads/head dim/dtype give the KV shape "
        "(default llama-3.1-8b unless --layers/--kv-heads/--head-dim are all given)",
    )
    p.add_argument("--layers", type=int, help="number of layers (overrides --model)")
    p.add_argument("--kv-heads", type=int, help="KV heads per layer (overrides --model)")
    p.add_argument("--head-dim", type=int, help="head dimension (overrides --model)")
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        help="KV dtype (default: the model's, bfloat16 for explicit shapes)",
    )
    p.add_argument(
        "--backend",
        choices=[*sorted(TRANSFER_BACKENDS), "nixl/ucx", "nixl/cuda_ipc", "all"],
        default="all",
        help="transfer backend to measure; nixl takes CUDA IPC to a GPU peer of this host "
        "where it can ('nixl/ucx': always UCX); 'all' runs tcp, nixl and nixl/ucx (default all)",
    )
    p.add_argument(
        "--layout",
        choices=["contiguous", "scattered", "runs", "all"],
        default="all",
        help="page map: 'contiguous' (src 1..n -> dst 1..n, one descriptor), "
        "'scattered' (random pages of a 2n-page pool, ~one descriptor per page), "
        f"'runs' (runs of {RUN_PAGES} pages at random places: a pool half fragmented), "
        "or 'all' (default)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="device of both pools unless --src-device/--dst-device say otherwise "
        "(cpu, cuda:0, cuda:1, ...; default cpu)",
    )
    p.add_argument("--src-device", help="device of the writer's pool (default --device)")
    p.add_argument("--dst-device", help="device of the receiver's pool (default --device)")
    p.add_argument("--iters", type=int, default=10, help="timed writes per case (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed writes first (default 2)")
    p.add_argument(
        "--poll-interval-us",
        type=float,
        default=0.0,
        help="sleep between poll() calls of the writer, in microseconds "
        "(default 0: spin, as a busy scheduler loop would)",
    )
    p.add_argument("--timeout", type=float, default=60.0, help="backend timeout, s (default 60)")
    p.add_argument(
        "--chunk-mib", type=float, default=None, help="tcp frame size in MiB (default: backend's)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the scattered page map")
    p.add_argument(
        "--idle-s",
        type=float,
        default=2.0,
        help="seconds over which each agent's CPU use is measured while idle, "
        "before the transfers (0: skip; default 2)",
    )
    p.add_argument(
        "--no-verify", action="store_true", help="skip the byte check of the moved pages"
    )
    p.add_argument(
        "--pd-requests",
        type=int,
        default=0,
        help="disaggregated requests through real workers for the decode-side KV wait "
        "(0: skip; default 0)",
    )
    p.add_argument(
        "--pd-model",
        help="model directory of the workers of --pd-requests (default: the built-in tiny model)",
    )
    p.add_argument(
        "--pd-prompt-len", type=int, default=512, help="prompt tokens per request (default 512)"
    )
    p.add_argument(
        "--pd-output-len", type=int, default=4, help="output tokens per request (default 4)"
    )
    p.add_argument(
        "--pd-concurrency",
        type=int,
        default=1,
        help="requests in flight at once (default 1: the stamps of the two workers line up "
        "best when neither is busy)",
    )
    p.add_argument("--pd-only", action="store_true", help="run only the --pd-requests measurement")
    p.add_argument(
        "--output-file",
        type=Path,
        help="JSON output path (default benchmarks/results/kvtransfer-<shape>-<commit>-<time>.json)",
    )
    return p


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model is None and not (args.layers and args.kv_heads and args.head_dim):
        args.model = "llama-3.1-8b"
    args.src_device = args.src_device or args.device
    args.dst_device = args.dst_device or args.device
    if min(args.tokens) < 1 or args.page_size < 1 or args.iters < 1:
        parser.error("--tokens, --page-size and --iters must be >= 1")

    shape = shapes(args)
    backends = ["tcp", "nixl", "nixl/ucx"] if args.backend == "all" else [args.backend]
    layouts = ["contiguous", "runs", "scattered"] if args.layout == "all" else [args.layout]
    label, layers, kv_heads, head_dim, dtype = shape
    print(
        f"KV of {'/'.join(map(str, args.tokens))} tokens, {label}: {layers} layers x {kv_heads} kv heads x "
        f"{head_dim} head dim, {str(dtype).removeprefix('torch.')}, page size {args.page_size}"
    )
    rows: list[dict] = []
    for backend, tokens in [] if args.pd_only else itertools.product(backends, args.tokens):
        try:
            rows += bench_backend(
                backend, argparse.Namespace(**{**vars(args), "tokens": tokens}), shape, layouts
            )
        except Exception as e:  # e.g. nixl missing: report and go on with the others
            if args.backend != "all":
                raise
            print(f"!! {backend} skipped: {str(e).strip().splitlines()[-1]}", flush=True)
    if rows:
        print_table(rows)
    kv_waits = []
    for backend in backends if args.pd_requests > 0 else []:
        summary = run_kv_wait(
            model=args.pd_model,
            device=args.dst_device,
            backend=backend,
            requests=args.pd_requests,
            concurrency=args.pd_concurrency,
            prompt_len=args.pd_prompt_len,
            output_len=args.pd_output_len,
            settings={"page_size": args.page_size},
            seed=args.seed,
        )
        print_summary(summary)
        kv_waits.append(summary)

    commit = git_commit()
    now = datetime.now(UTC)
    record = {
        "benchmark": "kvtransfer",
        "date": now.isoformat(timespec="seconds"),
        "machine": machine_info([args.src_device, args.dst_device]),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "git_commit": commit,
        "shape": {
            "model": label,
            "layers": layers,
            "kv_heads": kv_heads,
            "head_dim": head_dim,
            "dtype": str(dtype).removeprefix("torch."),
        },
        "results": rows,
        "kv_wait": kv_waits,
    }
    out = args.output_file or RESULTS_DIR / (
        f"kvtransfer-{label}-{commit}-{now.strftime('%Y%m%d-%H%M%S')}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
