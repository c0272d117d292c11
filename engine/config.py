"""Engine configuration: the runtime knobs of one engine.

``EngineConfig`` is frozen and torch-free, so the worker's front process and
its command line use it without loading torch. Each field is a ``setting``
(``protocol.settings``): its default and its help text live here, once, and
the worker's command line (``worker.cli``) is generated from them
(``--page-size`` for ``page_size``, the type from the annotation). Values that start as "auto" or ``None`` are
resolved by building a new config (``resolve_model_and_device``, ``resolve``).

The model's own configuration (``ModelConfig``, read from ``config.json``)
lives in ``engine.model_config``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from engine.attention import ATTENTION_BACKENDS, DECODE_KERNELS
from engine.quantization import KV_CACHE_DTYPES, QUANTIZATIONS
from protocol.settings import setting

if TYPE_CHECKING:
    import torch

    from engine.model_config import ModelConfig

LOAD_FORMATS = ("auto", "dummy")
ATTENTION_CHOICES = ("auto", *sorted(ATTENTION_BACKENDS))
"""``auto`` plus the registered attention backends."""
DECODE_KERNEL_CHOICES = ("auto", *DECODE_KERNELS)
"""``auto`` plus the flashinfer backend's decode kernels."""

CUDA_TOKEN_BUDGET = 8192
"""Tokens per forward on CUDA (see the token-budget table in the docs)."""
CPU_TOKEN_BUDGET = 2048
PIECE_GRAPH_TOKENS = 2048
"""Largest forward the piecewise CUDA graphs take by default (``cuda_graph_max_tokens``)."""
CPU_KV_CACHE_GB = 0.25
"""The KV pool off CUDA, where the device's memory is the host's."""

