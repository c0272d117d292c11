r"""KV transfer benchmark: move the KV cache of N tokens between two processes.

    python -m benchmarks.bench_kvtransfer --model llama-3.1-8b --tokens 8192 \
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
tiny model) and reports each request's decode-side KV wait, p50/p99;
``--pd-only`` skips the pool-to-pool cases. For that this script plays the
gateway over the request plane (``Generate`` to decode and ``Prefill`` to
prefill at once, one room each) for random token-id prompts at a fixed
concurrency, and reads every request's stage stamps off the final deltas of
both workers (``protocol.stages``). Per request:

- ``kv_wait``: prefill's last forward finished (its first token sampled) until
  the first decode step with the request launched: the KV transfer's tail,
  the Done message and the decode scheduler's pick-up. The two stamps come
  from two processes whose stage offsets start when each received the
  request; both requests leave this process in the same loop tick, so the two
  starts differ by the request plane's delivery skew (tens of µs when the
  workers are idle: at concurrency 1 the figure is exact to about that);
- ``done_to_first_step``: the decode worker's part of it, Done received until
  the first decode step launched (decode clock alone);
- ``transfer_tail``: the rest, ``kv_wait - done_to_first_step``;
- ``first_gap``: the requester's view, prefill's first token to the decode
  worker's first token (one decode step more, and prefill's own send).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import json
import multiprocessing as mp
import random
import secrets
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import RESULTS_DIR, command
from engine.kvcache.pool import KVPool, KVPoolConfig
from engine.model_config import DTYPES, ModelConfig
from engine.presets import PRESETS
from harness.agent_process import AgentProcess
from harness.cluster import Worker
from harness.host import git_commit, host_info
from harness.procs import running
from kvtransfer import TRANSFER_BACKENDS, make_backend
from kvtransfer.backend import TransferState
from kvtransfer.layout import page_ranges
from protocol.auth import keys_for
from protocol.client import WorkerClient, WorkerError
from protocol.finish import FinishReason
from protocol.sampling import SamplingParams
from protocol.stages import DONE_RECEIVED, FIRST_TOKEN, FORWARD_STARTED
from protocol.to_gateway import TokenDelta
from protocol.to_worker import Generate, Prefill
from worker.config import CLUSTER_TOKEN_ENV

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


def bench_self_send(args: argparse.Namespace, shape: tuple, layouts: list[str]) -> list[dict]:
    """The nccl backend's CUDA channel on one GPU: a one-rank communicator
    sends the pages to itself (one group call, the pairs' ``post``), in place
    and through the staging buffer. NCCL refuses two ranks on one device, so
    this is what one GPU can measure of it: the binding, the group call and
    the scatter, with the bytes moving device-local (not over a link)."""
    from kvtransfer.nccl.channel import NcclChannel, Span, import_nccl

    _, layers, kv_heads, head_dim, dtype = shape
    n = -(-args.tokens // args.page_size)
    num_pages = 2 * n + RUN_PAGES + 1
    cfg = KVPoolConfig(
        num_pages, args.page_size, layers, kv_heads, head_dim, dtype, args.src_device
    )
    page_bytes = cfg.page_bytes
    device = torch.device(args.src_device)
    torch.cuda.set_device(device)
    buf = torch.randint(0, 256, (2 * num_pages * page_bytes,), dtype=torch.uint8, device=device)
    channel = NcclChannel.create(bytes(import_nccl().get_unique_id()), 1, 0, buf, 60.0)
    rows = []
    try:
        for layout in layouts:
            src_pages, dst_pages = page_map(layout, n, args.seed)
            dst_pages = [num_pages + p for p in dst_pages]
            ranges = page_ranges(src_pages, dst_pages, page_bytes)
            sends = [Span(r.src_offset, r.nbytes) for r in ranges]
            recvs = [Span(r.dst_offset, r.nbytes) for r in ranges]
            for stage in (False, True):
                times = []
                for i in range(args.warmup + args.iters):
                    torch.cuda.synchronize(device)
                    t0 = time.perf_counter()
                    op = channel.post(sends, recvs, peer=0, stage=stage)
                    channel.wait(op, time.monotonic() + args.timeout)
                    if i >= args.warmup:
                        times.append(time.perf_counter() - t0)
                view = buf.view(2 * num_pages, page_bytes)
                verified = bool(
                    torch.equal(
                        view[torch.tensor(src_pages, device=device)],
                        view[torch.tensor(dst_pages, device=device)],
                    )
                )
                med = statistics.median(times)
                nbytes = n * page_bytes
                rows.append(
                    {
                        "backend": "nccl",
                        "route": "self-send/staged" if stage else "self-send/in-place",
                        "layout": layout,
                        "src_device": args.src_device,
                        "dst_device": args.src_device,
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
                        "idle_cpu_core_fraction": {},
                    }
                )
    finally:
        channel.abort()
    return rows


# ------------------------------------------------- decode-side KV wait (--pd-requests)


CLIENT_TIMEOUT_S = 120.0
METRICS = ("kv_wait", "done_to_first_step", "transfer_tail", "first_gap")


def percentile(xs: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation; NaN when empty."""
    if not xs:
        return float("nan")
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=1000, method="inclusive")[max(0, round(q * 1000) - 1)]


