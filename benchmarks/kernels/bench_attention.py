"""Decode attention kernels by batch size, as the decode graphs run them.

For each batch size and context length, a KV pool shaped like the model's
(page-major, random pages per request) is planned once per kernel variant,
then ``--layers`` attention calls (one per layer, as a decode step makes them)
are captured in a CUDA graph and the replay is timed on the device. A variant
is a kernel (FlashInfer's ``cuda-core``: its decode kernel; ``fa2``/``fa3``:
its tensor-core kernels through the prefill path; ``triton``:
``engine.attention.paged_decode`` as the engine plans it, K/V tiles of 4 pages,
4 warps, 2 stages; ``triton-b2``: tiles of 2 pages; ``triton-b8``: of 8 pages,
8 warps; ``triton-s3``: 3 stages; ``triton-c8``/``c16``/``c32``: batch-invariant
chunks of at least 8/16/32 pages), a KV split
rule (``auto``: the plan's own, ``none``: one pass per request, ``N``: N pages
per split for FlashInfer, N splits per request for Triton) and the layout
within a page (``NHD``: the pool's, ``HND``: heads outermost, so that a
page holds each head's tokens in one run: the Triton kernel reads it through
its strides). Reports
GPU ms per step and the KV read rate, so that the kernel and split the engine
uses can be set from a measurement::

    python -m benchmarks.kernels.bench_attention --batch-sizes 1 2 4 8 16 32 64 128 256 \\
        --context-lens 1024 4096
    python -m benchmarks.kernels.bench_attention --batch-sizes 64 256 --variants \\
        fa2:auto:NHD fa2:none:NHD fa3:auto:NHD cuda-core:auto:NHD fa2:auto:HND
    python -m benchmarks.kernels.bench_attention --batch-sizes 256 --pool-layers 32 \\
        --between-gemm 28672 4096     # the calls between compute-bound products
    python -m benchmarks.kernels.bench_attention --kv-dtype fp8_e4m3 --batch-sizes 64 256 \\
        --variants fa2:auto:NHD cuda-core:auto:NHD fa2:none:NHD   # e4m3 pages, bf16 queries
    python -m benchmarks.kernels.bench_attention --kv-dtype fp8_e4m3 --batch-sizes 1 64 256 \\
        --pool-layers 32 --q-in-qkv --variants fa2:auto:NHD triton:auto:NHD triton-b8:auto:NHD \\
        triton-b2:auto:NHD triton-s3:auto:NHD
    python -m benchmarks.kernels.bench_attention --kv-dtype fp8_e4m3 --batch-sizes 64 256 \\
        --pool-layers 32 --q-in-qkv --variants triton-plan:auto:NHD triton-plan:auto:HND
"""

from __future__ import annotations

import argparse
import statistics
import sys
import traceback
from typing import Any, NamedTuple

import torch

from benchmarks.common import machine, write_record

