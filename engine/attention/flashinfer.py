"""Paged attention on CUDA with FlashInfer's batch kernels.

The pool's page-major layout gives each layer's keys and values as strided
views ``[num_pages, page_size, kv_heads, head_dim]`` (NHD within a page) whose
page stride spans all layers; FlashInfer reads the page table through those
strides, so no copy of the cache is made. K and V views share their strides.
"""

from __future__ import annotations

import importlib.util

import torch

from engine.attention.base import AttentionBackend
from engine.forward_batch import ForwardBatch
from engine.kvcache.pool import KVPool

WORKSPACE_BYTES = 256 << 20
"""Scratch of the kernels (split-KV partial results); shared by both wrappers,
which never run at the same time."""

KERNEL_HEAD_DIMS = (64, 128, 256)
KERNEL_DTYPES = (torch.bfloat16, torch.float16)


def flashinfer_usable(device: str, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether ``auto`` should pick this backend: CUDA, half precision, a head
    size the kernels are built for, and the package importable."""
    return (
        device.startswith("cuda")
        and dtype in KERNEL_DTYPES
        and head_dim in KERNEL_HEAD_DIMS
        and importlib.util.find_spec("flashinfer") is not None
    )


class FlashInferAttention(AttentionBackend):
    def __init__(self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(pool, num_heads, num_kv_heads, head_dim)
        try:
            import flashinfer
        except ImportError as e:
            raise RuntimeError(
                "attention_backend 'flashinfer' needs the flashinfer-python package "
                "(pip install -e '.[gpu]')"
            ) from e
        if pool.kv.device.type != "cuda":
            raise RuntimeError("attention_backend 'flashinfer' runs on CUDA devices only")
        if pool.kv.dtype not in KERNEL_DTYPES:
            raise RuntimeError(
                f"attention_backend 'flashinfer' needs a bfloat16 or float16 KV cache, "
                f"not {pool.kv.dtype}"
            )
        device = pool.kv.device
        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._wrapper: object = self._decode
        self._batch: ForwardBatch | None = None

    def begin_forward(self, batch: ForwardBatch) -> None:
        ps = self.pool.page_size
        indptr, indices, last_len = [0], [], []
        for seq_len, table in zip(batch.seq_lens, batch.page_tables):
            n = -(-seq_len // ps)
            indices.extend(table[:n])
            indptr.append(indptr[-1] + n)
            last_len.append(seq_len - (n - 1) * ps)

        # Page tables go in as host tensors: plan() schedules on the host and
        # copies them to the device itself.
        def host(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int32)

        device = self.pool.kv.device
        kv_indices = host(indices).to(device, non_blocking=True)
        dtype = self.pool.kv.dtype
        common = dict(q_data_type=dtype, kv_data_type=dtype, sm_scale=self.scale)
        if batch.is_decode:
            self._decode.plan(
                host(indptr),
                kv_indices,
                host(last_len),
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                ps,
                **common,
            )
            self._wrapper = self._decode
        else:
            qo_indptr = [0]
            for n in batch.extend_lens:
                qo_indptr.append(qo_indptr[-1] + n)
            self._prefill.plan(
                host(qo_indptr),
                host(indptr),
                kv_indices,
                host(last_len),
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                ps,
                causal=True,
                **common,
            )
            self._wrapper = self._prefill
        self._batch = batch

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int
    ) -> torch.Tensor:
        batch = self._batch
        assert batch is not None, "begin_forward must come first"
        self.pool.write(layer, batch.write_pages, batch.write_slots, k, v)
        cache = (self.pool.k_layer(layer), self.pool.v_layer(layer))
        return self._wrapper.run(q.contiguous(), cache)  # type: ignore[attr-defined]
