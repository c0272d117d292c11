"""What the scheduler hands the runner for one forward."""

from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np
import torch

from engine.host_copy import to_device


class ForwardBatch(NamedTuple):
    input_ids: torch.Tensor
    """``[num_tokens]`` new tokens of every request, request after request."""
    positions: torch.Tensor
    """``[num_tokens]`` absolute position of each new token."""
    seq_lens: list[int]
    """Per request: KV length once this step's tokens are written."""
    extend_lens: list[int]
    """Per request: number of new tokens in this step (1 for decode)."""
    page_tables: list[list[int]]
    """Per request: the pages that hold positions ``[0, seq_len)``."""
    write_pages: torch.Tensor
    """``[num_tokens]`` page that receives each new token's K/V."""
    write_slots: torch.Tensor
    """``[num_tokens]`` slot within that page."""
    logits_indices: torch.Tensor
    """Rows of the hidden states whose logits are wanted (a request's last new token)."""

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.extend_lens)


class ExtendSpec(NamedTuple):
    """One request's share of a step: ``new_ids`` start at position ``start``."""

    new_ids: list[int]
    start: int
    page_table: list[int]
    logits: str = "last"
    """"last" (sample from the last new token), "all" (tests) or "none"."""


LONG_EXTEND = 32
"""A request with more new tokens than this has its rows built by numpy (a
prompt chunk of thousands of tokens); shorter ones, decode rows above all,
by plain appends, which cost less for a token or two."""


def build_forward_batch(
    specs: list[ExtendSpec], page_size: int, device: torch.device | str
) -> ForwardBatch:
    ids: list[int] = []
    positions: list[int] = []
    write_pages: list[int] = []
    write_slots: list[int] = []
    logits_indices: list[int] = []
    seq_lens: list[int] = []
    extend_lens: list[int] = []
    tables: list[list[int]] = []
    for spec in specs:
        n = len(spec.new_ids)
        end = spec.start + n
        first_row = len(ids)
        ids.extend(spec.new_ids)
        if n > LONG_EXTEND:
            pos = np.arange(spec.start, end, dtype=np.int64)
            positions.extend(range(spec.start, end))
            table = np.asarray(spec.page_table[: -(-end // page_size)], dtype=np.int64)
            write_pages.extend(table[pos // page_size].tolist())
            write_slots.extend((pos % page_size).tolist())
        else:
            for p in range(spec.start, end):
                positions.append(p)
                write_pages.append(spec.page_table[p // page_size])
                write_slots.append(p % page_size)
        if spec.logits == "all":
            logits_indices.extend(range(first_row, first_row + n))
        elif spec.logits == "last":
            logits_indices.append(first_row + n - 1)
        seq_lens.append(end)
        extend_lens.append(n)
        tables.append(spec.page_table[: -(-end // page_size)])

    fields = [ids, positions, write_pages, write_slots, logits_indices]
    total = sum(len(f) for f in fields)
    flat_np = np.fromiter(itertools.chain.from_iterable(fields), dtype=np.int64, count=total)
    flat = to_device(torch.from_numpy(flat_np), device)
    ids_t, pos_t, pages_t, slots_t, logits_t = flat.split([len(f) for f in fields])
    return ForwardBatch(
        input_ids=ids_t,
        positions=pos_t,
        seq_lens=seq_lens,
        extend_lens=extend_lens,
        page_tables=tables,
        write_pages=pages_t,
        write_slots=slots_t,
        logits_indices=logits_t,
    )
