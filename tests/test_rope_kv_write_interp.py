"""The fused q/k prologue and KV write (``engine.attention.rope_kv_write``)
under Triton's interpreter (no GPU needed), against the layer's separate steps
in torch: the reference norms (``TorchKernels``), the rotation in float64 from
the same cos/sin table, the K/V scales, and ``KVPool.write`` at the slots
FlashInfer's append index names. The whole pool is compared, so a row written
to the wrong page, slot, layer or head fails as much as a wrong value.

The interpreter must be chosen before triton is first imported, so these run
in a child process started with ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import pytest
import torch
from triton_interp import interpreted, parent_only, run_interpreted

from engine.attention.rope_kv_write import AppendIndex, QKPrologue
from engine.kvcache.pool import KV_FP8, KVPool, KVPoolConfig
from engine.layers.kernels import TorchKernels
from engine.layers.rotary import RotaryEmbedding

HEADS, KV_HEADS, PAGE_SIZE, LAYER = 4, 2, 4, 1
EXTENDS = [(3, 3, [3, 5]), (9, 1, [2, 6, 7]), (0, 5, [1, 4])]
"""Per request: (cached tokens, new tokens, page table). A prompt's chunk after
a cached prefix, a decode row past a page boundary, a fresh prompt."""


@parent_only
def test_kernel_under_the_interpreter() -> None:
    run_interpreted(__file__, timeout_s=600)


def _index() -> AppendIndex:
    """As ``FlashInferAttention.begin_forward`` builds it."""
    indptr, indices, last_len, requests, positions = [0], [], [], [], []
    for r, (cached, new, table) in enumerate(EXTENDS):
        seq = cached + new
        n = -(-seq // PAGE_SIZE)
        indices.extend(table[:n])
        indptr.append(indptr[-1] + n)
        last_len.append(seq - (n - 1) * PAGE_SIZE)
        requests += [r] * new
        positions += list(range(cached, seq))

    def i32(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int32)

    return AppendIndex(i32(requests), i32(positions), i32(indptr), i32(indices), i32(last_len))


def _pool(dtype: torch.dtype, head_dim: int) -> KVPool:
    return KVPool(KVPoolConfig(8, PAGE_SIZE, 2, KV_HEADS, head_dim, dtype=dtype))


def _reference(
    qkv: torch.Tensor, pre: QKPrologue, pool: KVPool, index: AppendIndex
) -> torch.Tensor:
    """The rewritten q; ``pool`` written as the separate steps write it."""
    n, d = qkv.shape[0], pre.table.shape[1]
    q, k, v = qkv.split([HEADS * d, KV_HEADS * d, KV_HEADS * d], dim=-1)
    q, k, v = q.view(n, HEADS, d), k.view(n, KV_HEADS, d), v.view(n, KV_HEADS, d)
    if pre.q_norm is not None:
        torch_kernels = TorchKernels()
        q = torch_kernels.rms_norm(q, pre.q_norm, pre.eps)
        k = torch_kernels.rms_norm(k, pre.k_norm, pre.eps)
    cos, sin = pre.table.double()[pre.positions.long()][:, None].chunk(2, dim=-1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.double().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    ks, vs = pre.kv_scales or (1.0, 1.0)
    q, k, v = rotate(q) * ks, rotate(k) / ks, v.double() / vs
    ptr, table, pos = index.indptr.long(), index.indices.long(), index.positions.long()
    page = table[ptr[index.batch_indices.long()] + pos // PAGE_SIZE]
    pool.write(LAYER, page, pos % PAGE_SIZE, k.float(), v.float())
    return q.to(qkv.dtype)


def _close(got: torch.Tensor, ref: torch.Tensor, rel: float, fp8: bool) -> None:
    g, r = got.double(), ref.double()
    # e4m3's subnormals are 2^-9 apart: one step there is more than ``rel``.
    bad = (g - r).abs() > rel * r.abs() + (2**-9 if fp8 else 1e-6)
    if fp8:
        # The interpreter's float-to-e4m3 conversion mis-rounds values that
        # round up to a power of two (e.g. 125.4 to 64; the GPU's instruction
        # does not): those elements are left out, everything else is checked.
        power = (r.abs() > 0) & (torch.log2(r.abs()) == torch.log2(r.abs()).round())
        bad &= ~power
    assert not bad.any(), (bad.sum().item(), g[bad][:8].tolist(), r[bad][:8].tolist())


@interpreted
@pytest.mark.parametrize("head_dim", [32, 128])
@pytest.mark.parametrize("norms", [False, True])
@pytest.mark.parametrize(
    ("dtype", "kv_dtype", "scales"),
    [
        # fp16 only: the interpreter truncates float32 to bfloat16 where the
        # GPU rounds (bf16 runs in tests/test_rope_kv_write_gpu.py).
        (torch.float16, torch.float16, None),
        (torch.float16, KV_FP8, None),
        (torch.float16, KV_FP8, (0.02, 0.125)),  # some K beyond e4m3's range
    ],
)
def test_matches_the_separate_steps(
    head_dim: int,
    norms: bool,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    scales: tuple[float, float] | None,
) -> None:
    from engine.attention.rope_kv_write import rope_kv_write

    g = torch.Generator().manual_seed(head_dim + norms)
    index = _index()
    n = index.positions.numel()
    width = (HEADS + 2 * KV_HEADS) * head_dim
    qkv = (torch.randn(n, width, generator=g) * 3).to(dtype)
    rotary = RotaryEmbedding(head_dim, 10000.0, None, 64, TorchKernels())
    weight = [(1 + 0.3 * torch.randn(head_dim, generator=g)).to(dtype) for _ in range(2)]
    pre = QKPrologue(
        positions=index.positions.long(),
        table=rotary.table(),
        q_norm=weight[0] if norms else None,
        k_norm=weight[1] if norms else None,
        eps=1e-6,
        kv_scales=scales,
    )
    pool, ref_pool = _pool(kv_dtype, head_dim), _pool(kv_dtype, head_dim)
    ref_q = _reference(qkv.clone(), pre, ref_pool, index)

    q, k, v = qkv.split([HEADS * head_dim, KV_HEADS * head_dim, KV_HEADS * head_dim], dim=-1)
    q = q.view(n, HEADS, head_dim)  # views into the projection's output, as a layer passes them
    k, v = k.view(n, KV_HEADS, head_dim), v.view(n, KV_HEADS, head_dim)
    rope_kv_write(q, k, v, pre, pool.k_layer(LAYER), pool.v_layer(LAYER), index)

    # One rounding of each value to fp16 (2^-11 of it), against a rotation in
    # float64; e4m3 values at most one step (2^-3 of the value) apart, where
    # the two round a tie differently.
    rel = 4e-3
    _close(q, ref_q, rel, False)
    assert torch.equal(pool.kv[:, 1 - LAYER].float(), torch.zeros_like(pool.kv[:, 0].float()))
    fp8 = kv_dtype == KV_FP8
    _close(pool.kv.float(), ref_pool.kv.float(), 0.13 if fp8 else rel, fp8)
    written = (pool.kv[:, LAYER].float() != 0).flatten(2).any(-1)  # [page, k or v]
    assert written[:, 0].nonzero().flatten().tolist() == [1, 3, 4, 5, 7]


@interpreted
@pytest.mark.parametrize(("kv_dtype", "qk_norm"), [(torch.float16, True), (KV_FP8, False)])
def test_warm_up_writes_only_the_scratch_page(kv_dtype: torch.dtype, qk_norm: bool) -> None:
    """Both row blocks run at start-up, and every row they write lands in the
    reserved page 0: what the pool's other pages hold is untouched."""
    from engine.attention.rope_kv_write import ROWS_LARGE, ROWS_SMALL, warm_up

    pool = _pool(kv_dtype, 32)
    pool.kv.copy_(
        (torch.randn(pool.kv.shape, generator=torch.Generator().manual_seed(0)) + 3).to(kv_dtype)
    )
    before = pool.kv.float().clone()
    assert warm_up(pool, HEADS, qk_norm, torch.float16) == [ROWS_SMALL, ROWS_LARGE]
    after = pool.kv.float()
    assert torch.equal(after[1:], before[1:])
    assert not after[0, 0, :, 0].any()  # layer 0's K and V at slot 0: the zero rows written
    assert torch.equal(after[0, 1:], before[0, 1:])


