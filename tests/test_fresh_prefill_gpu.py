"""On CUDA: the plan-free causal prefill (``engine.attention.fresh_prefill``),
compiled, in bf16 at real head counts, against float64 attention prompt by
prompt; and one CUDA graph replayed for other prompts of the same row count
(what the whole-forward graphs of ``engine.piece_graphs`` rely on)."""

from __future__ import annotations

import pytest
import torch

from engine.attention.fresh_prefill import FreshTiles, fresh_prefill

pytestmark = pytest.mark.gpu

DEVICE = "cuda:0"


def _qkv(n: int, heads: int, kv_heads: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(n, heads + 2 * kv_heads, d, generator=g, device=DEVICE).bfloat16()


def _split(qkv: torch.Tensor, heads: int, kv_heads: int) -> tuple[torch.Tensor, ...]:
    return qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]


def _positions(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths]).to(DEVICE)


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]
) -> torch.Tensor:
    group, d = q.shape[1] // k.shape[1], q.shape[2]
    out, start = [], 0
    for n in lengths:
        qs = q[start : start + n].double().transpose(0, 1)
        ks = k[start : start + n].double().repeat_interleave(group, 1).transpose(0, 1)
        vs = v[start : start + n].double().repeat_interleave(group, 1).transpose(0, 1)
        s = qs @ ks.transpose(1, 2) * d**-0.5
        mask = torch.ones(n, n, dtype=torch.bool, device=DEVICE).triu(1)
        out.append((s.masked_fill(mask, float("-inf")).softmax(-1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(32, 8, 128), (32, 4, 128), (32, 8, 64)])
@pytest.mark.parametrize("lengths", [[1024], [300, 1, 77, 600], [2048]], ids=["1k", "mixed", "2k"])
@pytest.mark.parametrize("tiles", [FreshTiles(), FreshTiles(128, 64, 8, 2)], ids=["default", "128"])
def test_matches_float64(
    heads: int, kv_heads: int, d: int, lengths: list[int], tiles: FreshTiles
) -> None:
    n = sum(lengths)
    q, k, v = _split(_qkv(n, heads, kv_heads, d, seed=n + d), heads, kv_heads)
    out = torch.empty(n, heads, d, dtype=torch.bfloat16, device=DEVICE)
    fresh_prefill(q, k, v, _positions(lengths), out, d**-0.5, fresh_tiles=tiles)
    ref = _reference(q, k, v, lengths)
    err = (out.double() - ref).abs().max().item()
    assert err < 1e-2 * ref.abs().max().item(), err


def test_e4m3_pages_attended_as_they_hold_k_and_v() -> None:
    """``kv_e4m3``: k and v rounded to e4m3 on the GPU as the pool rounds
    them (``KVPool.stored``: saturated at +-448, to nearest even), V scaled
    so that some saturate."""
    heads, kv_heads, d, lengths = 32, 8, 128, [700, 324]
    n = sum(lengths)
    q, k, v = _split(_qkv(n, heads, kv_heads, d, seed=9), heads, kv_heads)
    v.mul_(200.0)
    out = torch.empty(n, heads, d, dtype=torch.bfloat16, device=DEVICE)
    fresh_prefill(q, k, v, _positions(lengths), out, d**-0.5, kv_e4m3=True)

    def paged(x: torch.Tensor) -> torch.Tensor:
        return x.clamp(-448, 448).to(torch.float8_e4m3fn).to(x.dtype)

    assert (v.abs() > 448).any()
    ref = _reference(q, paged(k), paged(v), lengths)
    err = (out.double() - ref).abs().max().item()
    assert err < 1e-2 * ref.abs().max().item(), err


def test_one_graph_serves_other_prompts_of_the_same_rows() -> None:
    """Captured once with one split of 512 rows into prompts, replayed with
    others (the positions and q/k/v refilled in place): each replay equals
    the kernel run eagerly on the same inputs, to the bit."""
    heads, kv_heads, d, n = 32, 8, 128, 512
    qkv = _qkv(n, heads, kv_heads, d, seed=1)
    q, k, v = _split(qkv, heads, kv_heads)
    positions = _positions([n])
    out = torch.empty(n, heads, d, dtype=torch.bfloat16, device=DEVICE)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fresh_prefill(q, k, v, positions, out, d**-0.5)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        fresh_prefill(q, k, v, positions, out, d**-0.5)
    for seed, lengths in enumerate([[n], [100, 412], [1, 1, 510], [256, 256]]):
        qkv.copy_(_qkv(n, heads, kv_heads, d, seed=seed + 2))
        positions.copy_(_positions(lengths))
        graph.replay()
        eager = torch.empty_like(out)
        fresh_prefill(q, k, v, positions, eager, d**-0.5)
        torch.cuda.synchronize()
        assert torch.equal(out, eager), lengths
        ref = _reference(q, k, v, lengths)
        assert (out.double() - ref).abs().max().item() < 1e-2 * ref.abs().max().item()
