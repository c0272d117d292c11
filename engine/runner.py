"""ModelRunner: owns the model, the KV pool and the attention backend, and runs
one ``ForwardBatch`` at a time."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import NamedTuple

import torch

from engine import grammar
from engine import sampling as sampler
from engine.attention import get_attention_backend, rope_kv_write
from engine.attention.base import AttentionBackend
from engine.attention.flashinfer import FlashInferAttention
from engine.config import EngineConfig
from engine.cuda_graph import DecodeGraphs
from engine.forward_batch import ExtendSpec, ForwardBatch, build_forward_batch
from engine.kvcache.pool import KV_FP8, KVPool, KVPoolConfig, kv_cache_dtype
from engine.layers import moe
from engine.layers.kernels import layer_kernels
from engine.memory import MemoryPlan, peak_bytes
from engine.model_config import ModelConfig
from engine.models import build_model
from engine.parallel.group import TPGroup
from engine.parallel.layers import local_heads
from engine.piece_graphs import PieceGraphs, bucket_sizes
from engine.sampling import SamplingBatch, sample
from engine.weights import init_dummy_weights, iter_safetensors
from protocol.sampling import SamplingParams

log = logging.getLogger(__name__)


class StartTimes:
    """Seconds each part of a runner's start took, in order (logged once it
    is ready, so that a slow start says where its time went)."""

    def __init__(self) -> None:
        self._t0 = self._last = time.perf_counter()
        self.parts: dict[str, float] = {}

    def done(self, part: str) -> None:
        now = time.perf_counter()
        self.parts[part] = self.parts.get(part, 0.0) + now - self._last
        self._last = now

    def describe(self) -> str:
        parts = ", ".join(f"{name} {s:.1f}" for name, s in self.parts.items())
        return f"ready in {self._last - self._t0:.1f} s ({parts})"


class HostValues(NamedTuple):
    """A forward's sampled values as Python lists."""

    token_ids: list[int]
    logprobs: list[float]
    top_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None


class ForwardOutput(NamedTuple):
    token_ids: torch.Tensor
    """``[num_sampled]`` next token of each request that asked for logits."""
    logprobs: torch.Tensor
    """``[num_sampled]`` log-probability of that token under the raw logits."""
    top_ids: torch.Tensor | None = None
    """``[num_sampled, k]`` most likely tokens, when some request asked for them."""
    top_logprobs: torch.Tensor | None = None
    copied: torch.cuda.Event | None = None
    """On CUDA: recorded after the copies of the fields above into ``host``
    were queued, right behind the sampling. Reading the results waits for this
    event, not for the stream: with the overlap loop the next forward is
    already queued behind it, and a plain ``tolist()`` would wait for that one
    too, leaving the device idle while the host then processes and schedules."""
    host: tuple[torch.Tensor | None, ...] | None = None

    def to_host(self) -> HostValues:
        """The values as lists (waits until the device has produced them)."""
        if self.token_ids.numel() == 0:
            return HostValues([], [], None, None)
        if self.copied is None:
            fields = (self.token_ids, self.logprobs, self.top_ids, self.top_logprobs)
        else:
            self.copied.synchronize()
            assert self.host is not None
            fields = self.host
        ids, lps, top_ids, top_lps = (None if t is None else t.tolist() for t in fields)
        assert ids is not None and lps is not None
        return HostValues(ids, lps, top_ids, top_lps)

    def with_host_copy(self) -> ForwardOutput:
        """This output with its copy to pinned host memory queued (CUDA only)."""
        if not self.token_ids.is_cuda:
            return self
        host = tuple(
            None if t is None else t.to("cpu", non_blocking=True)
            for t in (self.token_ids, self.logprobs, self.top_ids, self.top_logprobs)
        )
        event = torch.cuda.Event()
        event.record()
        return self._replace(copied=event, host=host)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    # Parameters are created directly in the serving dtype and device so a
    # large model never needs a float32 copy of itself.
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


