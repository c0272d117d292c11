"""CUDA graphs of prefill and mixed forwards, in pieces between attention calls.

A forward of a few hundred to a few thousand tokens (a prompt, or decode rows
plus a prefill chunk) launches some ten kernels a layer, and from Python each
launch costs the host tens of microseconds: at FP8 a 1024-token prompt takes
the host longer to queue than the GPU to run. The decode graphs
(``engine.cuda_graph``) cannot take these batches: their attention is planned
per batch for the prefill kernel, whose work split depends on every
request's lengths. So the forward is captured in pieces, cut at attention:

    piece 0      embedding, layer 0 up to its QKV projection
    attention 0  run eagerly (``Attention.core``: rotary, KV write, kernel)
    piece 1      layer 0 from its o projection, layer 1 up to its QKV projection
    ...
    piece L      layer L-1 from its o projection, the final norm

One set of graphs per bucket of token counts; a forward of ``n`` tokens runs
the smallest bucket ``>= n``, its rows past ``n`` padding that attention never
sees (rows are independent everywhere else). Attention runs on the first ``n``
rows of the QKV output and writes into a static buffer the next piece reads.

Fresh prompts (``fresh``: every request from position 0, no cached prefix, as
a lone new prompt is) need no cut: ``AttentionBackend.forward_fresh`` attends
a forward's own K/V without a plan, so the whole forward, attention
included, is one graph per bucket, and the host's work for it is a few
copies into its inputs. No real row attends a padding row (they come after
every real row, and a row attends only rows of its prompt up to itself);
padding rows are given position 0, so each is a prompt of its own row and
attends that row alone (stale positions would make them attend up to a
bucket of rows for outputs never read), and write their K/V into the
scratch page 0 at whatever slots the buffer held.

Memory: the pieces of every bucket share one pool, captured in the order they
replay. A piece's outputs are released once the next piece is captured, so
later captures reuse their blocks; the eager attention reads a piece's QKV
output through a view that does not own it (``_borrowed``), valid from that
piece's replay until the next one. Graph outputs are only read in that window.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine.attention.base import AttentionBackend, FreshIndex
from engine.forward_batch import ForwardBatch

SMALLEST = 64


def bucket_sizes(max_tokens: int) -> list[int]:
    """The captured token counts up to ``max_tokens`` (always including it):
    steps of 64, and past 512 an eighth of the power of two below (128 from
    1024, 256 from 2048, ...), so a forward of more than 512 tokens pads by
    less than an eighth of itself."""
    sizes, s = [], SMALLEST
    while s < max_tokens:
        sizes.append(s)
        s += max(SMALLEST, (1 << (s.bit_length() - 1)) // 8)
    return [*sizes, max_tokens]


def _borrowed(t: torch.Tensor) -> torch.Tensor:
    """``t``'s view without a claim on its memory: the caching allocator may
    hand the block to a later capture of the same pool (see the module's doc)."""
    storage = torch._C._construct_storage_from_data_pointer(
        t.untyped_storage().data_ptr(), t.device, t.untyped_storage().nbytes()
    )
    view = torch.empty(0, dtype=t.dtype, device=t.device)
    return view.set_(storage, t.storage_offset(), t.shape, t.stride())


class _Bucket:
    """The graphs of one token count: ``graphs[i]`` is piece ``i``; ``qkv[i]``
    the QKV output of piece ``i`` (borrowed); ``hidden`` the last piece's output."""

    def __init__(self) -> None:
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.qkv: list[torch.Tensor] = []
        self.hidden: torch.Tensor | None = None
        self.fresh: torch.cuda.CUDAGraph | None = None
        """The whole forward of fresh prompts (with ``PieceGraphs``' ``fresh``)."""
        self.fresh_hidden: torch.Tensor | None = None


class PieceGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        max_tokens: int,
        capture: bool = True,
        fresh: AttentionBackend | None = None,
    ) -> None:
        """``model``: a decoder of ``engine.models.llama`` with at least one
        layer. ``capture`` False: the same pieces, buffers and padding run
        eagerly on any device (no graphs), as a reference for the replays.
        ``fresh``: the backend whose ``forward_fresh`` the whole-forward graphs
        of fresh prompts take; None: none."""
        self.model = model
        self.layers = list(model.model.layers)
        assert self.layers, "piecewise graphs need a model with layers"
        self.max_tokens = max_tokens
        self.sizes = bucket_sizes(max_tokens)
        self.device = device
        attn0 = self.layers[0].self_attn
        dtype = model.model.embed_tokens.weight.dtype
        self.dtype = dtype
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.attn_out = torch.zeros(max_tokens, attn0.q_size, dtype=dtype, device=device)
        """What each piece after the first reads: the attention before it."""
        self._attn_heads = self.attn_out.view(max_tokens, attn0.num_heads, attn0.head_dim)
        """The same buffer as the attention kernels write it."""
        self._buckets: dict[int, _Bucket] = {}
        self._pool: tuple[int, int] | None = None
        self.fresh_attn = fresh
        self.fresh_index = FreshIndex(
            *(torch.zeros_like(self.input_ids) for _ in range(3)),
            torch.arange(max_tokens, device=device),
        )
        """The whole-forward graphs' inputs beside the token ids."""
        if not capture:
            return
        self._side = torch.cuda.Stream(device)
        with torch.cuda.device(device):
            for size in reversed(self.sizes):  # largest first: the pool's blocks fit the rest
                self._buckets[size] = self._capture(size)
            if fresh is not None:  # after the pieces, in the same pool (never run together)
                for size in reversed(self.sizes):
                    self._capture_fresh(size, self._buckets[size])
            torch.cuda.synchronize(device)

    def can_run(self, batch: ForwardBatch) -> bool:
        return 0 < batch.input_ids.numel() <= self.max_tokens

    def can_run_fresh(self, batch: ForwardBatch) -> bool:
        """Whether ``batch`` is fresh prompts these graphs take whole: every
        request from position 0 (its new tokens are all its tokens)."""
        return (
            self.fresh_attn is not None
            and self.can_run(batch)
            and batch.seq_lens == batch.extend_lens
        )

    def _pieces(self, size: int) -> list[Callable[[Any], Any]]:
        """Piece ``i`` as a function of piece ``i - 1``'s ``(qkv, residual)``."""
        ids, attn_out, layers = self.input_ids[:size], self.attn_out[:size], self.layers

        def first(_: Any) -> Any:
            return layers[0].pre(self.model.model.embed_tokens(ids), None)

        def middle(i: int) -> Callable[[Any], Any]:
            def piece(prev: Any) -> Any:
                h, residual = layers[i - 1].post(attn_out, prev[1])
                return layers[i].pre(h, residual)

            return piece

        def last(prev: Any) -> Any:
            return self.model.final_norm(*layers[-1].post(attn_out, prev[1]))

        return [first, *(middle(i) for i in range(1, len(layers))), last]

    def _warm_up(self, run: Callable[[], Any]) -> None:
        """``run`` once on the capture stream, outside any graph (compiles,
        lazy inits)."""
        side, current = self._side, torch.cuda.current_stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            run()
        current.wait_stream(side)

    def _capture(self, size: int) -> _Bucket:
        pieces = self._pieces(size)

        def warm() -> None:
            out: Any = None
            for piece in pieces:
                out = piece(out)

        self._warm_up(warm)
        bucket, out = _Bucket(), None
        for i, piece in enumerate(pieces):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=self._side):
                new = piece(out)
            self._pool = graph.pool()
            bucket.graphs.append(graph)
            out = new  # the previous piece's outputs are free for later captures
            if i < len(self.layers):
                bucket.qkv.append(_borrowed(out[0]))
        bucket.hidden = out
        return bucket

    def _interleaved(
        self,
        pieces: list[Callable[[Any], Any]],
        out: Any,
        attention: Callable[[int, torch.Tensor], None],
    ) -> Any:
        """The pieces after the first, run eagerly from its output ``out``,
        with layer ``i``'s ``attention(i, qkv)`` before piece ``i + 1``."""
        for i, piece in enumerate(pieces[1:]):
            attention(i, out[0])
            out = piece(out)
        return out

    def _whole(self, size: int) -> torch.Tensor:
        """The whole forward of ``size`` rows of fresh prompts (its inputs in
        ``input_ids`` and ``fresh_index``): hidden states after the final norm."""
        assert self.fresh_attn is not None
        fresh = FreshIndex(*(t[:size] for t in self.fresh_index))
        rope = self.model.rotary.prepare(fresh.positions, self.dtype)
        heads, attn = self._attn_heads[:size], self.fresh_attn

        def attention(i: int, qkv: torch.Tensor) -> None:
            self.layers[i].self_attn.core(qkv, rope, attn, heads, fresh)

        pieces = self._pieces(size)
        return self._interleaved(pieces, pieces[0](None), attention)

    def _capture_fresh(self, size: int, bucket: _Bucket) -> None:
        self._warm_up(lambda: self._whole(size))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=self._side):
            bucket.fresh_hidden = self._whole(size)
        bucket.fresh = graph

    def _take_ids(self, batch: ForwardBatch) -> tuple[int, int]:
        """The batch's token ids copied into the graphs' input; its rows and
        their bucket."""
        n = batch.input_ids.numel()
        self.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
        return n, next(s for s in self.sizes if s >= n)

    def run_fresh(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states ``[n, hidden]`` after the final norm of ``batch``'s
        ``n`` tokens (``can_run_fresh``), its attention included in one graph,
        with no plan. Only valid until the next forward on these graphs."""
        n, size = self._take_ids(batch)
        positions, pages, slots, _ = self.fresh_index
        positions[:n].copy_(batch.positions, non_blocking=True)
        pages[:n].copy_(batch.write_pages, non_blocking=True)
        slots[:n].copy_(batch.write_slots, non_blocking=True)
        positions[n:size].zero_()  # the padding attends itself alone
        pages[n:size].zero_()  # the padding's K/V into the scratch page
        bucket = self._buckets.get(size)
        if bucket is None or bucket.fresh is None:  # not captured: eagerly
            return self._whole(size)[:n]
        bucket.fresh.replay()
        assert bucket.fresh_hidden is not None
        return bucket.fresh_hidden[:n]

    def run(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Hidden states ``[n, hidden]`` after the final norm of ``batch``'s
        ``n`` tokens (``can_run``). Only valid until the next forward on these
        graphs.

        Attention is planned here (``attn.begin_forward``), after the first
        piece is queued: that piece reads only the token ids, so the device
        runs it while the host plans (a plan is the longest host work
        before the first attention call)."""
        n, size = self._take_ids(batch)
        heads = self._attn_heads[:n]
        bucket = self._buckets.get(size)
        pieces = self._pieces(size) if bucket is None else bucket.graphs
        first = pieces[0](None) if bucket is None else pieces[0].replay()
        attn.begin_forward(batch)
        rope = self.model.rotary.prepare(batch.positions, self.dtype)

        def attention(i: int, qkv: torch.Tensor) -> None:
            self.layers[i].self_attn.core(qkv[:n], rope, attn, heads)

        if bucket is None:  # not captured: the pieces eagerly
            return self._interleaved(pieces, first, attention)[:n]
        for i, (graph, qkv) in enumerate(zip(bucket.graphs[1:], bucket.qkv)):
            attention(i, qkv)
            graph.replay()
        assert bucket.hidden is not None
        return bucket.hidden[:n]
