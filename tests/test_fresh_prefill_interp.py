"""Causal attention of fresh prompts in Triton (``engine.attention.fresh_prefill``)
under Triton's interpreter (no GPU needed), against causal attention in
float64 prompt by prompt: several prompts in one forward (blocks that hold
the end of one and the start of the next), lengths from one token to past a
block, groups of 1, 4 and 6 query heads a KV head, q, k and v as strided
views into one QKV output, padding rows past the real ones (never written)
with stale positions, and a dead block of padding alone.

The interpreter must be chosen before triton is first imported, so these run
in a child process started with ``TRITON_INTERPRET=1`` (fp16 there: the
interpreter truncates float32 to bf16 where the GPU rounds)."""

from __future__ import annotations

import pytest
import torch
from triton_interp import interpreted, parent_only, run_interpreted

from engine.attention.fresh_prefill import FreshTiles, check


@parent_only
def test_kernel_under_the_interpreter() -> None:
    run_interpreted(__file__, timeout_s=900)


def _qkv(n: int, heads: int, kv_heads: int, d: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k, v as views into one ``[n, heads + 2 kv_heads, d]`` output."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(n, heads + 2 * kv_heads, d, generator=g).to(torch.float16)
    return qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]


def _positions(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], sm_scale: float
) -> torch.Tensor:
    """float64 causal attention of each prompt over its own rows."""
    group = q.shape[1] // k.shape[1]
    out, start = [], 0
    for n in lengths:
        qs = q[start : start + n].double().transpose(0, 1)  # [heads, n, d]
        ks = k[start : start + n].double().repeat_interleave(group, 1).transpose(0, 1)
        vs = v[start : start + n].double().repeat_interleave(group, 1).transpose(0, 1)
        s = qs @ ks.transpose(1, 2) * sm_scale
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out.append((s.softmax(-1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(out)


@interpreted
@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(8, 2, 32), (2, 2, 16), (12, 2, 32)])
@pytest.mark.parametrize(
    "lengths", [[1], [37], [5, 16, 1, 40], [17, 17, 17]], ids=["one", "long", "mixed", "even"]
)
@pytest.mark.parametrize(
    "block", [FreshTiles(16, 16, 4, 1), FreshTiles(32, 16, 4, 2)], ids=["16x16", "32x16"]
)
def test_matches_float64_causal_attention_prompt_by_prompt(
    heads: int, kv_heads: int, d: int, lengths: list[int], block: FreshTiles
) -> None:
    from engine.attention.fresh_prefill import fresh_prefill

    n = sum(lengths)
    q, k, v = _qkv(n, heads, kv_heads, d, seed=n + heads)
    out = torch.empty(n, heads, d, dtype=torch.float16)
    fresh_prefill(q, k, v, _positions(lengths), out, d**-0.5, fresh_tiles=block)
    ref = _reference(q, k, v, lengths, d**-0.5)
    err = (out.double() - ref).abs().max().item()
    assert err < 4e-3 * ref.abs().max().item(), err


@interpreted
def test_padding_rows_are_neither_attended_nor_written() -> None:
    """A bucket of 48 rows holding 21 real ones: the real rows match the
    forward of the 21 alone whatever the padding holds (NaN keys, stale
    positions past their index), the padding's outputs keep what they held,
    and the last block, padding alone, reads and writes nothing."""
    from engine.attention.fresh_prefill import fresh_prefill

    lengths, size, heads, kv_heads, d = [9, 12], 48, 4, 2, 16
    n = sum(lengths)
    q, k, v = _qkv(size, heads, kv_heads, d, seed=3)
    k[n:] = float("nan")
    v[n:] = float("nan")
    positions = torch.cat([_positions(lengths), torch.full((size - n,), 1000)])
    out = torch.full((size, heads, d), 7.0, dtype=torch.float16)
    fresh_prefill(q, k, v, positions, out, d**-0.5, n_rows=n, fresh_tiles=FreshTiles(16, 16, 4, 1))
    ref = _reference(q[:n], k[:n], v[:n], lengths, d**-0.5)
    assert (out[:n].double() - ref).abs().max().item() < 4e-3 * ref.abs().max().item()
    assert (out[n:] == 7.0).all()


@interpreted
def test_e4m3_pages_attended_as_they_hold_k_and_v() -> None:
    """``kv_e4m3``: k and v as e4m3 pages hold them, saturated at +-448. The
    values are e4m3 ones to begin with (the interpreter's rounding to e4m3
    is not the GPU's at ties and binade edges; the GPU test checks the
    rounding), some of V past the format's largest: attended saturated, the
    same forward without ``kv_e4m3`` differs."""
    from engine.attention.fresh_prefill import fresh_prefill

    lengths, heads, kv_heads, d = [5, 30], 4, 2, 16
    n = sum(lengths)
    q, k, v = _qkv(n, heads, kv_heads, d, seed=11)

    def paged(x: torch.Tensor) -> torch.Tensor:
        return x.float().clamp(-448, 448).to(torch.float8_e4m3fn).to(x.dtype)

    k.copy_(paged(k))
    v.copy_(paged(v * 100))
    v[::3, :, ::5] *= 4  # past 448: saturated by the pages
    assert (v.abs() > 448).any()
    outs = {}
    for e4m3 in (True, False):
        out = torch.empty(n, heads, d, dtype=torch.float16)
        fresh_prefill(q, k, v, _positions(lengths), out, d**-0.5,
                      fresh_tiles=FreshTiles(16, 16, 4, 1), kv_e4m3=e4m3)  # fmt: skip
        outs[e4m3] = out
    ref = _reference(q, k, paged(v), lengths, d**-0.5)
    assert (outs[True].double() - ref).abs().max().item() < 4e-3 * ref.abs().max().item()
    assert not torch.equal(outs[True], outs[False])


@interpreted
def test_one_token_of_difference_shows() -> None:
    """The rows after a prompt boundary moved by one token attend different
    keys: the kernel finds each row's prompt from the positions alone."""
    from engine.attention.fresh_prefill import fresh_prefill

    heads, kv_heads, d = 2, 1, 16
    q, k, v = _qkv(32, heads, kv_heads, d, seed=5)
    outs = []
    for lengths in ([16, 16], [17, 15]):
        out = torch.empty(32, heads, d, dtype=torch.float16)
        fresh_prefill(q, k, v, _positions(lengths), out, 0.25, fresh_tiles=FreshTiles(16, 16, 4, 1))
        ref = _reference(q, k, v, lengths, 0.25)
        assert (out.double() - ref).abs().max().item() < 4e-3 * ref.abs().max().item()
        outs.append(out)
    assert torch.equal(outs[0][:16], outs[1][:16])  # rows before the moved boundary
    assert not torch.equal(outs[0][16:], outs[1][16:])


def test_shapes_are_checked() -> None:
    q = torch.empty(4, 8, 32)
    kv = torch.empty(4, 2, 32)
    check(q, kv, kv, torch.empty(4, 8, 32))
    with pytest.raises(ValueError, match="group"):
        check(torch.empty(4, 6, 32), torch.empty(4, 4, 32), torch.empty(4, 4, 32),
              torch.empty(4, 6, 32))  # fmt: skip
    with pytest.raises(ValueError, match="power of two"):
        check(torch.empty(4, 2, 48), torch.empty(4, 2, 48), torch.empty(4, 2, 48),
              torch.empty(4, 2, 48))  # fmt: skip
    with pytest.raises(ValueError, match="out must be"):
        check(q, kv, kv, torch.empty(4, 8, 16))
    with pytest.raises(ValueError, match="contiguous"):
        check(torch.empty(4, 32, 8).transpose(1, 2), kv, kv, torch.empty(4, 8, 32))