class ModelRunner:
    def __init__(
        self, config: EngineConfig, model_config: ModelConfig, tp: TPGroup | None = None
    ) -> None:
        """``tp``: this runner is one rank of a tensor-parallel group; it holds
        its shard of the model and a pool of its own KV heads. ``config`` is
        resolved (``EngineConfig.resolve``); where it leaves ``num_pages``
        unset the pool is sized from the device's memory (``engine.memory``),
        and ``self.config`` is the config with the size filled in."""
        assert config.context_length is not None, "EngineConfig must be resolved first"
        times = StartTimes()
        model_config = model_config.with_quantization(config.quantization, config.quantize_lm_head)
        self.model_config = model_config
        self.tp = tp
        self.device = torch.device(config.device)
        start = None
        if self.device.type == "cuda":
            # Kernels without an explicit device (graph capture, library
            # workspaces) go to the current device: make it this one.
            torch.cuda.set_device(self.device)
            if config.num_pages is None:
                # Read before this engine allocates anything.
                start = (
                    *torch.cuda.mem_get_info(self.device),
                    torch.cuda.memory_allocated(self.device),
                )
        # FlashInfer's fused layer kernels come with its attention; the torch
        # attention backend is the reference, so it gets the reference kernels.
        kernels = layer_kernels(
            "flashinfer" if config.attention_backend == "flashinfer" else "torch"
        )
        with _default_dtype(model_config.dtype), torch.device(self.device):
            self.model = build_model(model_config, kernels, tp)
        self.model.eval().requires_grad_(False)
        if config.load_format == "dummy":
            init_dummy_weights(self.model, config.seed)
        else:
            self.model.load_weights(iter_safetensors(config.model))
        self.model.tie_head()
        times.done("weights")
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, model_config.dtype)
        """The KV pool's dtype (``--kv-cache-dtype`` resolved against the model's)."""
        if self.kv_dtype == KV_FP8:
            scaled = self.model.scale_kv()
            if scaled:
                log.info("KV pool: e4m3 with the checkpoint's K/V scales in %d layers", scaled)
        if self.device.type == "cuda":
            # Compiled now rather than under the first requests of a new shape.
            with torch.inference_mode():
                moe.warm_up(self.model, config.token_budget)
            times.done("experts' kernels")
        self.num_heads, self.num_kv_heads = local_heads(model_config, tp)
        self.pool_sizing: dict[str, object] = {"sized_by": config.pool_sized_by}
        """How the KV pool was sized (for /server_info and the start-up log)."""
        num_pages = self._allocate_pool(config, start)
        config, warning = config.with_pool(num_pages)
        if warning:
            log.warning("%s", warning)
        self.config = config
        self.pool_sizing.update(
            num_pages=num_pages,
            max_tokens=self.pool.allocator.capacity * config.page_size,
            gib=round(num_pages * self.pool.config.page_bytes / (1 << 30), 3),
        )
        times.done("KV pool")
        self.attn = self._attention(self.pool, config)
        if self.attn.fuses_prologue:
            with torch.inference_mode():
                rope_kv_write.warm_up(
                    self.pool, self.num_heads, model_config.qk_norm, model_config.dtype
                )
        times.done("attention")
        self.graphs: DecodeGraphs | None = None
        if config.cuda_graph_max_bs:
            self.capture_decode_graphs()
            times.done("decode graphs")
        self.pieces: PieceGraphs | None = None
        """Prefill and mixed forwards of up to ``cuda_graph_max_tokens`` tokens."""
        if config.cuda_graph_max_tokens:
            with torch.inference_mode():
                fresh = self.attn if config.fresh_prefill_graphs else None
                self.pieces = PieceGraphs(
                    self.model, self.device, config.cuda_graph_max_tokens, fresh=fresh
                )
            times.done("piecewise graphs")
            log.info(
                "piecewise CUDA graphs: %d token counts up to %d captured in %.1f s",
                len(self.pieces.sizes),
                self.pieces.max_tokens,
                times.parts["piecewise graphs"],
            )
        if self.device.type == "cuda":
            # Compiled now rather than under the first request of each kind.
            with torch.inference_mode():
                sampler.warm_up(model_config.vocab_size, self.device)
                grammar.warm_up(model_config.vocab_size, self.device)
            times.done("sampler and grammar kernels")
        self.start_times = times
        """Where the start's time went (``Engine`` adds its own parts and logs it)."""

    def _allocate_pool(self, config: EngineConfig, start: tuple[int, int, int] | None) -> int:
        """Allocate ``self.pool`` with ``config.num_pages`` pages, or where that
        is unset as many as ``engine.memory``'s rule gives (``start``: the
        device's free and total memory, and what this process had allocated,
        before the weights); returns the page count."""
        num_pages, plan = config.num_pages, None
        if num_pages is None:
            assert start is not None, "EngineConfig must be resolved first"
            plan = self._memory_plan(config, *start)
            num_pages = plan.num_pages
            if self.tp is not None:  # every rank holds the same pages
                num_pages = self.tp.all_min(num_pages)
            log.info("KV pool: %d pages; %s", num_pages, plan.describe())
        try:
            self.pool = KVPool(self._pool_config(num_pages, config))
        except torch.OutOfMemoryError:
            # Another engine on this GPU took memory between the reading and
            # the allocation (they started together): size again from what
            # is free now, once. Ranks of a group must agree, so they do not.
            if plan is None or self.tp is not None:
                raise
            plan = replace(plan, free_before_pool=torch.cuda.mem_get_info(self.device)[0])
            num_pages = plan.num_pages
            log.warning(
                "KV pool: memory was taken meanwhile: %d pages; %s", num_pages, plan.describe()
            )
            self.pool = KVPool(self._pool_config(num_pages, config))
        if plan is not None:
            self.pool_sizing.update(plan.as_dict())
        return num_pages

    def _pool_config(self, num_pages: int, config: EngineConfig) -> KVPoolConfig:
        return KVPoolConfig(
            num_pages=num_pages,
            page_size=config.page_size,
            num_layers=self.model_config.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.model_config.head_dim,
            dtype=self.kv_dtype,
            device=config.device,
        )

    def _attention(self, pool: KVPool, config: EngineConfig) -> AttentionBackend:
        # resolve() allows the fused prologue and the Triton decode kernel with
        # flashinfer attention only.
        fused = {"fuse_prologue": True} if config.fuse_rope_kv_write else {}
        if config.decode_kernel != "flashinfer":
            fused["decode_kernel"] = config.decode_kernel
        return get_attention_backend(config.attention_backend)(
            pool,
            self.num_heads,
            self.num_kv_heads,
            self.model_config.head_dim,
            q_dtype=self.model_config.dtype,
            **fused,
        )

    def _memory_plan(
        self, config: EngineConfig, free: int, total: int, weights_from: int
    ) -> MemoryPlan:
        """The numbers of ``engine.memory``'s rule, measured on this device."""
        weights = torch.cuda.memory_allocated(self.device) - weights_from
        activations, graphs = self._profile(config)
        torch.cuda.empty_cache()  # the throw-away pool and its activations
        torch.cuda.synchronize(self.device)
        mc = self.model_config
        return MemoryPlan(
            total=total,
            free_at_start=free,
            utilization=config.gpu_memory_utilization,
            weights=weights,
            activations=activations,
            graphs=graphs,
            free_before_pool=torch.cuda.mem_get_info(self.device)[0],
            page_bytes=KVPoolConfig.bytes_per_page(
                config.page_size,
                mc.num_layers,
                self.num_kv_heads,
                mc.head_dim,
                self.kv_dtype,
            ),
        )

    @torch.inference_mode()
    def _profile(self, config: EngineConfig) -> tuple[int, int]:
        """Peak bytes of one forward of the token budget over the largest batch
        (logits and sampling included), and what the graphs' pools will hold:
        one decode forward at the largest graph size plus one forward of the
        piecewise graphs' largest bucket, each on a throw-away pool that holds
        just them."""
        page, vocab = config.page_size, self.model_config.vocab_size
        tokens = config.token_budget
        rows = min(config.max_running_requests, tokens)
        lens = [tokens // rows + (i < tokens % rows) for i in range(rows)]
        graph_rows = config.cuda_graph_max_bs or 0
        graph_tokens = config.cuda_graph_max_tokens or 0
        pages = max(sum(-(-n // page) for n in lens), graph_rows, -(-graph_tokens // page)) + 1
        attn = self._attention(KVPool(self._pool_config(pages, config)), config)

        def forward(lengths: list[int], sampled: bool) -> None:
            specs, first = [], 1
            for n in lengths:
                table = list(range(first, first + -(-n // page)))
                first += len(table)
                specs.append(ExtendSpec([i % vocab for i in range(n)], 0, table))
            batch = build_forward_batch(specs, page, self.device)
            attn.begin_forward(batch)
            hidden = self.model(batch.input_ids, batch.positions, attn)
            logits = self.model.compute_logits(hidden[batch.logits_indices])
            if sampled:
                n = len(lengths)
                params = SamplingBatch.build(
                    [SamplingParams()] * n, range(n), [0] * n, vocab, self.device
                )
                sample(logits, params)

        activations = peak_bytes(self.device, lambda: forward(lens, True))
        graphs = 0
        if graph_rows:
            graphs += peak_bytes(self.device, lambda: forward([1] * graph_rows, False))
        if graph_tokens:
            graphs += peak_bytes(self.device, lambda: forward([graph_tokens], False))
        if graph_tokens and config.fresh_prefill_graphs:
            # Every bucket's whole-forward graph keeps its output in the pool.
            rows = sum(bucket_sizes(graph_tokens))
            graphs += rows * self.model_config.hidden_size * self.model_config.dtype.itemsize
        return activations, graphs

    def capture_decode_graphs(self) -> None:
        """(Re)capture the decode graphs up to ``cuda_graph_max_bs`` rows, the
        old ones released first (a benchmark's kernel setting changed between
        captures: ``benchmarks.bench_engine --prefetch-bytes``)."""
        config = self.config
        assert isinstance(self.attn, FlashInferAttention)
        if self.graphs is not None:  # their memory back before the new ones take theirs
            self.graphs = None
            torch.cuda.empty_cache()
        with torch.inference_mode():
            self.graphs = DecodeGraphs(
                self.model,
                self.attn,
                config.cuda_graph_max_bs,
                max_pages_per_request=-(-config.context_length // config.page_size),
            )

    @property
    def graph_max_bs(self) -> int:
        """Largest decode batch replayed as a CUDA graph (0: none)."""
        return self.graphs.max_batch_size if self.graphs is not None else 0

    @property
    def rank_pids(self) -> list[int]:
        """Process ids of the group's other ranks (none on one device)."""
        return []

    def failure(self) -> str | None:
        """Why this runner can no longer run forwards (a rank of its group is
        gone), or None."""
        return None

    def close(self) -> None:
        """Release what the runner started beyond its own memory (rank processes)."""

    @torch.inference_mode()
    def forward_logits(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits ``[len(batch.logits_indices), vocab]`` in float32."""
        if self.graphs is not None:
            rows = self.graphs.as_decode_rows(batch)
            if rows is not None:
                return self.graphs.run(rows)
        if self.pieces is not None and self.pieces.can_run_fresh(batch):
            hidden = self.pieces.run_fresh(batch)  # one graph, no plan
        elif self.pieces is not None and self.pieces.can_run(batch):
            hidden = self.pieces.run(batch, self.attn)  # plans attention itself
        else:
            self.attn.begin_forward(batch)
            hidden = self.model(batch.input_ids, batch.positions, self.attn)
        return self.model.compute_logits(hidden[batch.logits_indices])

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, sampling: SamplingBatch | None, top_logprobs: int = 0
    ) -> ForwardOutput:
        return self.sample_logits(self.forward_logits(batch), sampling, top_logprobs)

    @torch.inference_mode()
    def sample_logits(
        self, logits: torch.Tensor, sampling: SamplingBatch | None, top_logprobs: int = 0
    ) -> ForwardOutput:
        """Sample one token per row of ``logits`` (a forward's, or some of its rows)."""
        if sampling is None or logits.shape[0] == 0:
            empty = torch.empty(0, dtype=torch.int64, device=self.device)
            return ForwardOutput(empty, empty.float())
        out = sample(logits, sampling)
        if top_logprobs == 0:
            return ForwardOutput(out.token_ids, out.logprobs).with_host_copy()
        top = logits.float().log_softmax(-1).topk(min(top_logprobs, logits.shape[-1]), dim=-1)
        return ForwardOutput(out.token_ids, out.logprobs, top.indices, top.values).with_host_copy()
