"""KV between tensor-parallel groups of different sizes: which prefill rank
writes which KV heads into which decode rank, and the byte ranges of that.

Each rank's pool is page-major over its own KV heads,
``kv[page, layer, k_or_v, slot, local_head, head_dim]``, so a page is
``rows = layers * 2 * page_size`` rows of ``local_heads * head_bytes``. When
both ranks of a pair hold the same heads, a page moves whole (one range per run
of pages, ``page_ranges``). Otherwise every row carries the shared heads as
one piece: ``rows`` ranges per page.

The plan is made once per peer, at the handshake, from the two compat
records (``tp_size``, ``kv_head_ranges``, ``page_bytes``); a pairing that
leaves a decode head without a prefill rank holding it is refused there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kvtransfer.backend import ByteRange
from kvtransfer.layout import page_ranges


class RankLayout(NamedTuple):
    """One side's ranks: the KV heads ``[start, stop)`` each holds, and the
    bytes of one of its pages (every rank holds as many heads)."""

    heads: list[tuple[int, int]]
    page_bytes: int

    @property
    def local_heads(self) -> int:
        a, b = self.heads[0]
        return b - a


class HeadSlice(NamedTuple):
    """Prefill rank ``src`` writes KV heads ``[start, stop)`` into decode rank ``dst``."""

    src: int
    dst: int
    start: int
    stop: int


def format_ranges(ranges: Sequence[tuple[int, int]]) -> str:
    return ",".join(f"{a}-{b}" for a, b in ranges)


def parse_layout(compat: dict[str, str]) -> RankLayout | str:
    """The ranks of one side's compat record, or why it is unusable. A record
    without TP fields is one rank holding every head."""
    try:
        kv_heads = int(compat["num_kv_heads"])
        page_bytes = int(compat["page_bytes"])
        size = int(compat.get("tp_size", "1"))
        text = compat.get("kv_head_ranges") or f"0-{kv_heads}"
        heads = [tuple(int(x) for x in part.split("-")) for part in text.split(",")]
    except (KeyError, ValueError) as e:
        return f"malformed tensor-parallel fields in the compat record: {e}"
    if len(heads) != size or any(len(h) != 2 for h in heads):
        return f"kv_head_ranges ({text}) does not list tp_size ({size}) ranges"
    counts = {b - a for a, b in heads}  # type: ignore[misc]
    if len(counts) != 1 or any(not 0 <= a < b <= kv_heads for a, b in heads):  # type: ignore[misc]
        return f"kv_head_ranges ({text}) is not an even split of num_kv_heads ({kv_heads})"
    return RankLayout([(a, b) for a, b in heads], page_bytes)  # type: ignore[misc]


def plan(prefill: dict[str, str], decode: dict[str, str]) -> list[HeadSlice] | str:
    """The writes that fill every decode rank's heads, or why none can (naming
    the compat fields at fault)."""
    src, dst = parse_layout(prefill), parse_layout(decode)
    if isinstance(src, str):
        return f"prefill {src}"
    if isinstance(dst, str):
        return f"decode {dst}"
    if src.page_bytes * dst.local_heads != dst.page_bytes * src.local_heads:
        return (
            f"page_bytes per KV head differ (prefill {src.page_bytes} for "
            f"{src.local_heads} heads, decode {dst.page_bytes} for {dst.local_heads})"
        )
    slices: list[HeadSlice] = []
    for d, (a, b) in enumerate(dst.heads):
        for head in range(a, b):
            holders = [p for p, (s0, s1) in enumerate(src.heads) if s0 <= head < s1]
            if not holders:
                return (
                    f"kv_head_ranges do not map (prefill {format_ranges(src.heads)}, decode "
                    f"{format_ranges(dst.heads)}): no prefill rank holds KV head {head} "
                    f"of decode rank {d}"
                )
            # Replicated heads: spread the writers over the ranks that hold them.
            p = holders[d % len(holders)]
            last = slices[-1] if slices else None
            if last is not None and last.src == p and last.dst == d and last.stop == head:
                slices[-1] = last._replace(stop=head + 1)
            else:
                slices.append(HeadSlice(p, d, head, head + 1))
    return slices


def slice_ranges(
    s: HeadSlice,
    src: RankLayout,
    dst: RankLayout,
    rows: int,
    src_pages: Sequence[int],
    dst_pages: Sequence[int],
) -> list[ByteRange]:
    """Byte ranges writing heads ``s`` of ``src_pages`` (of prefill rank
    ``s.src``) into ``dst_pages`` (of decode rank ``s.dst``)."""
    s0, s1 = src.heads[s.src]
    d0, d1 = dst.heads[s.dst]
    if (s0, s1) == (d0, d1) == (s.start, s.stop):
        return page_ranges(src_pages, dst_pages, src.page_bytes)
    head_bytes = src.page_bytes // (rows * (s1 - s0))
    src_row, dst_row = (s1 - s0) * head_bytes, (d1 - d0) * head_bytes
    src_skip, dst_skip = (s.start - s0) * head_bytes, (s.start - d0) * head_bytes
    n = (s.stop - s.start) * head_bytes
    out: list[ByteRange] = []
    for sp, dp in zip(src_pages, dst_pages, strict=True):
        sbase = sp * src.page_bytes + src_skip
        dbase = dp * dst.page_bytes + dst_skip
        out.extend(ByteRange(sbase + r * src_row, dbase + r * dst_row, n) for r in range(rows))
    return out