def request_waits(
    prefill: list[TokenDelta], decode: list[TokenDelta], first_gap_s: float | None
) -> dict[str, float] | None:
    """The waits of one request from both workers' final deltas and the
    requester's first-token gap (None when a side failed or lacks a stamp)."""
    if not prefill or not decode or first_gap_s is None:
        return None
    if FinishReason.ERROR in (prefill[-1].finish_reason, decode[-1].finish_reason):
        return None
    p, d = prefill[-1].stages or {}, decode[-1].stages or {}
    if FIRST_TOKEN not in p or DONE_RECEIVED not in d or FORWARD_STARTED not in d:
        return None
    kv_wait = max(0.0, d[FORWARD_STARTED] - p[FIRST_TOKEN])
    on_decode = max(0.0, d[FORWARD_STARTED] - d[DONE_RECEIVED])
    return {
        "kv_wait": kv_wait,
        "done_to_first_step": on_decode,
        "transfer_tail": max(0.0, kv_wait - on_decode),
        "first_gap": first_gap_s,
    }


async def _one(
    pc: WorkerClient,
    dc: WorkerClient,
    prefill_bootstrap: str,
    decode_bootstrap: str,
    rid: str,
    prompt: list[int],
    sampling: SamplingParams,
) -> dict[str, float] | None:
    room = secrets.token_hex(8)
    arrivals: dict[str, float] = {}

    async def collect(client: WorkerClient, msg: Generate | Prefill, side: str) -> list[TokenDelta]:
        out = []
        try:
            async for delta in client.generate(msg):
                if delta.token_ids and side not in arrivals:
                    arrivals[side] = time.perf_counter()
                out.append(delta)
        except WorkerError:
            return []
        return out

    gen = Generate(rid, prompt, sampling, room=room, prefill_bootstrap=prefill_bootstrap)
    pre = Prefill(rid, prompt, sampling, room=room, decode_bootstrap=decode_bootstrap)
    decode, prefill = await asyncio.gather(collect(dc, gen, "decode"), collect(pc, pre, "prefill"))
    gap = None
    if "decode" in arrivals and "prefill" in arrivals:
        gap = arrivals["decode"] - arrivals["prefill"]
    return request_waits(prefill, decode, gap)


async def _drive(
    p_info: dict[str, Any],
    d_info: dict[str, Any],
    token: str,
    requests: int,
    concurrency: int,
    prompt_len: int,
    output_len: int,
    vocab: int,
    seed: int,
) -> tuple[list[dict[str, float]], int]:
    rng = random.Random(seed)
    # Ids away from 0 and the top of the vocabulary (special tokens live there).
    prompts = [[rng.randrange(10, vocab - 10) for _ in range(prompt_len)] for _ in range(requests)]
    sampling = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    keys = keys_for(token)
    pc = WorkerClient(p_info["request_endpoint"], timeout_s=CLIENT_TIMEOUT_S, auth=keys)
    dc = WorkerClient(d_info["request_endpoint"], timeout_s=CLIENT_TIMEOUT_S, auth=keys)
    waits: list[dict[str, float]] = []
    failed = 0
    queue = list(enumerate(prompts))

    async def lane() -> None:
        nonlocal failed
        while queue:
            i, prompt = queue.pop(0)
            w = await _one(
                pc,
                dc,
                p_info["bootstrap_endpoint"],
                d_info["bootstrap_endpoint"],
                f"kvw-{i}",
                prompt,
                sampling,
            )
            if w is None:
                failed += 1
            else:
                waits.append(w)

    async with pc, dc:
        # One request first: connections, KV handshake and warm-up stay out of
        # the figures.
        await _one(
            pc,
            dc,
            p_info["bootstrap_endpoint"],
            d_info["bootstrap_endpoint"],
            "kvw-warm",
            prompts[0],
            sampling,
        )
        await asyncio.gather(*(lane() for _ in range(concurrency)))
    return waits, failed


