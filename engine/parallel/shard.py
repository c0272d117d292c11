"""How a model is split over ``size`` tensor-parallel ranks (torch-free).

Query heads, the MLP's intermediate dimension and the vocabulary are split
evenly. KV heads are split evenly while there are at least as many as ranks;
beyond that each rank holds one KV head, replicated over the ``size //
num_kv_heads`` consecutive ranks whose query heads use it (the grouped-query
layout keeps a rank's query heads on one KV head).
"""

from __future__ import annotations

from dataclasses import dataclass


class ShardError(ValueError):
    """The model cannot be split over this many ranks; the message says why."""


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``size``; ``size == 1`` is the whole model."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ShardError(f"rank {self.rank} is not in a group of {self.size}")

    def even(self, total: int) -> tuple[int, int]:
        """This rank's ``[start, stop)`` of ``total`` items split evenly."""
        per = total // self.size
        return self.rank * per, (self.rank + 1) * per

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """This rank's ``[start, stop)`` of the KV heads."""
        return kv_head_range(num_kv_heads, self.size, self.rank)

    def vocab(self, vocab_size: int) -> tuple[int, int, int]:
        """``(start, stop, padded)``: this rank's rows of the vocabulary and the
        row count every rank allocates (the last rank's shard may be short)."""
        per = -(-vocab_size // self.size)
        start = min(self.rank * per, vocab_size)
        return start, min(start + per, vocab_size), per


def kv_head_range(num_kv_heads: int, size: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of the KV heads rank ``rank`` of ``size`` holds."""
    if size <= num_kv_heads:
        per = num_kv_heads // size
        return rank * per, (rank + 1) * per
    head = rank // (size // num_kv_heads)
    return head, head + 1


def kv_head_ranges(num_kv_heads: int, size: int) -> list[tuple[int, int]]:
    """Every rank's KV head range, rank 0 first."""
    return [kv_head_range(num_kv_heads, size, r) for r in range(size)]


def check_split(
    size: int,
    *,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    expert_sizes: dict[str, int] | None = None,
) -> None:
    """Raise ``ShardError`` when a model of these sizes cannot run on ``size`` ranks."""
    if size < 1:
        raise ShardError(f"tp_size must be >= 1, got {size}")
    expert_sizes = expert_sizes or {}
    problems = []
    if num_heads % size:
        problems.append(f"num_attention_heads ({num_heads}) is not a multiple of it")
    if size <= num_kv_heads and num_kv_heads % size:
        problems.append(f"num_key_value_heads ({num_kv_heads}) is not a multiple of it")
    if size > num_kv_heads and size % num_kv_heads:
        problems.append(
            f"it exceeds num_key_value_heads ({num_kv_heads}) without being a multiple of it"
        )
    if intermediate_size % size:
        problems.append(f"intermediate_size ({intermediate_size}) is not a multiple of it")
    for name, inter in expert_sizes.items():
        if inter % size:
            problems.append(f"{name} ({inter}) is not a multiple of it")
    if problems:
        raise ShardError(f"the model cannot be split over tp_size {size}: " + "; ".join(problems))
