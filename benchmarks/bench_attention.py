"""Decode attention kernels by batch size: FlashInfer's tensor-core kernel
against its CUDA-core one, as the decode graphs run them.

For each batch size and context length, a KV pool shaped like the model's
(page-major, random pages per request) is planned once per kernel, then
``--layers`` attention calls (one per layer, as a decode step makes them) are
captured in a CUDA graph and the replay is timed on the device. Reports GPU
ms per step for both kernels and which is faster, so the batch size from which
the engine uses tensor cores can be set from a measurement::

    python benchmarks/bench_attention.py --batch-sizes 1 2 4 8 16 32 64 128 256 \\
        --context-lens 1024 4096
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import host_info, write_record  # noqa: E402


def time_kernel(
    fi: Any,
    tensor_cores: bool,
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
    indices = torch.randint(1, num_pages, (batch_size * pages_per_req,), generator=gen)
    indptr = torch.arange(0, batch_size + 1, dtype=torch.int32) * pages_per_req
    last = torch.full((batch_size,), context - (pages_per_req - 1) * ps, dtype=torch.int32)
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=device)
    buffers = (
        torch.empty(batch_size + 1, dtype=torch.int32, device=device),
        torch.empty(indices.numel(), dtype=torch.int32, device=device),
        torch.empty(batch_size, dtype=torch.int32, device=device),
    )
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
        workspace,
        "NHD",
        use_cuda_graph=True,
        use_tensor_cores=tensor_cores,
        paged_kv_indptr_buffer=buffers[0],
        paged_kv_indices_buffer=buffers[1],
        paged_kv_last_page_len_buffer=buffers[2],
    )
    wrapper.plan(
        indptr.pin_memory(),
        indices.to(torch.int32).to(device),
        last.pin_memory(),
        args.num_heads,
        args.num_kv_heads,
        args.head_dim,
        ps,
        q_data_type=kv.dtype,
        kv_data_type=kv.dtype,
    )
    q = torch.randn(batch_size, args.num_heads, args.head_dim, dtype=kv.dtype, device=device)
    out = torch.empty_like(q)
    cache = (kv[:, 0], kv[:, 1])

    def step() -> None:
        for _ in range(args.layers):
            wrapper.run(q, cache, out=out)

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        step()  # warm-up outside the graph
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        step()
    times = []
    for i in range(args.reps + 3):
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize(device)
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cuda:0", help="CUDA device (default: %(default)s)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--context-lens", type=int, nargs="+", default=[1024])
    ap.add_argument("--layers", type=int, default=32, help="calls per step (default: 32)")
    ap.add_argument("--num-heads", type=int, default=32, help="query heads (Llama-3.1-8B)")
    ap.add_argument("--num-kv-heads", type=int, default=8, help="KV heads (Llama-3.1-8B)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
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
    kv = torch.randn(
        most + 1,
        2,
        args.page_size,
        args.num_kv_heads,
        args.head_dim,
        dtype=torch.bfloat16,
        device=device,
    )
    rows = []
    print(f"{'batch':>6} {'context':>8} {'tensor-core ms':>15} {'cuda-core ms':>13} faster")
    for context in args.context_lens:
        for b in args.batch_sizes:
            tc = time_kernel(flashinfer, True, b, context, args, kv)
            cc = time_kernel(flashinfer, False, b, context, args, kv)
            faster = "tensor-core" if tc < cc else "cuda-core"
            rows.append(
                {"batch_size": b, "context": context, "tensor_core_ms": tc, "cuda_core_ms": cc}
            )
            print(f"{b:>6} {context:>8} {tc:>15.3f} {cc:>13.3f} {faster}", flush=True)
    write_record(
        "bench_attention",
        argv if argv is not None else sys.argv[1:],
        {"shape": vars(args), "rows": rows},
        args.output_file,
        "attention-decode",
        machine={**host_info(), "torch": torch.__version__, "gpu": torch.cuda.get_device_name()},
    )


if __name__ == "__main__":
    main()