def model_vocab(model: str | None) -> int:
    """The vocabulary size of a model directory (None: the built-in model)."""
    if model is None:
        from engine.tiny import VOCAB_SIZE

        return VOCAB_SIZE
    return int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])


def summarize(waits: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """p50/p99/mean in ms of every metric over the requests that have it."""
    out = {}
    for name in METRICS:
        xs = [w[name] * 1e3 for w in waits if name in w]
        out[name] = {
            "p50_ms": round(percentile(xs, 0.5), 3),
            "p99_ms": round(percentile(xs, 0.99), 3),
            "mean_ms": round(statistics.fmean(xs), 3) if xs else float("nan"),
            "n": len(xs),
        }
    return out


def run_kv_wait(
    *,
    model: str | None,
    device: str,
    backend: str,
    requests: int,
    concurrency: int,
    prompt_len: int,
    output_len: int,
    settings: dict[str, Any] | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Start the two workers, run the requests, stop the workers; the summary
    (and the settings it ran with). ``model``: a model directory (None: the
    built-in tiny model)."""
    token = secrets.token_hex(16)
    env = {CLUSTER_TOKEN_ENV: token}
    common = {"transfer_backend": backend, "device": device, **(settings or {})}
    with tempfile.TemporaryDirectory(prefix="kv-wait-") as tmp, running([]) as workers:
        logs = Path(tmp)
        workers += [
            Worker.make(role, role, logs, model=model, env=env, **common)
            for role in ("prefill", "decode")
        ]
        try:
            for w in workers:
                w.start()
            p_info, d_info = (w.wait_healthy().start_info for w in workers)
            vocab = model_vocab(model)
            waits, failed = asyncio.run(
                _drive(
                    p_info,
                    d_info,
                    token,
                    requests,
                    concurrency,
                    prompt_len,
                    output_len,
                    vocab,
                    seed,
                )
            )
        except BaseException:
            for w in workers:
                print(f"----- {w.name} log -----\n{w.log_tail()}")
            raise
    return {
        "backend": backend,
        "device": device,
        "requests": requests,
        "concurrency": concurrency,
        "prompt_len": prompt_len,
        "output_len": output_len,
        "failed": failed,
        "waits": summarize(waits),
    }


def print_summary(summary: dict[str, Any]) -> None:
    print(
        f"decode-side KV wait, {summary['backend']} on {summary['device']}: "
        f"{summary['requests']} requests of {summary['prompt_len']} prompt tokens at "
        f"concurrency {summary['concurrency']} ({summary['failed']} failed)"
    )
    print(f"{'per request':<22}{'p50 ms':>10}{'p99 ms':>10}{'mean ms':>10}{'n':>6}")
    for name, s in summary["waits"].items():
        print(f"{name:<22}{s['p50_ms']:>10.3f}{s['p99_ms']:>10.3f}{s['mean_ms']:>10.3f}{s['n']:>6}")


# ------------------------------------------------------------------ report


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
        prog="python -m benchmarks.bench_kvtransfer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
        "--self-send",
        action="store_true",
        help="with --backend nccl on one GPU: a one-rank communicator sends the pages to "
        "itself through the backend's channel, in place and staged (NCCL refuses two "
        "ranks on one device; this measures the binding, group call and scatter)",
    )
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

    if args.self_send and (args.backend != "nccl" or not args.src_device.startswith("cuda")):
        parser.error("--self-send needs --backend nccl and a CUDA --device")
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
        if args.self_send:
            rows += bench_self_send(
                argparse.Namespace(**{**vars(args), "tokens": tokens}), shape, layouts
            )
            continue
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
        "command": command("benchmarks.bench_kvtransfer", argv),
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
