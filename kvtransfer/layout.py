"""Byte layout helpers: page maps -> byte ranges of a page-major KV buffer.

The KV pool is page-major (``kv[page, layer, k_or_v, slot, head, dim]``), so page
``p`` is the single contiguous block ``[p * page_bytes, (p + 1) * page_bytes)``.
Moving src page ``s[i]`` to dst page ``d[i]`` is therefore one byte range per
page, and a run where both sides are consecutive is one range for the whole run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtransfer.backend import ByteRange


def buffer_nbytes(buffer: torch.Tensor) -> int:
    """Size in bytes of a tensor's elements (what a backend registers)."""
    return buffer.numel() * buffer.element_size()


def page_ranges(
    src_pages: Sequence[int], dst_pages: Sequence[int], page_bytes: int
) -> list[ByteRange]:
    """Byte ranges copying src page ``src_pages[i]`` to dst page ``dst_pages[i]``.

    Consecutive entries where both the src and the dst page advance by one are
    merged into one range, so a contiguous run of ``n`` pages is one descriptor.
    The order of the map is kept (no sorting), so only adjacent entries merge.
    """
    if len(src_pages) != len(dst_pages):
        raise ValueError(
            f"page maps differ in length: {len(src_pages)} src vs {len(dst_pages)} dst"
        )
    if page_bytes <= 0:
        raise ValueError(f"page_bytes must be > 0, got {page_bytes}")
    out: list[ByteRange] = []
    run_src = run_dst = run_len = 0
    for s, d in zip(src_pages, dst_pages):
        s, d = int(s), int(d)
        if s < 0 or d < 0:
            raise ValueError(f"negative page index in map ({s} -> {d})")
        if run_len and s == run_src + run_len and d == run_dst + run_len:
            run_len += 1
            continue
        if run_len:
            out.append(ByteRange(run_src * page_bytes, run_dst * page_bytes, run_len * page_bytes))
        run_src, run_dst, run_len = s, d, 1
    if run_len:
        out.append(ByteRange(run_src * page_bytes, run_dst * page_bytes, run_len * page_bytes))
    return out


def total_bytes(ranges: Sequence[ByteRange]) -> int:
    return sum(r.nbytes for r in ranges)


def check_ranges(ranges: Sequence[ByteRange], src_nbytes: int, dst_nbytes: int) -> str | None:
    """Why ``ranges`` do not fit a ``src_nbytes`` source and ``dst_nbytes``
    destination buffer, or ``None`` when they all do."""
    for i, r in enumerate(ranges):
        if r.nbytes < 0 or r.src_offset < 0 or r.dst_offset < 0:
            return f"range {i} {tuple(r)} has a negative field"
        if r.src_offset + r.nbytes > src_nbytes:
            return (
                f"range {i} reads [{r.src_offset}, {r.src_offset + r.nbytes}) "
                f"past the local buffer of {src_nbytes} bytes"
            )
        if r.dst_offset + r.nbytes > dst_nbytes:
            return (
                f"range {i} writes [{r.dst_offset}, {r.dst_offset + r.nbytes}) "
                f"past the peer buffer of {dst_nbytes} bytes"
            )
    return None
