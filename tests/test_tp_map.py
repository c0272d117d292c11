"""Head mapping between tensor-parallel groups of different sizes: the byte
ranges of every pairing, applied as plain byte copies between per-rank pools,
give each decode rank exactly its heads of the prefill pages (checked against
torch slicing of one whole pool), and pairings that cannot map are refused
with the fields named."""

from __future__ import annotations

import random

import pytest
import torch

from engine.parallel.shard import kv_head_ranges
from kvtransfer.compat import compat_info, describe_mismatch
from kvtransfer.tp_map import HeadSlice, format_ranges, parse_layout, plan, slice_ranges

LAYERS, PAGE, HEADS, DIM = 2, 4, 4, 8
ROWS = LAYERS * 2 * PAGE
NUM_PAGES = 12


def compat(tp: int, heads: int = HEADS, ranges: str | None = None, page_bytes: int | None = None):
    local = kv_head_ranges(heads, tp)[0]
    local_heads = local[1] - local[0]
    return compat_info(
        model="m",
        architecture="LlamaForCausalLM",
        num_layers=LAYERS,
        num_kv_heads=heads,
        head_dim=DIM,
        dtype="float32",
        page_size=PAGE,
        page_bytes=page_bytes or ROWS * local_heads * DIM * 4,
        backend="tcp",
        tp_size=tp,
        kv_head_ranges=ranges or format_ranges(kv_head_ranges(heads, tp)),
    )


def rank_pools(full: torch.Tensor, tp: int) -> list[torch.Tensor]:
    return [full[..., a:b, :].contiguous() for a, b in kv_head_ranges(full.shape[-2], tp)]


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (1, 2), (2, 1), (2, 2), (1, 4), (4, 2), (2, 4)])
def test_ranges_move_each_decode_rank_its_heads(p_tp: int, d_tp: int) -> None:
    gen = torch.Generator().manual_seed(p_tp * 10 + d_tp)
    full = torch.randn(NUM_PAGES, LAYERS, 2, PAGE, HEADS, DIM, generator=gen)
    src_pools = rank_pools(full, p_tp)
    dst_pools = [torch.zeros_like(p) for p in rank_pools(full, d_tp)]
    pc, dc = compat(p_tp), compat(d_tp)
    assert describe_mismatch(pc, dc) is None
    slices = plan(pc, dc)
    assert not isinstance(slices, str), slices

    src_layout, dst_layout = parse_layout(pc), parse_layout(dc)
    assert not isinstance(src_layout, str) and not isinstance(dst_layout, str)
    rng = random.Random(0)
    src_pages = rng.sample(range(1, NUM_PAGES), 5)
    dst_pages = [3, 4, 5, 9, 1]  # a run, then scattered
    for s in slices:
        src = src_pools[s.src].view(-1).view(torch.uint8)
        dst = dst_pools[s.dst].view(-1).view(torch.uint8)
        for r in slice_ranges(s, src_layout, dst_layout, ROWS, src_pages, dst_pages):
            dst[r.dst_offset : r.dst_offset + r.nbytes] = src[
                r.src_offset : r.src_offset + r.nbytes
            ]
    for d, (a, b) in enumerate(kv_head_ranges(HEADS, d_tp)):
        want = full[src_pages][..., a:b, :]
        assert torch.equal(dst_pools[d][dst_pages], want), f"decode rank {d}"
        untouched = [p for p in range(NUM_PAGES) if p not in dst_pages]
        assert not dst_pools[d][untouched].any()


def test_equal_groups_move_whole_page_runs() -> None:
    slices = plan(compat(2), compat(2))
    assert slices == [HeadSlice(0, 0, 0, 2), HeadSlice(1, 1, 2, 4)]

    layout = parse_layout(compat(2))
    assert not isinstance(layout, str)
    ranges = slice_ranges(slices[0], layout, layout, ROWS, [1, 2, 3, 7], [4, 5, 6, 2])
    assert len(ranges) == 2  # the run of three pages and the last page


def test_replicated_heads_spread_the_writers() -> None:
    # Two KV heads on four prefill ranks: head 0 on ranks 0 and 1, head 1 on 2 and 3.
    slices = plan(compat(4, heads=2), compat(2, heads=2))
    assert slices == [HeadSlice(0, 0, 0, 1), HeadSlice(3, 1, 1, 2)]


def test_unmappable_pairings_are_refused_naming_the_fields() -> None:
    gap = plan(compat(2, ranges="0-2,0-2"), compat(1))
    assert isinstance(gap, str) and "kv_head_ranges" in gap and "KV head 2" in gap
    uneven = plan(compat(2, ranges="0-1,1-4"), compat(1))
    assert isinstance(uneven, str) and "not an even split of num_kv_heads" in uneven
    short = plan(compat(2, ranges="0-4"), compat(1))
    assert isinstance(short, str) and "tp_size (2)" in short
    wide = plan(compat(1), compat(2, page_bytes=ROWS * 2 * DIM * 2))
    assert isinstance(wide, str) and "page_bytes per KV head" in wide
    # Fields beyond the tensor-parallel ones must still match exactly.
    other = describe_mismatch(compat(1), compat(2, heads=8))
    assert other is not None and "num_kv_heads" in other