TRITON_TILES = {
    "triton": dict(block_pages=4, warps=4, stages=2),
    "triton-b2": dict(block_pages=2, warps=4, stages=2),
    "triton-b8": dict(block_pages=8, warps=8, stages=2),
    "triton-b8-w4": dict(block_pages=8, warps=4, stages=2),
    "triton-b8-s3": dict(block_pages=8, warps=8, stages=3),
    "triton-b16": dict(block_pages=16, warps=8, stages=2),
    "triton-s3": dict(block_pages=4, warps=4, stages=3),
    "triton-s4": dict(block_pages=4, warps=4, stages=4),
    "triton-ev": dict(block_pages=4, warps=4, stages=2, early_v=True),
    "triton-ev-s3": dict(block_pages=4, warps=4, stages=3, early_v=True),
    "triton-ev-b8": dict(block_pages=8, warps=8, stages=2, early_v=True),
    "triton-ev-b8-w4": dict(block_pages=8, warps=4, stages=2, early_v=True),
    "triton-c4": dict(block_pages=4, warps=4, stages=2, chunk_pages=4),
    "triton-c8": dict(block_pages=4, warps=4, stages=2, chunk_pages=8),
    "triton-c8-b8": dict(block_pages=8, warps=8, stages=2, chunk_pages=8),
    "triton-c16": dict(block_pages=4, warps=4, stages=2, chunk_pages=16),
    "triton-c32": dict(block_pages=4, warps=4, stages=2, chunk_pages=32),
    "triton-c16-b8": dict(block_pages=8, warps=8, stages=2, chunk_pages=16),
    "triton-c32-b8": dict(block_pages=8, warps=8, stages=2, chunk_pages=32),
    "triton-c16-b8-wv": dict(
        block_pages=8, warps=8, stages=2, chunk_pages=16, early_v=True, widen_v=True
    ),
    "triton-c16-b8-r128": dict(block_pages=8, warps=8, stages=2, chunk_pages=16, registers=128),
    "triton-c16-b8-wv-r128": dict(
        block_pages=8, warps=8, stages=2, chunk_pages=16, early_v=True, widen_v=True, registers=128
    ),
    "triton-wv": dict(block_pages=4, warps=4, stages=2, early_v=True, widen_v=True),
    "triton-wv-b8": dict(block_pages=8, warps=8, stages=2, early_v=True, widen_v=True),
    "triton-wv-b8-w4": dict(block_pages=8, warps=4, stages=2, early_v=True, widen_v=True),
    "triton-wv-b8-s3": dict(block_pages=8, warps=8, stages=3, early_v=True, widen_v=True),
    "triton-wv-b8-s5": dict(block_pages=8, warps=8, stages=5, early_v=True, widen_v=True),
    "triton-wv-b4-s5": dict(block_pages=4, warps=4, stages=5, early_v=True, widen_v=True),
    "triton-wv-b16": dict(block_pages=16, warps=8, stages=2, early_v=True, widen_v=True),
    "triton-wv-b16-w16": dict(block_pages=16, warps=16, stages=2, early_v=True, widen_v=True),
    "triton-wv-b4-w8": dict(block_pages=4, warps=8, stages=2, early_v=True, widen_v=True),
    "triton-wv-s3": dict(block_pages=4, warps=4, stages=3, early_v=True, widen_v=True),
    "triton-wv-r128": dict(
        block_pages=4, warps=4, stages=2, early_v=True, widen_v=True, registers=128
    ),
    "triton-wv-r96": dict(
        block_pages=4, warps=4, stages=2, early_v=True, widen_v=True, registers=96
    ),
    "triton-r128": dict(block_pages=4, warps=4, stages=2, registers=128),
}
"""Triton variant -> its ``paged_decode.DecodePlan`` fields at the batch's
split: pages per K/V tile, warps, stages, batch-invariant chunks of N pages
or more (else chunks by the split), V loaded before the scores, V widened to
fp16 before the tensor cores over e4m3 pages, a cap on registers a thread.
``triton-plan``: the engine's own plan for the batch (``paged_decode.plan``);
``triton-plan-wv`` and ``triton-plan-bytes``: that plan with V widened, or
read byte-wise, over e4m3 pages; ``triton-plan-hf``: that plan with a
request's KV heads' programs placed together."""
PLANNED = {"triton-plan": None, "triton-plan-wv": True, "triton-plan-bytes": False}
HEADS_FIRST = {"triton-plan-hf": "triton-plan"}
"""A planned variant with a request's KV heads' programs placed together
(``DecodePlan.heads_first``) -> the plan it changes."""
TRITON = (*TRITON_TILES, *PLANNED, *HEADS_FIRST)
KERNELS = ("cuda-core", "fa2", "fa3", *TRITON)
Q_DTYPE = torch.bfloat16
KV_DTYPES = {"bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}
LAYOUTS = ("NHD", "HND")


class Variant(NamedTuple):
    kernel: str
    split: str
    """``auto``, ``none`` or a page count."""
    layout: str

    @classmethod
    def parse(cls, text: str) -> Variant:
        parts = text.split(":")
        if len(parts) != 3:
            raise argparse.ArgumentTypeError(f"{text!r}: expected KERNEL:SPLIT:LAYOUT")
        kernel, split, layout = parts
        if kernel not in KERNELS:
            raise argparse.ArgumentTypeError(f"{text!r}: kernel is one of {', '.join(KERNELS)}")
        if split not in ("auto", "none") and not split.isdigit():
            raise argparse.ArgumentTypeError(f"{text!r}: split is auto, none or a page count")
        if layout not in LAYOUTS:
            raise argparse.ArgumentTypeError(f"{text!r}: layout is NHD or HND")
        if kernel in TRITON and split.isdigit() and not 1 <= int(split) <= 32:
            raise argparse.ArgumentTypeError(f"{text!r}: Triton splits are 1 to 32")
        return cls(kernel, split, layout)

    def __str__(self) -> str:
        return ":".join(self)


class DecodeCall(NamedTuple):
    """What one layer's decode attention call reads and writes: the queries
    and output ``[batch, heads, head_dim]`` and the page table (host int32:
    each kernel's setup moves it where it reads it)."""

    q: torch.Tensor
    out: torch.Tensor
    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor


def time_kernel(
    fi: Any,
    variant: Variant,
    batch_size: int,
    context: int,
    args: argparse.Namespace,
    kv: torch.Tensor,
) -> float:
    """GPU ms of ``args.layers`` decode attention calls, replayed from a graph."""
    device = kv.device
    ps = args.page_size
    pages_per_req = -(-context // ps)
    num_pages = kv.shape[0]
    gen = torch.Generator().manual_seed(batch_size * 7 + context)
    # Distinct pages, as a pool hands out: a page read twice would be served
    # from L2 and overstate the rate. "contiguous": each request's pages in a
    # run, as a fresh pool's allocator hands them out.
    if args.page_order == "contiguous":
        indices = torch.arange(1, batch_size * pages_per_req + 1)
    else:
        indices = torch.randperm(num_pages - 1, generator=gen)[: batch_size * pages_per_req] + 1
    indptr = torch.arange(0, batch_size + 1, dtype=torch.int32) * pages_per_req
    last = torch.full((batch_size,), context - (pages_per_req - 1) * ps, dtype=torch.int32)
    # The engine's q is a view into the fused QKV projection's output: its rows
    # are (query + 2 x KV heads) x head_dim apart.
    qkv_heads = args.num_heads + 2 * args.num_kv_heads if args.q_in_qkv else args.num_heads
    qkv = torch.randn(batch_size, qkv_heads, args.head_dim, dtype=Q_DTYPE, device=device)
    q = qkv[:, : args.num_heads]
    out = torch.empty(q.shape, dtype=q.dtype, device=device)
    call = DecodeCall(q, out, indptr, indices.to(torch.int32), last)
    if variant.kernel in TRITON:
        run = _triton_call(variant, args, call)
    else:
        run = _flashinfer_call(fi, variant, args, call)
    caches = []
    for layer in range(kv.shape[1]):
        cache = (kv[:, layer, 0], kv[:, layer, 1])
        if variant.layout == "HND":
            # The same bytes read as [page, heads, tokens, dim]: what is timed
            # is the access pattern, not the values. The Triton kernel takes
            # them as [page, tokens, heads, dim] through the strides.
            cache = tuple(c.view(c.shape[0], args.num_kv_heads, ps, args.head_dim) for c in cache)
            if variant.kernel in TRITON:
                cache = tuple(c.transpose(1, 2) for c in cache)
        caches.append(cache)

    gemm: tuple[torch.Tensor, torch.Tensor] | None = None
    if args.between_gemm:
        # A decoder layer's gate/up product at this batch between the calls,
        # as the decode graph runs them (the tensor cores busy in between).
        n, k = args.between_gemm
        gemm = (
            torch.randn(batch_size, k, dtype=Q_DTYPE, device=device),
            torch.randn(n, k, dtype=Q_DTYPE, device=device) * 0.02,
        )

    def step() -> None:
        for layer in range(args.layers):
            if gemm is not None:
                torch.nn.functional.linear(*gemm)
            run(caches[layer % len(caches)])

    ms, graph = time_graph(step, args.reps, device)
    if gemm is None:
        return ms
    # With products in between, the attention's own kernels are timed from a
    # profile of one replay.
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize(device)
    own = ("split_attend", "merge") if variant.kernel in TRITON else ("flashinfer",)
    return (
        sum(
            e.device_time_total
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and any(n in e.name for n in own)
        )
        / 1e3
    )


def time_graph(step: Any, reps: int, device: torch.device) -> tuple[float, Any]:
    """GPU ms of ``step`` replayed from a CUDA graph (the median of ``reps``,
    after three untimed), and the graph."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        step()  # warm-up outside the graph
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        step()
    times = []
    for i in range(reps + 3):
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize(device)
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times), graph


def _triton_call(variant: Variant, args: argparse.Namespace, call: DecodeCall) -> Any:
    """One layer's call of the engine's Triton decode attention, planned."""
    from engine.attention import paged_decode as pd

    q, out = call.q, call.out
    batch_size, device = q.shape[0], q.device
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    e4m3 = KV_DTYPES[args.kv_dtype] == pd.E4M3
    group = args.num_heads // args.num_kv_heads
    decode_plan = triton_plan(variant, batch_size, args.num_kv_heads, sms, e4m3, group)
    scratch = pd.scratch_for(
        batch_size, args.num_heads, args.head_dim, decode_plan.partials, device
    )
    table = (call.indptr.to(device), call.indices.to(device), call.last_page_len.to(device))
    sm_scale = args.head_dim**-0.5

    def run(cache: tuple[torch.Tensor, torch.Tensor]) -> None:
        pd.paged_decode(q, *cache, *table, out, sm_scale, decode_plan, scratch)

    return run


def triton_plan(
    variant: Variant, batch_size: int, num_kv_heads: int, sms: int, e4m3: bool, group: int
) -> Any:
    """The Triton kernel's ``DecodePlan`` of a variant at a batch size
    (``group``: query heads per KV head)."""
    from engine.attention import paged_decode as pd

    if variant.kernel in HEADS_FIRST:
        base = variant._replace(kernel=HEADS_FIRST[variant.kernel])
        plain = triton_plan(base, batch_size, num_kv_heads, sms, e4m3, group)
        return plain._replace(heads_first=True)
    if variant.kernel in PLANNED:
        widen = PLANNED[variant.kernel]
        decode_plan = pd.plan(
            batch_size, num_kv_heads, sms=sms, e4m3=e4m3, widen_v=widen, group=group
        )
    else:
        splits = pd.plan(batch_size, num_kv_heads, sms=sms).splits
        decode_plan = pd.DecodePlan(splits, **TRITON_TILES[variant.kernel])
    if variant.split != "auto":
        splits = 1 if variant.split == "none" else int(variant.split)
        decode_plan = decode_plan._replace(splits=splits)
    return decode_plan


def _flashinfer_call(fi: Any, variant: Variant, args: argparse.Namespace, call: DecodeCall) -> Any:
    """One layer's call of a FlashInfer decode wrapper, planned."""
    q, out = call.q, call.out
    batch_size, device = q.shape[0], q.device
    ps = args.page_size
    kv_dtype = KV_DTYPES[args.kv_dtype]
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=device)
    buffers = (
        torch.empty(batch_size + 1, dtype=torch.int32, device=device),
        torch.empty(call.indices.numel(), dtype=torch.int32, device=device),
        torch.empty(batch_size, dtype=torch.int32, device=device),
    )
    tensor_cores = variant.kernel != "cuda-core"
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
        workspace,
        variant.layout,
        use_cuda_graph=True,
        use_tensor_cores=tensor_cores,
        paged_kv_indptr_buffer=buffers[0],
        paged_kv_indices_buffer=buffers[1],
        paged_kv_last_page_len_buffer=buffers[2],
        backend=variant.kernel if tensor_cores else "auto",
    )
    split: dict[str, Any] = {}
    if variant.split == "none":
        split["disable_split_kv"] = True
    elif variant.split != "auto":
        split["fixed_split_size"] = int(variant.split)
    wrapper.plan(
        call.indptr.pin_memory(),
        call.indices.to(device),
        call.last_page_len.pin_memory(),
        args.num_heads,
        args.num_kv_heads,
        args.head_dim,
        ps,
        q_data_type=Q_DTYPE,
        kv_data_type=kv_dtype,
        **split,
    )

    def run(cache: tuple[torch.Tensor, torch.Tensor]) -> None:
        wrapper.run(q, cache, out=out)

    return run


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.kernels.bench_attention",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--device", default="cuda:0", help="CUDA device (default: %(default)s)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--context-lens", type=int, nargs="+", default=[1024])
    ap.add_argument(
        "--variants",
        type=Variant.parse,
        nargs="+",
        default=[Variant("fa2", "auto", "NHD"), Variant("cuda-core", "auto", "NHD")],
        help="KERNEL:SPLIT:LAYOUT, KERNEL one of cuda-core, fa2, fa3; SPLIT auto, none or "
        "pages per split; LAYOUT NHD or HND (default: fa2:auto:NHD cuda-core:auto:NHD, "
        "the engine's two kernels)",
    )
    ap.add_argument("--layers", type=int, default=32, help="calls per step (default: 32)")
    ap.add_argument("--num-heads", type=int, default=32, help="query heads (Llama-3.1-8B)")
    ap.add_argument("--num-kv-heads", type=int, default=8, help="KV heads (Llama-3.1-8B)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument(
        "--pool-layers",
        type=int,
        default=1,
        help="layers held by each page of the pool, as the engine's page-major pool "
        "holds all of them (its page stride spans every layer's K and V); call i reads "
        "layer i mod this. 1: one layer's K and V per page (default: %(default)s)",
    )
    ap.add_argument(
        "--page-order",
        choices=("random", "contiguous"),
        default="random",
        help="pages of a request: distinct random pages, or one run per request "
        "(default: %(default)s)",
    )
    ap.add_argument(
        "--q-in-qkv",
        action="store_true",
        help="queries as a strided view into a fused QKV output, as the engine passes them",
    )
    ap.add_argument(
        "--between-gemm",
        type=int,
        nargs=2,
        metavar=("N", "K"),
        help="run a [batch, K] x [K, N] product before each call, as a layer's GEMMs "
        "run between the decode graph's attention calls, and time the attention "
        "kernels alone from a profile (e.g. 28672 4096: Llama-3.1-8B's gate/up)",
    )
    ap.add_argument(
        "--kv-dtype",
        choices=sorted(KV_DTYPES),
        default="bfloat16",
        help="the pages' dtype; queries stay bf16, as the engine's "
        "--kv-cache-dtype fp8_e4m3 runs them (default: %(default)s)",
    )
    ap.add_argument("--reps", type=int, default=20, help="timed replays (default: 20)")
    ap.add_argument("--output-file", default=None, help="JSON record (default: results dir)")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    import flashinfer

    device = torch.device(args.device)
    torch.cuda.set_device(device)
    # One page-major pool big enough for the largest case; K and V per page.
    most = max(args.batch_sizes) * -(-max(args.context_lens) // args.page_size)
    kv = torch.empty(
        most + 1,
        args.pool_layers,
        2,
        args.page_size,
        args.num_kv_heads,
        args.head_dim,
        dtype=Q_DTYPE,
        device=device,
    ).normal_()
    kv = kv.to(KV_DTYPES[args.kv_dtype])  # e4m3: the same values, rounded
    token_bytes = 2 * args.num_kv_heads * args.head_dim * kv.element_size() * args.layers
    rows = []
    print(f"{'batch':>6} {'context':>8} {'variant':>22} {'ms':>8} {'KV TB/s':>8}")
    for context in args.context_lens:
        for b in args.batch_sizes:
            for variant in args.variants:
                row: dict[str, Any] = {"batch_size": b, "context": context, "variant": str(variant)}
                try:
                    ms = time_kernel(flashinfer, variant, b, context, args, kv)
                except Exception as e:  # a variant the build lacks: say so, go on
                    traceback.print_exc()
                    row["error"] = f"{type(e).__name__}: {e}"
                    print(f"{b:>6} {context:>8} {str(variant):>22} failed: {row['error'][:80]}")
                else:
                    row["ms"] = ms
                    row["kv_tb_s"] = b * context * token_bytes / (ms * 1e-3) / 1e12
                    print(
                        f"{b:>6} {context:>8} {str(variant):>22} {ms:>8.3f} {row['kv_tb_s']:>8.2f}"
                    )
                rows.append(row)
                sys.stdout.flush()
    write_record(
        "benchmarks.kernels.bench_attention",
        argv if argv is not None else sys.argv[1:],
        {"shape": {**vars(args), "variants": [str(v) for v in args.variants]}, "rows": rows},
        args.output_file,
        "attention-decode",
        machine(args.device),
    )


if __name__ == "__main__":
    main()
