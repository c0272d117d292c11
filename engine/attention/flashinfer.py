"""Paged attention on CUDA with FlashInfer's batch kernels.

The pool's page-major layout gives each layer's keys and values as strided
views ``[num_pages, page_size, kv_heads, head_dim]`` (NHD within a page) whose
page stride spans all layers; FlashInfer reads the page table through those
strides, so no copy of the cache is made. K and V views share their strides.
"""

from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Iterable
from typing import Any, NamedTuple

import numpy as np
import torch

from engine.attention import fresh_prefill, paged_decode, rope_kv_write
from engine.attention.base import AttentionBackend, FreshIndex
from engine.attention.rope_kv_write import AppendIndex, QKPrologue
from engine.forward_batch import ForwardBatch
from engine.kvcache.pool import KV_FP8, KVPool

WORKSPACE_BYTES = 256 << 20
"""Scratch of the kernels (split-KV partial results); shared by every wrapper,
since forwards run one after another on one stream."""

KERNEL_HEAD_DIMS = (64, 128, 256)
TENSOR_CORE_MIN_GROUP = 4
"""Query heads per KV head from which decode runs on the tensor-core kernel.
Its plans keep FlashInfer's own KV split at every batch size: reading each
row's KV in one pass (``disable_split_kv``) from 32 rows up was faster alone
and in the batch-256 graph, but the serving loop at 64 streams gave a fifth
less output with it (docs/perf/2026-12-01-decode-attention-split.md)."""
KERNEL_DTYPES = (torch.bfloat16, torch.float16)
DECODE_CHUNK_PAGES = 0
"""The Triton decode kernel's chunks (``paged_decode.DecodePlan.chunk_pages``):
0, even ones over the plan's splits (which follow the batch size); N, chunks
of N pages and up whatever the batch, so a request's sums do not depend on
the batch it runs in."""
NUM_PLAN_SLOTS = 2
"""Plans alternate between this many wrapper sets. plan() writes the page table
into a pinned host buffer and queues its copy to the device; with the overlap
loop the host plans step N+1 while step N may still wait in the stream, so the
buffer of step N must not be rewritten: N+1 uses the other set."""