@interpreted
@pytest.mark.parametrize(("kv_dtype", "scales"), [(torch.float16, None), (KV_FP8, (0.02, 0.125))])
def test_write_back_over_each_row_as_its_own_request(
    kv_dtype: torch.dtype, scales: tuple[float, float] | None
) -> None:
    """The fresh-prompt form (``FlashInferAttention.forward_fresh_fused``):
    row i as request i of one page, its page and slot in place of a
    position. The pool and q come out as the append index of the same slots
    writes them, to the bit; with ``write_back`` k and v are left as the
    pages hold them (rounded once, over their scales), widened."""
    from engine.attention.rope_kv_write import rope_kv_write

    g = torch.Generator().manual_seed(5)
    index = _index()
    n, d = index.positions.numel(), 32
    ptr, table = index.indptr.long(), index.indices.long()
    pos = index.positions.long()
    pages = table[ptr[index.batch_indices.long()] + pos // PAGE_SIZE]
    slots = pos % PAGE_SIZE
    rows = torch.arange(n)
    fresh = AppendIndex(rows, slots, rows, pages, rows)
    qkv = (torch.randn(n, (HEADS + 2 * KV_HEADS) * d, generator=g) * 3).to(torch.float16)
    rotary = RotaryEmbedding(d, 10000.0, None, 64, TorchKernels())
    pre = QKPrologue(pos, rotary.table(), None, None, 1e-6, scales)
    outs = []
    for ix, back in ((index, False), (fresh, True)):
        x = qkv.clone()
        q, k, v = x.split([HEADS * d, KV_HEADS * d, KV_HEADS * d], dim=-1)
        q, k, v = q.view(n, HEADS, d), k.view(n, KV_HEADS, d), v.view(n, KV_HEADS, d)
        pool = _pool(kv_dtype, d)
        rope_kv_write(q, k, v, pre, pool.k_layer(LAYER), pool.v_layer(LAYER), ix, write_back=back)
        outs.append((x, pool, k, v))
    (x0, pool0, k0, v0), (x1, pool1, k1, v1) = outs
    assert torch.equal(pool1.kv.float(), pool0.kv.float())
    assert torch.equal(x1[:, : HEADS * d], x0[:, : HEADS * d])  # q: rotated alike
    assert torch.equal(
        k0.float(), qkv[:, HEADS * d : (HEADS + KV_HEADS) * d].view(n, -1, d).float()
    )
    held_k = pool1.k_layer(LAYER)[pages, slots].to(torch.float16)
    held_v = pool1.v_layer(LAYER)[pages, slots].to(torch.float16)
    for back, held in ((k1, held_k), (v1, held_v)):
        off = back != held
        if kv_dtype == KV_FP8:
            # The write-back rounds on its own, as the GPU's cast does (to
            # the bit: test_write_back_rounds_as_the_cast here, the pages
            # themselves in tests/test_rope_kv_write_gpu.py). The
            # interpreter's cast, which wrote these pages, rounds ties up
            # and some values that round up to a power of two to half that
            # power: there the two may be one e4m3 step apart, or a factor 2.
            b, h = back.float(), held.float()
            step = torch.exp2(torch.floor(torch.log2(torch.maximum(b.abs(), h.abs()))) - 3)
            off &= ((b - h).abs() > step.clamp(min=2**-9)) & (b != 2 * h)
        assert not off.any(), (back[off][:8].tolist(), held[off][:8].tolist())
    assert not torch.equal(k1, k0)  # rewritten: rotated, over the scale


@interpreted
def test_write_back_rounds_as_the_cast() -> None:
    """On e4m3 pages ``write_back`` leaves k and v as torch's cast to e4m3
    rounds them (saturated, ties to even), over the probes of
    ``e4m3_values``. At position 0, with no norms and no scales, the rotation
    leaves the rows as they are, so that cast of the inputs is the reference.
    (The pages themselves come from Triton's cast, which the interpreter
    mis-rounds: tests/test_rope_kv_write_gpu.py checks them on the GPU.)"""
    from e4m3_values import e4m3_rounded, probe_rows

    from engine.attention.rope_kv_write import rope_kv_write

    n, d = 16, 32
    rows = torch.arange(n)
    index = AppendIndex(rows, rows % PAGE_SIZE, rows, rows // PAGE_SIZE, rows)
    qkv = torch.zeros(n, (HEADS + 2 * KV_HEADS) * d, dtype=torch.float16)
    kv = qkv[:, HEADS * d :]
    kv.copy_(probe_rows(n, 2 * KV_HEADS * d, seed=3))
    want = e4m3_rounded(kv)
    rotary = RotaryEmbedding(d, 10000.0, None, 64, TorchKernels())
    pre = QKPrologue(torch.zeros(n, dtype=torch.int64), rotary.table(), None, None, 1e-6, None)
    q, k, v = qkv.split([HEADS * d, KV_HEADS * d, KV_HEADS * d], dim=-1)
    pool = _pool(KV_FP8, d)
    rope_kv_write(
        q.view(n, HEADS, d), k.view(n, KV_HEADS, d), v.view(n, KV_HEADS, d), pre,
        pool.k_layer(LAYER), pool.v_layer(LAYER), index, write_back=True,
    )  # fmt: skip
    got = kv.float()
    assert torch.equal(got, want), (got != want).sum().item()


@interpreted
def test_rejects_what_it_cannot_take() -> None:
    from engine.attention.rope_kv_write import rope_kv_write

    index = _index()
    n = index.positions.numel()
    pool = _pool(torch.float16, 48)
    table = RotaryEmbedding(48, 10000.0, None, 64, TorchKernels()).table()
    x = torch.zeros(n, HEADS, 48, dtype=torch.float16)
    kv = torch.zeros(n, KV_HEADS, 48, dtype=torch.float16)
    pre = QKPrologue(index.positions.long(), table, None, None, 1e-6, None)
    with pytest.raises(ValueError, match="power of two"):
        rope_kv_write(x, kv, kv, pre, pool.k_layer(0), pool.v_layer(0), index)
    pool = _pool(torch.float16, 32)
    x, kv = x[..., :32], kv[..., :32].contiguous()
    pre = pre._replace(q_norm=torch.ones(32, dtype=torch.float16))
    with pytest.raises(ValueError, match="together"):
        rope_kv_write(x, kv, kv, pre, pool.k_layer(0), pool.v_layer(0), index)


TINY_RAW = {
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 128,
}
"""A one-layer config.json of heads the fused kernel takes (q/k norms: Qwen3)."""


def test_the_fused_kernel_is_refused_without_flashinfer_attention() -> None:
    from engine.config import EngineConfig
    from engine.model_config import ModelConfig

    mc = ModelConfig.from_dict(TINY_RAW, dtype=torch.float32)
    cfg = EngineConfig(model="m", device="cpu", fuse_rope_kv_write=True)
    with pytest.raises(ValueError, match="fuse_rope_kv_write needs attention_backend 'flashinfer'"):
        cfg.resolve(mc)
    assert not EngineConfig(model="m", device="cpu").resolve(mc).fuse_rope_kv_write


def test_the_fused_prologue_is_auto_on_e4m3_pages_with_flashinfer() -> None:
    """auto: on over e4m3 pages, or for q/k norms, with flashinfer attention
    where the kernel takes the heads; off for Llama over pages of the model's
    dtype, with torch_native attention, or for heads it cannot take; a value
    given is kept."""
    from dataclasses import replace

    from engine.config import EngineConfig
    from engine.model_config import ModelConfig

    raw = {**TINY_RAW, "architectures": ["LlamaForCausalLM"]}
    mc = ModelConfig.from_dict(raw, dtype=torch.float32)
    odd = ModelConfig.from_dict({**raw, "head_dim": 48}, dtype=torch.float32)
    assert EngineConfig().fuse_rope_kv_write is None
    fi = EngineConfig(load_format="dummy", device="cpu", attention_backend="flashinfer")
    e4m3 = replace(fi, kv_cache_dtype="fp8_e4m3")
    assert fi.resolve(mc).fuse_rope_kv_write is False
    assert e4m3.resolve(mc).fuse_rope_kv_write is True
    assert e4m3.resolve(odd).fuse_rope_kv_write is False
    assert replace(e4m3, fuse_rope_kv_write=False).resolve(mc).fuse_rope_kv_write is False
    assert replace(fi, fuse_rope_kv_write=True).resolve(mc).fuse_rope_kv_write is True
    native = replace(e4m3, attention_backend="torch_native")
    assert native.resolve(mc).fuse_rope_kv_write is False
    # q/k norms: on over pages of the model's dtype too.
    qwen3 = ModelConfig.from_dict(TINY_RAW, dtype=torch.float32)
    assert fi.resolve(qwen3).fuse_rope_kv_write is True
