"""CUDA graphs of the decode forward: one per (batch size, plan slot).

A decode step of a large model is hundreds of small kernels; launched one by
one from Python at batch 1 the host, not the GPU, sets the step time. Each
captured graph replays the whole forward (embedding, every layer with its KV
write and attention, final norm, logits) with one launch. Inputs live in
static buffers that every replay reads: a batch of ``b`` requests is copied in
and padded to the next captured size; padded rows write their K/V into the
reserved scratch page 0 and read only it.

The attention plan (page table, work split) is not part of the graph: it is
written into the slot's fixed buffers before each replay. Plans alternate
between slots (see ``engine.attention.flashinfer``), so each size is captured
once per slot.
"""

from __future__ import annotations

import torch

from engine.attention.flashinfer import NUM_PLAN_SLOTS, FlashInferAttention
from engine.forward_batch import ForwardBatch

DEFAULT_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)
MAX_EXPANDED_KV_TOKENS = 32768
"""Most KV tokens the prefill rows of a batch may read in all once each of their
tokens is a row of its own (see ``DecodeGraphs.as_decode_rows``); beyond it a
chunk is cheaper on the prefill kernel, which reads its prefix once."""


def capture_sizes(max_batch_size: int) -> list[int]:
    """The captured batch sizes up to ``max_batch_size`` (always including it)."""
    sizes = [s for s in DEFAULT_SIZES if s < max_batch_size]
    return [*sizes, max_batch_size]


def as_decode_rows(batch: ForwardBatch, max_rows: int) -> ForwardBatch | None:
    """``batch`` as a decode batch of at most ``max_rows`` rows, or None.

    A decode batch is its own answer. A batch with short prefill chunks
    becomes one row per new token: every token's K/V is appended first, then
    each row attends to its request's pages up to its own position, which is
    exactly causal attention within the chunk. The token tensors already hold
    one entry per token, so only the host-side lists change. A short prompt then
    costs one graph replay instead of hundreds of eager launches.
    """
    if batch.is_decode:
        return batch if batch.num_requests <= max_rows else None
    num_tokens = sum(batch.extend_lens)
    if num_tokens > max_rows:
        return None
    seq_lens: list[int] = []
    tables: list[list[int]] = []
    expanded = 0
    for seq_len, n, table in zip(batch.seq_lens, batch.extend_lens, batch.page_tables):
        if n > 1:
            expanded += n * seq_len
            if expanded > MAX_EXPANDED_KV_TOKENS:
                return None
        seq_lens.extend(range(seq_len - n + 1, seq_len + 1))
        tables.extend([table] * n)
    return batch._replace(seq_lens=seq_lens, extend_lens=[1] * num_tokens, page_tables=tables)


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        attn: FlashInferAttention,
        max_batch_size: int,
        max_pages_per_request: int,
    ) -> None:
        self.model = model
        self.attn = attn
        self.sizes = capture_sizes(max_batch_size)
        self.max_batch_size = max_batch_size
        device = attn.pool.kv.device
        self.device = device
        n = max_batch_size
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.write_pages = torch.zeros(n, dtype=torch.int64, device=device)
        self.write_slots = torch.zeros(n, dtype=torch.int64, device=device)
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=device)
        # Pages a replay's page table may list: each row's table is at most
        # ``max_pages_per_request`` long. The pool's size is no bound on the
        # sum: rows may list the same pages (a shared prefix). The index buffer
        # of one plan slot is shared by every size, so this costs little.
        self._max_pages = {s: s * max_pages_per_request for s in self.sizes}
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}
        """Each graph's logits; only read right after its replay (they may share
        memory with other graphs' intermediates in the common pool)."""
        self._pool: tuple[int, int] | None = None
        self._side = torch.cuda.Stream(device)
        """Warm-up and capture run here, off the device's current stream."""
        with torch.cuda.device(device):
            self._capture_all()

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.is_decode and 0 < batch.num_requests <= self.max_batch_size

    def as_decode_rows(self, batch: ForwardBatch) -> ForwardBatch | None:
        """``batch`` as a decode batch the graphs can replay, or None."""
        rows = as_decode_rows(batch, self.max_batch_size)
        return rows if rows is not None and self.can_run(rows) else None

    def _padded(self, batch: ForwardBatch, size: int) -> ForwardBatch:
        """``batch`` moved into the static buffers, padded to ``size`` rows."""
        b, pad = batch.num_requests, size - batch.num_requests
        for dst, src in (
            (self.input_ids, batch.input_ids),
            (self.positions, batch.positions),
            (self.write_pages, batch.write_pages),
            (self.write_slots, batch.write_slots),
        ):
            dst[:b].copy_(src, non_blocking=True)
            if pad:
                dst[b:size].zero_()
        return self._static_batch(
            [*batch.seq_lens, *([1] * pad)], [*batch.page_tables, *([[0]] * pad)]
        )

    def _static_batch(self, seq_lens: list[int], page_tables: list[list[int]]) -> ForwardBatch:
        """A decode batch over the first ``len(seq_lens)`` rows of the static buffers."""
        size = len(seq_lens)
        return ForwardBatch(
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            seq_lens=seq_lens,
            extend_lens=[1] * size,
            page_tables=page_tables,
            write_pages=self.write_pages[:size],
            write_slots=self.write_slots[:size],
            logits_indices=self.logits_indices[:size],
        )

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.model(batch.input_ids, batch.positions, self.attn)
        return self.model.compute_logits(hidden)

    def _capture_all(self) -> None:
        # Largest first: smaller graphs then reuse the memory pool's blocks. The
        # static buffers hold zeros: every captured row writes and reads page 0.
        for size in reversed(self.sizes):
            batch = self._static_batch([1] * size, [[0]] * size)
            for slot in range(NUM_PLAN_SLOTS):
                self.attn.begin_graph_forward(batch, slot, self._max_pages[size])
                side = self._side
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    for _ in range(2):  # warm-up outside the graph (lazy inits)
                        self._forward(batch)
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                # An explicit stream: torch's default capture stream is made once
                # per process, on whichever device captured first.
                with torch.cuda.graph(graph, pool=self._pool, stream=side):
                    out = self._forward(batch)
                self._pool = graph.pool()
                self.graphs[(size, slot)] = graph
                self._outputs[(size, slot)] = out
        torch.cuda.synchronize(self.device)

    def prepare(self, batch: ForwardBatch) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The graph that runs the decode batch ``batch`` (``can_run``) with
        its inputs copied in and its attention planned, ready to replay, and
        the logits it writes (padded rows included: only read right after its
        replay)."""
        size = next(s for s in self.sizes if s >= batch.num_requests)
        padded = self._padded(batch, size)
        slot = self.attn.next_slot()
        self.attn.begin_graph_forward(padded, slot, self._max_pages[size])
        return self.graphs[(size, slot)], self._outputs[(size, slot)]

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits of the ``batch.logits_indices`` rows of a decode batch of
        ``b <= max_batch_size`` rows (``can_run``)."""
        b = batch.num_requests
        graph, out = self.prepare(batch)
        graph.replay()
        logits = out[:b]
        if batch.logits_indices.numel() == b:  # every row samples: decode
            return logits
        return logits[batch.logits_indices]