MODEL_GROUP = "model"
KV_GROUP = "KV cache and scheduling"


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = setting(
        None,
        help="checkpoint directory (config.json, tokenizer, safetensors), Hugging Face "
        "repo id (org/name, downloaded on first use), or a preset name with --load-format "
        "dummy (llama-3.1-8b, qwen3-8b, ...) (default: the built-in tiny model)",
        group=MODEL_GROUP,
    )
    """None stands for the built-in tiny model, written on first use by
    ``resolve_model_and_device`` (an engine needs a concrete model)."""
    load_format: str = setting(
        "auto",
        help="auto: weights from the checkpoint; dummy: random weights (default: %(default)s)",
        group=MODEL_GROUP,
        choices=LOAD_FORMATS,
    )
    quantization: str | None = setting(
        None,
        help="fp8: the attention and MLP weights in e4m3 with a scale per output channel, "
        "quantized at load from a bf16 checkpoint (an FP8 checkpoint is read as FP8 "
        "without it); activations scaled per token (default: as the checkpoint is)",
        group=MODEL_GROUP,
        choices=QUANTIZATIONS,
    )
    quantize_lm_head: bool = setting(
        False,
        help="with FP8 weights: the LM head in e4m3 too, a scale per vocab row and the "
        "final norm's output scaled per token: half the head's bytes a step, logits further "
        "from the full-precision head's (a head tied to the embeddings gets a quantized copy "
        "of them; not with tensor parallelism; default: off, the head in the model's dtype "
        "as FP8 checkpoints ship it)",
        group=MODEL_GROUP,
    )
    device: str = setting(
        "auto",
        help="torch device, e.g. cpu, cuda:1; auto and cuda mean the current CUDA device "
        "(normally cuda:0) when there is one, else cpu (default: %(default)s)",
        group=MODEL_GROUP,
    )
    """"auto" for offline engines and workers alike: an engine runs where it can
    run fast. Code that must stay on one device (tests comparing against a CPU
    reference) names it."""
    dtype: str = setting(
        "auto",
        help="auto (from config.json), float32, bfloat16 or float16 (default: %(default)s)",
        group=MODEL_GROUP,
    )
    attention_backend: str = setting(
        "auto",
        help="attention kernels: flashinfer (CUDA, bf16/fp16), torch_native (any device); "
        "auto picks flashinfer where it can run (default: %(default)s)",
        group=MODEL_GROUP,
        choices=ATTENTION_CHOICES,
    )
    cuda_graph_max_bs: int | None = setting(
        None,
        help="largest decode batch run as a CUDA graph; 0 disables graphs; sizes the KV "
        "pool cannot hold are skipped (default: auto, min(--max-running-requests, 256) "
        "with flashinfer attention, else 0)",
        group=MODEL_GROUP,
    )
    cuda_graph_max_tokens: int | None = setting(
        None,
        help="largest prefill or mixed forward (in tokens) run as CUDA graphs in pieces "
        "between the layers' attention calls, which run eagerly; 0 disables (default: auto, "
        "min(2048, the token budget) with flashinfer attention, else 0)",
        group=MODEL_GROUP,
    )
    """auto: past about 2048 tokens the GPU's work outlasts the host's launches
    even eagerly, and every bucket costs a capture at start-up
    (``engine.piece_graphs``)."""
    fresh_prefill_graphs: bool | None = setting(
        None,
        help="with flashinfer attention and piecewise graphs: forwards of prompts "
        "without a cached prefix run as one CUDA graph per token count, attention "
        "included, on a Triton kernel that needs no plan from the host (default: auto, "
        "off)",
        group=MODEL_GROUP,
    )
    """auto: off. Faster than the piecewise graphs on a 1024-token FP8 prompt
    (docs/benchmarks.md, FP8 prefill), but not yet run in the serving
    workers on a GPU (``benchmarks.gpu_smoke``)."""
    fuse_rope_kv_write: bool | None = setting(
        None,
        help="with flashinfer attention, one Triton kernel per layer for the q/k norms, "
        "the rotary embedding, the KV scales and the write into the KV pages, in place "
        "of two to nine separate kernels (default: auto, on over e4m3 KV pages and for "
        "models with q/k norms, where it takes the model's heads; else off)",
        group=MODEL_GROUP,
    )
    """auto: on where it made every measured decode step faster: e4m3 pages
    (whose rounding it folds in), q/k norms (four kernels a layer become
    one); over bf16 pages without q/k norms it measured even."""
    decode_kernel: str = setting(
        "auto",
        help="with flashinfer attention, the kernel of decode rows: flashinfer's, or triton "
        "(one program per request, KV head and split of the pages; the same pages, bf16 "
        "or e4m3) (default: auto, triton on e4m3 pages where it takes the model's "
        "heads and pages, else flashinfer)",
        group=MODEL_GROUP,
        choices=DECODE_KERNEL_CHOICES,
    )
    tp_size: int = setting(
        1,
        help="tensor-parallel ranks of the engine: N processes, one device each (cuda:0.."
        "N-1 from --device's index; gloo on CPU), the model's heads, MLP and vocabulary "
        "split over them (default: %(default)s)",
        group=MODEL_GROUP,
    )
    context_length: int | None = setting(
        None,
        help="longest prompt plus output (default: the model's max_position_embeddings)",
        group=MODEL_GROUP,
    )
    seed: int = setting(
        0, help="engine seed for unseeded requests (default: %(default)s)", group=MODEL_GROUP
    )
    page_size: int = setting(16, help="tokens per KV page (default: %(default)s)", group=KV_GROUP)
    """16 for offline engines and workers alike: a page's KV moves between workers
    in one piece and the attention kernels walk one page-table entry per page, so
    bigger pages cost less per token; the prefix cache shares whole pages only,
    so a smaller size shares more of partly common prompts."""
    kv_cache_dtype: str = setting(
        "auto",
        help="fp8_e4m3: KV pages in e4m3: twice the cached tokens in the same memory, half "
        "the bytes per transfer (values saturate at +-448; a checkpoint's per-layer K/V "
        "scales are applied); auto: the model's dtype (default: %(default)s)",
        group=KV_GROUP,
        choices=KV_CACHE_DTYPES,
    )
    num_pages: int | None = setting(
        None,
        help="pages in the KV pool (page 0 is reserved); overrides the sizing rules "
        "below (default: auto)",
        group=KV_GROUP,
    )
    kv_cache_memory_gb: float | None = setting(
        None,
        help="memory of the KV pool in GiB; overrides --gpu-memory-utilization "
        f"(default: auto: from --gpu-memory-utilization on CUDA, {CPU_KV_CACHE_GB:g} elsewhere)",
        group=KV_GROUP,
    )
    gpu_memory_utilization: float = setting(
        0.9,
        help="on CUDA, the share of the GPU's total memory this engine may use in all: "
        "weights, the measured peak of a forward at the token budget, CUDA graphs and the "
        "KV pool, which gets the rest (never more than was free at start); two workers "
        "sharing a GPU need a share each, e.g. 0.45 (default: %(default)s)",
        group=KV_GROUP,
    )
    max_num_batched_tokens: int | None = setting(
        None,
        help="token budget of one forward: prefill chunks plus decode tokens (default: "
        f"auto, {CUDA_TOKEN_BUDGET} on CUDA, {CPU_TOKEN_BUDGET} elsewhere)",
        group=KV_GROUP,
    )
    chunk_size: int | None = setting(
        None,
        help="largest prefill chunk of one request per step (default: the token budget)",
        group=KV_GROUP,
    )
    prefill_per_request: int | None = setting(
        None,
        help="while requests decode, a step carries at most max(F, N x requests "
        "admitted or waiting) prefill tokens: prompt work keeps pace with the load "
        "while arriving prompts cannot stretch the gaps between the tokens of running "
        "streams; 0: only the token budget limits them (default: 6 on CUDA, 0 elsewhere)",
        group=KV_GROUP,
    )
    prefill_floor: int = setting(
        256,
        help="F of --prefill-per-request: the least prefill tokens a step may carry "
        "beside decoding requests (default: %(default)s)",
        group=KV_GROUP,
    )
    max_running_requests: int = setting(
        256, help="requests admitted at once (default: %(default)s)", group=KV_GROUP
    )
    enable_prefix_cache: bool = setting(
        True,
        help="share KV of common prompt prefixes across requests (default: on)",
        group=KV_GROUP,
    )
    overlap: bool = setting(
        True,
        help="schedule step N+1 while step N runs (offline engines; no worker flag: the "
        "decode and colocated loops always overlap, the prefill loop never does)",
        flag=False,
    )
    extra: dict[str, Any] = setting(
        help="free-form options of experiments (no worker flag: not a scalar)",
        flag=False,
        default_factory=dict,
    )

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"unknown quantization {self.quantization!r}; choose from {', '.join(QUANTIZATIONS)}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; "
                f"choose from {', '.join(KV_CACHE_DTYPES)}"
            )
        if self.attention_backend not in ATTENTION_CHOICES:
            raise ValueError(
                f"unknown attention backend {self.attention_backend!r}; "
                f"choose from {', '.join(ATTENTION_CHOICES)}"
            )
        if self.decode_kernel not in DECODE_KERNEL_CHOICES:
            raise ValueError(
                f"unknown decode_kernel {self.decode_kernel!r}; "
                f"choose from {', '.join(DECODE_KERNEL_CHOICES)}"
            )
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError("num_pages must be >= 2 (page 0 is reserved)")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ValueError("kv_cache_memory_gb must be > 0")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError("chunk_size must be >= 1")
        if self.prefill_per_request is not None and self.prefill_per_request < 0:
            raise ValueError("prefill_per_request must be >= 0")
        if self.prefill_floor < 1:
            raise ValueError("prefill_floor must be >= 1")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 0:
            raise ValueError("cuda_graph_max_bs must be >= 0")
        if self.cuda_graph_max_tokens is not None and self.cuda_graph_max_tokens < 0:
            raise ValueError("cuda_graph_max_tokens must be >= 0")
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")

    @property
    def torch_dtype(self) -> torch.dtype | None:
        from engine.model_config import parse_dtype

        return parse_dtype(self.dtype)

    @property
    def effective_chunk_size(self) -> int:
        budget = self.token_budget
        return min(self.chunk_size or budget, budget)

    @property
    def token_budget(self) -> int:
        """``max_num_batched_tokens`` of a resolved config."""
        assert self.max_num_batched_tokens is not None, "EngineConfig must be resolved first"
        return self.max_num_batched_tokens

    @property
    def pool_sized_by(self) -> str:
        """Which setting sizes the KV pool (of a config with a concrete device):
        ``num_pages`` over ``kv_cache_memory_gb`` (the default off CUDA) over
        ``gpu_memory_utilization``. A resolved config keeps only the one used."""
        if self.num_pages is not None and self.kv_cache_memory_gb is None:
            return "num_pages"
        if self.kv_cache_memory_gb is not None or not self.device.startswith("cuda"):
            return "kv_cache_memory_gb"
        return "gpu_memory_utilization"

    def resolve_model_and_device(self) -> EngineConfig:
        """A new config whose model and device are concrete: a local directory
        (``engine.checkpoints``) and an indexed device (``resolve_device``).
        Imports torch: call it where the engine runs."""
        from engine.checkpoints import local_model_dir

        model = local_model_dir(self.model, self.load_format)
        return replace(self, model=model, device=resolve_device(self.device))

    def resolve(self, model_config: ModelConfig) -> EngineConfig:
        """Fill the 'auto' values from the model (returns a new config)."""
        from engine.kvcache.pool import KVPoolConfig, kv_cache_dtype
        from engine.parallel.shard import check_split, kv_head_range

        m = model_config
        kv_dtype = kv_cache_dtype(self.kv_cache_dtype, m.dtype)
        check_split(
            self.tp_size,
            num_heads=m.num_heads,
            num_kv_heads=m.num_kv_heads,
            intermediate_size=m.intermediate_size,
            # Every rank holds a slice of every expert.
            expert_sizes={
                "moe_intermediate_size": m.moe.intermediate_size,
                "shared_expert_intermediate_size": m.moe.shared_expert_intermediate_size,
            }
            if m.moe
            else None,
        )
        device = resolve_device(self.device)
        on_cuda = device.startswith("cuda")
        ctx = self.context_length or model_config.max_position_embeddings
        num_pages, gb = self.num_pages, None
        if num_pages is None and (self.kv_cache_memory_gb is not None or not on_cuda):
            # Every rank's pool holds the same pages, of its own KV heads.
            kv0, kv1 = kv_head_range(m.num_kv_heads, self.tp_size, 0)
            per_page = KVPoolConfig.bytes_per_page(
                self.page_size, m.num_layers, kv1 - kv0, m.head_dim, kv_dtype
            )
            gb = self.kv_cache_memory_gb or CPU_KV_CACHE_GB
            num_pages = max(2, int(gb * (1 << 30)) // per_page + 1)
        # else None on CUDA: the runner sizes the pool from the device's memory.
        backend = self.attention_backend
        if backend == "auto":
            from engine.attention.flashinfer import flashinfer_usable

            usable = flashinfer_usable(device, m.dtype, m.head_dim)
            backend = "flashinfer" if usable else "torch_native"
        graph_bs = self.cuda_graph_max_bs
        if graph_bs is None:
            graph_bs = min(self.max_running_requests, 256) if backend == "flashinfer" else 0
        graph_tokens = self.cuda_graph_max_tokens
        if graph_tokens is None:
            graph_tokens = PIECE_GRAPH_TOKENS if backend == "flashinfer" else 0
        if (graph_bs or graph_tokens) and backend != "flashinfer":
            raise ValueError("CUDA graphs need attention_backend 'flashinfer'")
        budget = self.max_num_batched_tokens or (CUDA_TOKEN_BUDGET if on_cuda else CPU_TOKEN_BUDGET)
        graph_tokens = min(graph_tokens, budget)  # no forward is larger
        fresh = bool(self.fresh_prefill_graphs)
        if fresh and not graph_tokens:
            raise ValueError(
                "fresh_prefill_graphs needs piecewise CUDA graphs (flashinfer attention, "
                "cuda_graph_max_tokens > 0)"
            )
        if self.fuse_rope_kv_write and backend != "flashinfer":
            raise ValueError("fuse_rope_kv_write needs attention_backend 'flashinfer'")
        e4m3_pages = self.kv_cache_dtype == "fp8_e4m3"
        fuse = self.fuse_rope_kv_write
        if fuse is None:
            from engine.attention import rope_kv_write

            fuse = (
                backend == "flashinfer"
                and (e4m3_pages or m.qk_norm)
                and rope_kv_write.supports(m.head_dim)
            )
        decode_kernel = self.decode_kernel
        if decode_kernel == "triton" and backend != "flashinfer":
            raise ValueError("decode_kernel 'triton' needs attention_backend 'flashinfer'")
        if decode_kernel != "flashinfer" and backend == "flashinfer":
            from engine.attention.paged_decode import shape_refusal

            reason = shape_refusal(m.head_dim, self.page_size)
            if reason and decode_kernel == "triton":
                raise ValueError(f"decode_kernel 'triton': {reason}")
            # auto: the Triton kernel on e4m3 pages, where it made every measured
            # decode step faster. bf16 pages keep FlashInfer's: with the Triton
            # kernel's order of the sums the bf16 greedy test's prompts part at a
            # near tie between a prompt alone and in a batch, as they do not with
            # FlashInfer's (neither order is batch-invariant: docs/defaults.md,
            # Decode attention).
            if decode_kernel == "auto" and (reason or not e4m3_pages):
                decode_kernel = "flashinfer"
            else:
                decode_kernel = "triton"
        elif decode_kernel == "auto":
            decode_kernel = "flashinfer"
        return replace(
            self,
            device=device,
            context_length=ctx,
            num_pages=num_pages,
            kv_cache_memory_gb=gb,
            attention_backend=backend,
            decode_kernel=decode_kernel,
            fuse_rope_kv_write=fuse,
            fresh_prefill_graphs=fresh,
            cuda_graph_max_bs=graph_bs,
            cuda_graph_max_tokens=graph_tokens,
            max_num_batched_tokens=budget,
            prefill_per_request=(
                self.prefill_per_request
                if self.prefill_per_request is not None
                else (PREFILL_PER_REQUEST_CUDA if on_cuda else 0)
            ),
        )

    def with_pool(self, num_pages: int) -> tuple[EngineConfig, str | None]:
        """This resolved config with a pool of ``num_pages`` pages, and a
        warning when that changes another setting: the largest CUDA graph is
        at most what the pool can run (every request holds a page, so a
        larger batch never happens, and capturing it would overrun the graph's
        page-table buffers)."""
        capacity = num_pages - 1
        graph_bs = self.cuda_graph_max_bs
        warning = None
        if graph_bs and graph_bs > capacity:
            warning = (
                f"CUDA graphs: batches above {capacity} are not captured (asked for up to "
                f"{graph_bs}): the KV pool holds {capacity} pages"
            )
            graph_bs = capacity
        return replace(self, num_pages=num_pages, cuda_graph_max_bs=graph_bs), warning

    def prefill_cap(self, num_decoding: int, num_requests: int) -> int:
        """Prefill tokens a step may carry beside ``num_decoding`` decoding
        requests, with ``num_requests`` admitted or waiting. Scaled by the whole
        load, not by the decoding count: a cap that follows the decoding count
        starves itself (few decode, so little prefill, so few get to decode)."""
        if not num_decoding or not self.prefill_per_request:
            return self.token_budget
        return max(self.prefill_floor, self.prefill_per_request * num_requests)


PREFILL_PER_REQUEST_CUDA = 6
"""Measured on an H200 (Llama-3.1-8B, 1024-token prompts, 256-token outputs):
keeps the 99th-percentile gap between tokens under twice the median at 64
streams while prefill keeps pace at 256 (all requests sent at once). Off, the
first tokens of Poisson arrivals come sooner: docs/defaults.md, Token budget."""


def resolve_device(device: str) -> str:
    """A concrete, indexed torch device for a ``--device`` value: "auto" is
    the current CUDA device when there is one, else "cpu"; "cuda" is the
    current CUDA device ("cuda:0" unless ``CUDA_VISIBLE_DEVICES`` or
    ``torch.cuda.set_device`` says otherwise). Every entry point resolves
    through here: ``torch.cuda.set_device`` and the KV transfer agents need
    an index. Raises ``ValueError`` for a device this machine does not have."""
    import torch

    name = device.strip().lower()
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"device {device!r} is not a torch device ({e})") from None
    if parsed.type != "cuda":
        return str(parsed)
    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: no CUDA device is available here")
    index = torch.cuda.current_device() if parsed.index is None else parsed.index
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"device {device!r}: only {count} CUDA device(s) are visible")
    return f"cuda:{index}"
