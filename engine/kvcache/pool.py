"""Paged KV pool and its page allocator.

Layout is page-major: ``kv[page, layer, k_or_v, slot, kv_head, head_dim]``. One
page of one request is therefore a single contiguous byte range across every
layer, which is what the KV transfer layer needs (DESIGN.md §5): moving a run of
consecutive pages is one descriptor, not one per (page, layer, K/V).

Page 0 is reserved as a scratch page: padded batch entries (CUDA-graph decode)
write into it, so it is never handed out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_FP8 = torch.float8_e4m3fn


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's element type for ``--kv-cache-dtype`` ``name``."""
    return KV_FP8 if name == "fp8_e4m3" else model_dtype


@dataclass(frozen=True)
class KVPoolConfig:
    num_pages: int
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {self.num_pages}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")

    @property
    def page_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def page_bytes(self) -> int:
        n = 1
        for d in self.page_shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()

    @staticmethod
    def bytes_per_page(
        page_size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * page_size * num_kv_heads * head_dim * elem


class PageAllocator:
    """Free list of page indices. Page 0 is never allocated."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        # Popping from the end hands out low indices first, which keeps a fresh
        # request's pages contiguous (fewer transfer descriptors).
        self._free: list[int] = list(range(num_pages - 1, 0, -1))
        self._is_free = [False] + [True] * (num_pages - 1)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Pages that can ever be allocated (all but the reserved page 0)."""
        return self.num_pages - 1

    def alloc(self, n: int) -> list[int] | None:
        """Return ``n`` pages, or ``None`` (allocating nothing) if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        out = [self._free.pop() for _ in range(n)]
        for p in out:
            self._is_free[p] = False
        return out

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p <= 0 or p >= self.num_pages:
                raise ValueError(f"page {p} out of range")
            if self._is_free[p]:
                raise ValueError(f"double free of page {p}")
            self._is_free[p] = True
        # Reversed so that a freed run is handed out again in ascending order.
        self._free.extend(reversed(pages))


class KVPool:
    """The KV tensor plus its allocator."""

    def __init__(self, config: KVPoolConfig) -> None:
        self.config = config
        self.kv = torch.zeros(
            (config.num_pages, *config.page_shape), dtype=config.dtype, device=config.device
        )
        self.allocator = PageAllocator(config.num_pages)
        # Each layer's views made once: an eager forward asks for them every
        # layer, and indexing the tensor costs microseconds of host time a call.
        self._k = [self.kv[:, layer, 0] for layer in range(self.kv.shape[1])]
        self._v = [self.kv[:, layer, 1] for layer in range(self.kv.shape[1])]

    @property
    def page_size(self) -> int:
        return self.config.page_size

    def k_layer(self, layer: int) -> torch.Tensor:
        """Strided view ``[num_pages, page_size, kv_heads, head_dim]`` of layer's keys."""
        return self._k[layer]

    def v_layer(self, layer: int) -> torch.Tensor:
        return self._v[layer]

    def write(
        self,
        layer: int,
        page_idx: torch.Tensor,
        slot_idx: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Store ``k``/``v`` ``[n, kv_heads, head_dim]`` at (page, slot) pairs
        (into e4m3 pages saturated at the format's largest value: a plain cast
        would make NaN of anything beyond it)."""
        self.kv[page_idx, layer, 0, slot_idx] = self.stored(k)
        self.kv[page_idx, layer, 1, slot_idx] = self.stored(v)

    def stored(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as the pool stores it."""
        if self.kv.dtype == KV_FP8:
            # Clamped in x's own dtype: +-448 is exact in bf16 and fp16, and
            # their cast to e4m3 rounds as float32's would (two kernels, not three).
            limit = torch.finfo(KV_FP8).max
            return x.clamp(-limit, limit).to(KV_FP8)
        return x.to(self.kv.dtype)
