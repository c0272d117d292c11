"""Sizing the KV pool from the device's memory.

On a GPU the pool takes what is left of this engine's share of the device
once everything else it needs is counted::

    budget  = min(gpu_memory_utilization x total, free at start - reserve)
    KV pool = budget - weights - peak activations - CUDA graphs

* ``total`` and ``free at start`` are read before the engine allocates
  anything, so a second engine on the same GPU sees what the first one took;
  a share of the *total* (not of what is free) makes two engines started
  together with 0.45 each end with the same pool, whichever reads first.
* ``peak activations`` is measured, not estimated: one forward of the token
  budget (split over the largest batch, whose logits and sampling are part of
  it) on a throw-away pool, with the allocator's peak counter.
* ``CUDA graphs`` is the measured peak of one decode forward at the largest
  captured batch plus that of one forward of the piecewise graphs' largest
  bucket: each kind shares one memory pool, which holds the intermediates of
  the largest of its graphs.
* ``reserve`` stays free for what the allocator's counters do not see (the
  libraries' code and buffers, NCCL and NIXL, fragmentation); it matters only
  when another process leaves less than the share free.

``MemoryPlan`` is the rule alone (numbers in, pages out), so it is tested
without a device; ``engine.runner.ModelRunner`` takes the measurements.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

GIB = 1 << 30
RESERVE_BYTES = 1 << 30
"""Left free beside the engine's own tensors (see the module docstring)."""
MIN_POOL_PAGES = 16
"""Fewer usable pages than this is a configuration error, not a pool."""


class NotEnoughMemory(RuntimeError):
    """The device cannot hold the engine at the requested share."""


@dataclass(frozen=True)
class MemoryPlan:
    """The numbers the KV pool is sized from (bytes) and the rule."""

    total: int
    free_at_start: int
    utilization: float
    weights: int
    activations: int
    graphs: int
    page_bytes: int
    reserve: int = RESERVE_BYTES
    free_before_pool: int | None = None
    """Free when the pool is about to be allocated: another engine that
    started at the same moment read the same free memory at start, and may
    have taken its share since."""

    @property
    def share(self) -> int:
        """``utilization`` of the total."""
        return int(self.utilization * self.total)

    @property
    def budget(self) -> int:
        """What this engine may use in all."""
        return min(self.share, self.free_at_start - self.reserve)

    @property
    def budget_left(self) -> int:
        """What the budget leaves the pool."""
        return self.budget - self.weights - self.activations - self.graphs

    @property
    def capped(self) -> bool:
        """Less was free before the pool than the budget leaves it."""
        return self.free_before_pool is not None and self.free_left < self.budget_left

    @property
    def kv_bytes(self) -> int:
        return self.free_left if self.capped else self.budget_left

    @property
    def free_left(self) -> int:
        """What the pool may take of ``free_before_pool``: the activations and
        graphs come after it, and the reserve stays free."""
        assert self.free_before_pool is not None
        return self.free_before_pool - self.activations - self.graphs - self.reserve

    @property
    def num_pages(self) -> int:
        """Pages of the pool, the reserved page 0 included; raises
        ``NotEnoughMemory`` (saying what took the memory) when it would hold
        fewer than ``MIN_POOL_PAGES`` usable pages."""
        usable = max(0, self.kv_bytes) // self.page_bytes
        if usable < MIN_POOL_PAGES:
            raise NotEnoughMemory(
                f"no room for the KV pool: {self.describe()}; raise "
                "--gpu-memory-utilization, free the GPU (another process may hold it; "
                "two workers on one GPU need a share each, e.g. 0.45), or lower "
                "--max-num-batched-tokens"
            )
        return usable + 1

    def describe(self) -> str:
        """One line for the start-up log and errors."""
        g = lambda n: f"{n / GIB:.2f}"  # noqa: E731
        share = (
            f"{g(self.free_at_start)} GiB free at start less {g(self.reserve)} reserved"
            if self.budget < self.share
            else f"{self.utilization:g} of {g(self.total)} GiB"
        )
        line = (
            f"budget {g(self.budget)} GiB ({share}) - weights {g(self.weights)} "
            f"- activations {g(self.activations)} - CUDA graphs {g(self.graphs)} "
            f"= KV pool {g(max(0, self.kv_bytes))} GiB"
        )
        if self.capped:
            line += f" (capped: {g(self.free_before_pool)} GiB free before the pool)"
        return line

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "budget": self.budget, "kv_bytes": self.kv_bytes}


def peak_bytes(device: Any, run: Callable[[], object]) -> int:
    """Bytes the allocator's peak rose above what was allocated before ``run``."""
    import torch

    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before