def flashinfer_usable(device: str, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether ``auto`` should pick this backend: CUDA, half precision, a head
    size the kernels are built for, and the package importable."""
    return (
        device.startswith("cuda")
        and dtype in KERNEL_DTYPES
        and head_dim in KERNEL_HEAD_DIMS
        and importlib.util.find_spec("flashinfer") is not None
    )


class TritonDecode(NamedTuple):
    """A forward's decode rows on ``engine.attention.paged_decode``: the
    plan and the page table (int32, on the device) it reads."""

    plan: paged_decode.DecodePlan
    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor
    scratch: paged_decode.Scratch | None


class _PlanSlot:
    """Wrappers that own one set of plan buffers (the page table and the
    kernels' work split, read by the kernels as they run), and the event that
    marks when the device is done with the last forward planned into them."""

    def __init__(self, fi: Any, workspace: torch.Tensor, tensor_cores: bool) -> None:
        self.fi, self.workspace, self.tensor_cores = fi, workspace, tensor_cores
        self.decode = fi.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_tensor_cores=tensor_cores
        )
        self.prefill = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        self.graph_decode: dict[int, tuple[Any, AppendIndex]] = {}
        """Batch size -> decode wrapper with fixed buffers (CUDA-graph replay) and
        the append index over the same buffers."""
        self.graph_indices: torch.Tensor | None = None
        """The page-index buffer every size's graph wrapper takes a prefix of:
        one forward at a time is planned into a slot, whatever its size."""
        self.consumed: torch.cuda.Event | None = None

    def graph_wrapper(self, batch_size: int, max_pages: int) -> tuple[Any, AppendIndex]:
        entry = self.graph_decode.get(batch_size)
        if entry is None:
            device = self.workspace.device

            def buf(n: int) -> torch.Tensor:
                return torch.zeros(n, dtype=torch.int32, device=device)

            # plan() fills the page-table buffers; the graph's append kernels
            # read the same ones, and positions copied in before each replay.
            index = AppendIndex(
                batch_indices=torch.arange(batch_size, dtype=torch.int32, device=device),
                positions=buf(batch_size),
                indptr=buf(batch_size + 1),
                indices=self._indices(max_pages),
                last_page_len=buf(batch_size),
            )
            wrapper = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=self.tensor_cores,
                paged_kv_indptr_buffer=index.indptr,
                paged_kv_indices_buffer=index.indices,
                paged_kv_last_page_len_buffer=index.last_page_len,
            )
            entry = self.graph_decode[batch_size] = (wrapper, index)
        return entry

    def _indices(self, n: int) -> torch.Tensor:
        if self.graph_indices is None or self.graph_indices.numel() < n:
            self.graph_indices = torch.zeros(n, dtype=torch.int32, device=self.workspace.device)
        return self.graph_indices[:n]

    def wait_reusable(self) -> None:
        if self.consumed is not None:
            self.consumed.synchronize()

    def release(self) -> None:
        """Every kernel of the forward planned here is queued: once the stream
        passes this point the buffers may be planned again."""
        if self.consumed is None:
            self.consumed = torch.cuda.Event()
        self.consumed.record()


class FlashInferAttention(AttentionBackend):
    def __init__(
        self,
        pool: KVPool,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        q_dtype: torch.dtype | None = None,
        fuse_prologue: bool = False,
        decode_kernel: str = "flashinfer",
    ) -> None:
        """``fuse_prologue``: layers hand their q/k norms, rotary embedding and
        KV scales to ``forward_fused``, which runs them with the KV write as
        one kernel (``engine.attention.rope_kv_write``). ``decode_kernel``:
        "triton" runs decode rows (a decode batch, a graph's, a mixed batch's
        leading ones) on ``engine.attention.paged_decode`` instead of
        FlashInfer's decode kernel; prefill rows stay on FlashInfer's."""
        super().__init__(pool, num_heads, num_kv_heads, head_dim, q_dtype)
        self.fuses_prologue = fuse_prologue and rope_kv_write.supports(head_dim)
        try:
            import flashinfer
            import flashinfer.page
        except ImportError as e:
            raise RuntimeError(
                "attention_backend 'flashinfer' needs the flashinfer-python package "
                "(pip install -e '.[gpu]')"
            ) from e
        if pool.kv.device.type != "cuda":
            raise RuntimeError("attention_backend 'flashinfer' runs on CUDA devices only")
        if self.q_dtype not in KERNEL_DTYPES or pool.kv.dtype not in (self.q_dtype, KV_FP8):
            raise RuntimeError(
                f"attention_backend 'flashinfer' needs bfloat16 or float16 queries and a KV "
                f"cache of their dtype or e4m3, not {self.q_dtype} and {pool.kv.dtype}"
            )
        self._fp8_kv = pool.kv.dtype == KV_FP8
        self._workspace = torch.empty(
            WORKSPACE_BYTES, dtype=torch.uint8, device=pool.kv.device
        ).zero_()
        # Grouped-query heads share each K/V read: with 4+ query heads per KV head
        # the tensor-core kernel is the faster decode
        # (docs/perf/2026-12-01-decode-step-fused-kernels-overlap.md).
        tensor_cores = num_heads // num_kv_heads >= TENSOR_CORE_MIN_GROUP
        self._slots = [
            _PlanSlot(flashinfer, self._workspace, tensor_cores) for _ in range(NUM_PLAN_SLOTS)
        ]
        self._append_kv = flashinfer.page.append_paged_kv_cache
        self._append: AppendIndex | None = None
        self._next_slot = 0
        self._current: _PlanSlot | None = None
        self._wrapper: Any = None
        self._num_decode_rows = 0
        """Leading rows of a mixed batch that run on the decode kernel (0: none)."""
        self._triton_decode = decode_kernel == "triton"
        self._triton: TritonDecode | None = None
        """This forward's decode rows on the Triton kernel (None: on FlashInfer's)."""
        self._sms = torch.cuda.get_device_properties(pool.kv.device).multi_processor_count
        """The GPU's SMs, which the Triton kernel's splits are planned to fill."""
        self._graph_scratch = paged_decode.SharedScratch(head_dim, pool.kv.device)
        """The Triton kernel's split scratch in the decode graphs, one for every
        size and slot."""

    # -- planning

    def _page_table(self, batch: ForwardBatch) -> tuple[list[int], list[int], list[int]]:
        """(indptr, indices, last page lengths) of the batch's page tables."""
        ps = self.pool.page_size
        indptr, indices, last_len = [0], [], []
        for seq_len, table in zip(batch.seq_lens, batch.page_tables):
            n = -(-seq_len // ps)
            indices.extend(table[:n])
            indptr.append(indptr[-1] + n)
            last_len.append(seq_len - (n - 1) * ps)
        return indptr, indices, last_len

    def _plan_args(
        self, indptr: list[int], indices: torch.Tensor, last_len: list[int]
    ) -> tuple[list[Any], dict[str, Any]]:
        """What both wrappers' plan() take after the query layout: the page
        table, the shapes and the dtypes. The page table goes in as host
        tensors (plan() schedules on the host and queues their copies), the
        page indices already on the device."""
        args = [
            _host(indptr),
            indices,
            _host(last_len),
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.pool.page_size,
        ]
        kwargs = {"q_data_type": self.q_dtype, "kv_data_type": self.pool.kv.dtype}
        return args, {**kwargs, "sm_scale": self.scale}

    def _take_slot(self, slot: int | None = None) -> _PlanSlot:
        if self._current is not None:
            self._current.release()  # the previous forward is fully queued
        if slot is None:
            slot = self.next_slot()
        s = self._slots[slot]
        s.wait_reusable()
        self._current = s
        return s

    def begin_forward(self, batch: ForwardBatch) -> None:
        slot = self._take_slot()
        indptr, indices, last_len = self._page_table(batch)
        token_requests = [i for i, n in enumerate(batch.extend_lens) for _ in range(n)]
        # One host-to-device copy for everything the append kernel indexes by.
        dev = _to_device([indices, indptr, last_len, token_requests], self.pool.kv.device)
        self._append = AppendIndex(
            batch_indices=dev[3],
            positions=batch.positions.to(torch.int32),
            indptr=dev[1],
            indices=dev[0],
            last_page_len=dev[2],
        )
        self._num_decode_rows = 0
        self._triton = None
        if batch.is_decode:
            if self._triton_decode:
                self._triton = self._triton_rows(len(last_len), dev[1], dev[0], dev[2])
                self._wrapper = None
                return
            args, kwargs = self._plan_args(indptr, dev[0], last_len)
            slot.decode.plan(*args, **kwargs)
            self._wrapper = slot.decode
            return
        # A mixed batch starts with its decoding requests (the scheduler puts
        # them first). Those rows go to the decode kernel: the prefill kernel
        # sizes its query tiles for the longest chunk, and one-token rows in
        # such tiles cost several times what the decode kernel takes for them.
        d = _leading_ones(batch.extend_lens)
        split = indptr[d]
        if d and self._triton_decode:
            self._triton = self._triton_rows(d, dev[1][: d + 1], dev[0], dev[2][:d])
            self._num_decode_rows = d
        elif d:
            args, kwargs = self._plan_args(indptr[: d + 1], dev[0][:split], last_len[:d])
            slot.decode.plan(*args, **kwargs)
            self._num_decode_rows = d
        qo_indptr = [0]
        for n in batch.extend_lens[d:]:
            qo_indptr.append(qo_indptr[-1] + n)
        args, kwargs = self._plan_args(
            [x - split for x in indptr[d:]], dev[0][split:], last_len[d:]
        )
        # The KV lengths go in pinned too: plan() copies them to the device, and
        # from the pageable tensor it would make of them, the copy waits for
        # the stream (the forward's first piece runs while this plans).
        seq_lens = _host(batch.seq_lens[d:])
        slot.prefill.plan(_host(qo_indptr), *args, causal=True, seq_lens=seq_lens, **kwargs)
        self._wrapper = slot.prefill

    # -- CUDA graphs (decode only)

    def begin_graph_forward(self, batch: ForwardBatch, slot: int, max_pages: int) -> None:
        """Plan a decode batch (already padded to a captured size) into the
        fixed buffers of ``slot``'s wrapper for that size; a graph captured
        after this call replays with whatever the latest plan of the same
        (slot, size) put there."""
        s = self._take_slot(slot)
        wrapper, index = s.graph_wrapper(batch.num_requests, max_pages)
        indptr, indices, last_len = self._page_table(batch)
        self._num_decode_rows = 0
        self._triton = None
        index.positions.copy_(batch.positions)
        self._append = index
        if self._triton_decode:
            # The graph's kernels read the slot's fixed buffers: the page table
            # goes there (FlashInfer's plan() would have put it there too).
            dev = _to_device([indices, indptr, last_len], self.pool.kv.device)
            index.indices[: len(indices)].copy_(dev[0])
            index.indptr.copy_(dev[1])
            index.last_page_len.copy_(dev[2])
            self._triton = self._triton_rows(
                batch.num_requests, index.indptr, index.indices, index.last_page_len, graph=True
            )
            self._wrapper = None
            return
        device_indices = _to_device([indices], self.pool.kv.device)[0]
        args, kwargs = self._plan_args(indptr, device_indices, last_len)
        wrapper.plan(*args, **kwargs)
        self._wrapper = wrapper

    def _triton_rows(
        self,
        rows: int,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_len: torch.Tensor,
        graph: bool = False,
    ) -> TritonDecode:
        """The plan of ``rows`` decode rows and its split scratch: for a
        graph, a prefix of the graphs' shared one; else one for this
        forward's layers."""
        plan = paged_decode.plan(
            rows,
            self.num_kv_heads,
            sms=self._sms,
            chunk_pages=DECODE_CHUNK_PAGES,
            e4m3=self.pool.kv.dtype == paged_decode.E4M3,
            group=self.num_heads // self.num_kv_heads,
        )
        if graph:
            scratch = self._graph_scratch.take(rows, self.num_heads, plan)
        else:
            scratch = paged_decode.scratch_for(
                rows, self.num_heads, self.head_dim, plan.partials, self.pool.kv.device
            )
        return TritonDecode(plan, indptr, indices, last_len, scratch)

    def next_slot(self) -> int:
        """The slot the next forward plans into (graphs are captured per slot)."""
        slot, self._next_slot = self._next_slot, (self._next_slot + 1) % NUM_PLAN_SLOTS
        return slot

    # -- the kernel

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        ix = self._append
        assert ix is not None, "begin_forward must come first"
        cache = (self.pool.k_layer(layer), self.pool.v_layer(layer))
        if self._fp8_kv:  # the append kernel copies rows of the cache's dtype
            k, v = self.pool.stored(k), self.pool.stored(v)
        self._append_kv(
            k, v, ix.batch_indices, ix.positions, cache, ix.indices, ix.indptr, ix.last_page_len
        )
        return self._attend(q, cache, out)

    def forward_fused(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        pre: QKPrologue,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        ix = self._append
        assert ix is not None, "begin_forward must come first"
        cache = (self.pool.k_layer(layer), self.pool.v_layer(layer))
        rope_kv_write.rope_kv_write(q, k, v, pre, *cache, ix)
        return self._attend(q, cache, out)

    def forward_fresh_fused(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        pre: QKPrologue,
        fresh: FreshIndex,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # Row i as request i of one page, write_pages[i], at position (slot)
        # write_slots[i]; k and v rewritten as the pages hold them, so the
        # plan-free kernel attends what a paged one would read.
        rows = fresh.rows
        index = AppendIndex(rows, fresh.write_slots, rows, fresh.write_pages, rows)
        cache = (self.pool.k_layer(layer), self.pool.v_layer(layer))
        rope_kv_write.rope_kv_write(q, k, v, pre, *cache, index, write_back=True)
        out = torch.empty_like(q) if out is None else out
        return self.attend_fresh(q, k, v, fresh.positions, out)

    def attend_fresh(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        out: torch.Tensor,
    ) -> torch.Tensor:
        # The Triton kernel over this forward's own k and v (no plan).
        return fresh_prefill.fresh_prefill(
            q, k, v, positions, out, self.scale, kv_e4m3=self._fp8_kv
        )

    def _attend(
        self, q: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor | None
    ) -> torch.Tensor:
        # q may be a strided view into the QKV projection: the kernels take its
        # row and head strides.
        # The output is always given: FlashInfer's prefill would otherwise
        # allocate it with torch.zeros (a memset kernel a layer).
        if out is None:
            out = q.new_empty(q.shape)
        if self._wrapper is None:  # a decode batch on the Triton kernel
            return self._decode_rows(q, cache, out)
        d = self._num_decode_rows
        if d:
            self._decode_rows(q[:d], cache, out[:d])
        self._wrapper.run(q[d:], cache, out=out[d:])
        return out

    def _decode_rows(
        self, q: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor
    ) -> torch.Tensor:
        t = self._triton
        if t is None:
            return self._current.decode.run(q, cache, out=out)
        return paged_decode.paged_decode(
            q, *cache, t.indptr, t.indices, t.last_page_len, out, self.scale, t.plan, t.scratch
        )


def _leading_ones(extend_lens: list[int]) -> int:
    """How many rows at the start of a batch add one token each."""
    d = 0
    for n in extend_lens:
        if n != 1:
            break
        d += 1
    return d


def _to_device(lists: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """int32 device tensors of ``lists``, moved in one copy from pinned memory (so
    the host never waits for the stream)."""
    sizes = [len(x) for x in lists]
    flat = _pinned(itertools.chain.from_iterable(lists), sum(sizes))
    return list(flat.to(device, non_blocking=True).split(sizes))


def _host(x: list[int]) -> torch.Tensor:
    """A pinned int32 host tensor. plan() reads indptr on the host to schedule
    and queues the copies to the device itself; from pinned memory those copies
    never make the host wait for the stream (the overlap loop depends on it)."""
    return _pinned(x, len(x))


def _pinned(values: Iterable[int], n: int) -> torch.Tensor:
    """``n`` ints in a pinned int32 tensor, through numpy: ``torch.tensor`` of a
    list takes about ten times as long per value, and a batch of 256 rows at
    1k context lists some 16k page indices every step."""
    out = torch.empty(n, dtype=torch.int32, pin_memory=True)
    out.numpy()[:] = np.fromiter(values, dtype=np.int32, count=n)
    return out
