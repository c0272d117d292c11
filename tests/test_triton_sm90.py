"""Every Triton kernel the engine launches on CUDA, compiled for the H200's
architecture (sm_90) on the CPU, with the arguments the engine's own launch
code passes at real model shapes (Llama-3.1-8B and the mixture-of-experts presets).

CI has no GPU, and Triton's interpreter (the kernel tests' CPU path) runs a
kernel's Python, not its compiler: a kernel the compiler refuses (a
loop-carried value that changes type, a shape it cannot lay out) or that needs
more shared memory than an SM has would otherwise fail first on the GPU.
Nothing runs here: each launch is caught (``JITFunction.run``) and handed to
``triton.compile`` with sm_90 as the target, down to the cubin (Triton's
bundled ptxas). Identical compiles are made once."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
pytest.importorskip("triton.compiler")

try:
    from harness import sm90
except ImportError as e:  # Triton's internals moved: say so, do not fail the suite
    pytest.skip(f"triton {triton.__version__}: {e}", allow_module_level=True)

from engine.layers import (  # noqa: E402
    fp8,
    fp8_quant,
    fp8_skinny,
    gemv,
    moe_route,
    moe_triton,
    norm_triton,
    skinny,
)
from engine.layers.fp8_quant import Quantized  # noqa: E402
from engine.model_config import ModelConfig  # noqa: E402
from engine.presets import PRESETS  # noqa: E402

pytestmark = pytest.mark.skipif(sm90.supported() is not None, reason=str(sm90.supported()))

SM90_SHARED_BYTES = sm90.SHARED_BYTES
Launch = sm90.Launch
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def launches() -> Iterator[list[Launch]]:
    """Kernel launches caught instead of run, in order."""
    with sm90.caught_launches() as caught:
        yield caught


_compiled: dict[tuple, int] = {}
"""Compile key -> shared memory bytes, for the whole module."""


def compile_sm90(launch: Launch) -> int:
    """Compile a caught launch for sm_90 as Triton would for that call on an
    H200 (its specialization of each argument, its options); the kernel's
    shared memory in bytes."""
    key = sm90.specialized(launch)[0]
    if key not in _compiled:
        out = sm90.compile_launch(launch)
        assert "cubin" in out.asm
        _compiled[key] = out.metadata.shared
    return _compiled[key]


def ptx_sm90(launch: Launch) -> str:
    """The PTX of a caught launch compiled for sm_90."""
    return sm90.compile_launch(launch).asm["ptx"]


def compile_all(launches: list[Launch], expect: int) -> None:
    assert len(launches) == expect, [k.fn.__name__ for k, _, _ in launches]
    for launch in launches:
        shared = compile_sm90(launch)
        assert shared <= SM90_SHARED_BYTES, (launch[0].fn.__name__, shared)


def projections(preset: str) -> dict[str, tuple[int, int]]:
    """``name -> (N, K)`` of a dense preset's products."""
    c = ModelConfig.from_dict(PRESETS[preset], dtype=torch.bfloat16)
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {
        "qkv": (q + 2 * kv, c.hidden_size),
        "o": (c.hidden_size, q),
        "gate_up": (2 * c.intermediate_size, c.hidden_size),
        "down": (c.hidden_size, c.intermediate_size),
        "lm_head": (c.vocab_size, c.hidden_size),
    }


LLAMA = projections("llama-3.1-8b")


def _empty(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype)


@pytest.mark.parametrize("name", sorted(LLAMA))
def test_one_row_gemv(name: str, launches: list[Launch]) -> None:
    n, k = LLAMA[name]
    t = gemv.tiles(n, k)
    assert t is not None
    gemv.run_gemv(_empty(1, k), _empty(n, k), None, t)
    expect = 1
    if name == "down":  # the SiLU-and-mul GEMV over the gate/up output
        gemv.run_silu_gemv(_empty(1, 2 * k), _empty(n, k), t)
        expect = 2
    compile_all(launches, expect)


@pytest.mark.parametrize("rows", [2, 17, 33])
@pytest.mark.parametrize("name", sorted(LLAMA))
def test_few_rows(name: str, rows: int, launches: list[Launch]) -> None:
    n, k = LLAMA[name]
    t = skinny.tiles(rows, n, k)
    if t is None:
        pytest.skip("cuBLAS serves this shape")
    skinny.run_skinny(_empty(rows, k), _empty(n, k), None, t)
    compile_all(launches, 1)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("name", ["qkv", "o", "gate_up", "down"])
def test_fp8_few_rows(name: str, bias: bool, launches: list[Launch]) -> None:
    n, k = LLAMA[name]
    x, q = _empty(3, k), _empty(n, k, dtype=fp8.E4M3)
    t = fp8_skinny.fits(x, q)
    assert t is not None
    b = _empty(n) if bias else None
    fp8_skinny.run(x, q, _empty(n, dtype=torch.float32), b, t)
    fp8_skinny.run(x, q, _empty(n, dtype=torch.float32), b, t._replace(unroll_scale=False))
    rows = Quantized(_empty(3, k, dtype=fp8.E4M3), _empty(3, dtype=torch.float32), x.dtype)
    fp8_skinny.run(rows, q, _empty(n, dtype=torch.float32), b, t)
    # 64-row tiles (past what the engine gives it; two stages fit in shared memory).
    wide = Quantized(_empty(40, k, dtype=fp8.E4M3), _empty(40, dtype=torch.float32), x.dtype)
    fp8_skinny.run(wide, q, _empty(n, dtype=torch.float32), b, t._replace(stages=2))
    compile_all(launches, 4)


@pytest.mark.parametrize("rows", [1, fp8_skinny.DEFERRED_ROWS])
def test_fp8_gated_mlp(rows: int, launches: list[Launch]) -> None:
    """Llama-3.1-8B's MLP in two kernels: gate/up with SiLU-and-mul in its
    epilogue, then down quantizing its rows as it loads them."""
    (n, k), (n2, k2) = LLAMA["gate_up"], LLAMA["down"]
    x = Quantized(
        _empty(rows, k, dtype=fp8.E4M3), _empty(rows, dtype=torch.float32), torch.bfloat16
    )
    w13 = _empty(n, k, dtype=fp8.E4M3)
    t = fp8_skinny.gated_fits(x, w13)
    assert t is not None
    h = fp8_skinny.gated(x, w13, _empty(n, dtype=torch.float32), t)
    w2 = _empty(n2, k2, dtype=fp8.E4M3)
    t2 = fp8_skinny.fits(h, w2)
    assert t2 is not None
    fp8_skinny.run(h, w2, _empty(n2, dtype=torch.float32), None, t2)
    compile_all(launches, 2)


@pytest.mark.parametrize("k", [4096, 14336])
def test_fp8_activation_quantization(k: int, launches: list[Launch]) -> None:
    fp8_quant.quantize_rows(_empty(64, k))
    compile_all(launches, 1)


@pytest.mark.parametrize(("hidden", "inter"), [(4096, 14336), (8192, 28672)])
def test_fp8_quantization_fused_into_norm_and_silu(
    hidden: int, inter: int, launches: list[Launch]
) -> None:
    """Llama-3.1-8B's and -70B's widths, each row held whole (up to 32k values)."""
    x, w = _empty(64, hidden), _empty(hidden)
    fp8_quant.norm_quantize(x, _empty(64, hidden), w, 1e-5)
    fp8_quant.norm_quantize(x, None, w, 1e-5)
    fp8_quant.silu_mul_quantize(_empty(64, 2 * inter))
    compile_all(launches, 3)


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "qwen1.5-moe-a2.7b", "mixtral-8x7b"])
def test_mixture_of_experts_every_kernel_choice(preset: str, launches: list[Launch]) -> None:
    """What ``moe_triton.warm_up`` compiles when a CUDA runner starts:
    every kernel choice up to 8192 tokens at each MoE preset's shapes."""
    c = ModelConfig.from_dict(PRESETS[preset], dtype=torch.bfloat16)
    assert c.moe is not None
    e, h, i = c.moe.num_experts, c.hidden_size, c.moe.intermediate_size
    ran = moe_triton.warm_up(
        _empty(e, h), _empty(e, 2 * i, h), _empty(e, h, i), c.moe.top_k, True, 8192
    )
    assert len(ran) >= 2  # the matrix-vector path and the grouped one at least
    names = {k.fn.__name__ for k, _, _ in launches}
    assert {"route_kernel", "gemv_gate_up_kernel", "grouped_down_kernel", "align_kernel"} <= names
    compile_all(launches, len(launches))


@pytest.mark.parametrize("case", ["greedy", "top_k_top_p", "top_p"])
def test_sampler(case: str, launches: list[Launch]) -> None:
    from engine.sampling import SamplingBatch
    from engine.sampling_triton import sample_cuda
    from protocol.sampling import SamplingParams

    params = {
        "greedy": SamplingParams(temperature=0.0),
        "top_k_top_p": SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
        "top_p": SamplingParams(temperature=0.8, top_p=0.9),
    }[case]
    vocab = LLAMA["lm_head"][0]
    batch = SamplingBatch.build([params] * 4, [1] * 4, [0] * 4, vocab, "cpu")
    sample_cuda(_empty(4, vocab, dtype=torch.float32), batch)
    compile_all(launches, 2 if case == "greedy" else 7)


def test_grammar_mask(launches: list[Launch]) -> None:
    from engine.grammar_triton import apply_packed_bitmask

    vocab = LLAMA["lm_head"][0]
    words = -(-vocab // 32)
    apply_packed_bitmask(
        _empty(4, vocab, dtype=torch.float32), _empty(4 * (1 + words), dtype=torch.int32), 4
    )
    compile_all(launches, 1)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, fp8.E4M3])
@pytest.mark.parametrize("preset", ["llama-3.1-8b", "qwen3-30b-a3b"])
def test_rope_and_kv_write(preset: str, kv_dtype: torch.dtype, launches: list[Launch]) -> None:
    """At one token and at a long prompt (the two row blocks), with all the
    model's KV heads and with one (a rank of a tensor-parallel group: an
    argument of 1, which Triton would otherwise make a constant)."""
    from engine.attention.rope_kv_write import AppendIndex, QKPrologue, rope_kv_write
    from engine.kvcache.pool import KVPool, KVPoolConfig

    c = ModelConfig.from_dict(PRESETS[preset], dtype=torch.bfloat16)
    d = c.head_dim
    table = _empty(1024, d, dtype=torch.float32)
    norm = _empty(d) if c.qk_norm else None
    for kv_heads in (c.num_kv_heads, 1):
        pool = KVPool(KVPoolConfig(4, 16, c.num_layers, kv_heads, d, dtype=kv_dtype))
        for n in (1, 8192):
            qkv = _empty(n, (c.num_heads + 2 * kv_heads) * d)
            q, k, v = qkv.split([c.num_heads * d, kv_heads * d, kv_heads * d], dim=-1)
            ints = torch.zeros(n, dtype=torch.int32)
            index = AppendIndex(ints, ints, ints, ints, ints)
            pre = QKPrologue(torch.zeros(n, dtype=torch.int64), table, norm, norm, 1e-6, None)
            rope_kv_write(
                q.view(n, c.num_heads, d),
                k.view(n, kv_heads, d),
                v.view(n, kv_heads, d),
                pre,
                pool.k_layer(3),
                pool.v_layer(3),
                index,
            )
    # A fresh-prompt bucket's graph (``forward_fresh_fused``): int64 rows,
    # pages and slots, k and v written back; a small bucket and a large one
    # (the two row blocks).
    for n in (16, 2048):
        qkv = _empty(n, (c.num_heads + 2 * c.num_kv_heads) * d)
        q, k, v = qkv.split([c.num_heads * d, c.num_kv_heads * d, c.num_kv_heads * d], dim=-1)
        rows = torch.zeros(n, dtype=torch.int64)
        pool = KVPool(KVPoolConfig(4, 16, c.num_layers, c.num_kv_heads, d, dtype=kv_dtype))
        pre = QKPrologue(rows, table, norm, norm, 1e-6, None)
        rope_kv_write(q.view(n, c.num_heads, d), k.view(n, c.num_kv_heads, d),
                      v.view(n, c.num_kv_heads, d), pre, pool.k_layer(3), pool.v_layer(3),
                      AppendIndex(rows, rows, rows, rows, rows), write_back=True)  # fmt: skip
    assert [kw["WRITE_BACK"] for _, _, kw in launches[-2:]] == [True, True]
    compile_all(launches, 6)
    if kv_dtype == fp8.E4M3:
        # Widening the half-row e4m3 tensors of the K branch is what Triton
        # 3.6 compiles wrongly for sm_90: the write-back computes the pages'
        # values in float32 instead, so no e4m3 value is widened there.
        for launch in launches[-2:]:
            assert "cvt.rn.f16x2.e4m3x2" not in ptx_sm90(launch)


@pytest.mark.parametrize("preset", ["llama-3.1-8b", "qwen3-30b-a3b"])
def test_rope_and_kv_write_warm_up(preset: str, launches: list[Launch]) -> None:
    """What a runner with the fused prologue compiles at start-up: both row
    blocks, as the model's forwards then launch them."""
    from engine.attention.rope_kv_write import ROWS_LARGE, ROWS_SMALL, warm_up
    from engine.kvcache.pool import KVPool, KVPoolConfig

    c = ModelConfig.from_dict(PRESETS[preset], dtype=torch.bfloat16)
    pool = KVPool(KVPoolConfig(4, 16, c.num_layers, c.num_kv_heads, c.head_dim, torch.bfloat16))
    assert warm_up(pool, c.num_heads, c.qk_norm, torch.bfloat16) == [ROWS_SMALL, ROWS_LARGE]
    assert [kw["ROWS"] for _, _, kw in launches] == [ROWS_SMALL, ROWS_LARGE]
    compile_all(launches, 2)


def test_rope_and_kv_write_compiles_once_per_model(launches: list[Launch]) -> None:
    """Forwards of other token counts, and index tensors at other offsets of
    the buffer they are copied in, reuse one binary (per row block): no
    compile while requests wait."""
    from engine.attention.rope_kv_write import AppendIndex, QKPrologue, rope_kv_write
    from engine.kvcache.pool import KVPool, KVPoolConfig

    pool = KVPool(KVPoolConfig(4, 16, 2, 8, 128, dtype=torch.bfloat16))
    table = _empty(1024, 128, dtype=torch.float32)
    flat = torch.zeros(4096, dtype=torch.int32)
    for n, offset in ((1, 0), (2, 1), (3, 3), (16, 4), (17, 7), (32, 16)):
        qkv = _empty(n, 48 * 128)
        q, k, v = qkv.split([32 * 128, 8 * 128, 8 * 128], dim=-1)
        ints = flat[offset : offset + n]
        pre = QKPrologue(ints.long(), table, None, None, 1e-6, None)
        rope_kv_write(
            q.view(n, 32, 128),
            k.view(n, 8, 128),
            v.view(n, 8, 128),
            pre,
            pool.k_layer(1),
            pool.v_layer(1),
            AppendIndex(ints, flat[offset + 1 : offset + 1 + n], ints, ints, ints),
        )
    keys = {sm90.specialized(launch)[0] for launch in launches}
    assert len(launches) == 6 and len(keys) == 1, len(keys)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, fp8.E4M3])
@pytest.mark.parametrize("preset", ["llama-3.1-8b", "qwen3-30b-a3b"])
def test_paged_decode_attention(preset: str, kv_dtype: torch.dtype, launches: list[Launch]) -> None:
    """Batch 1 and 8 (split over the pages: the split kernel, then the
    merge) and 256 (one split), tiles of 4 and 8 pages, and batch 1 and 256
    in batch-invariant chunks of 16 pages, queries a view into the QKV
    output, in the page-major pool of the model's layers. The split count is
    no compile-time constant: every batch size's plan shares one binary per
    tile and kind (with partials or without), and even chunks one merge;
    batch-invariant chunks two more split binaries (with partials, and one
    merging its chunks itself) and one more merge."""
    from engine.attention import paged_decode as pd
    from engine.kvcache.pool import KVPool, KVPoolConfig

    c = ModelConfig.from_dict(PRESETS[preset], dtype=torch.bfloat16)
    d = c.head_dim
    pool = KVPool(KVPoolConfig(4, 16, c.num_layers, c.num_kv_heads, d, dtype=kv_dtype))
    for batch in (1, 8, 256):
        for block in (4, 8):
            q = _empty(batch, c.num_heads + 2 * c.num_kv_heads, d)[:, : c.num_heads]
            out = _empty(batch, c.num_heads, d)
            ints = torch.zeros(batch + 1, dtype=torch.int32)
            e4m3 = kv_dtype == fp8.E4M3  # V loaded with K, 8-page tiles on 4 warps
            plan = pd.plan(batch, c.num_kv_heads, block_pages=block, e4m3=e4m3)
            assert (plan.splits > 1) == (batch < 256)
            pd.paged_decode(q, pool.k_layer(3), pool.v_layer(3), ints, ints, ints[:batch], out,
                            d**-0.5, plan)  # fmt: skip
            if block == 4 and batch != 8:
                chunked = pd.plan(batch, c.num_kv_heads, chunk_pages=16, e4m3=e4m3)
                pd.paged_decode(q, pool.k_layer(3), pool.v_layer(3), ints, ints, ints[:batch],
                                out, d**-0.5, chunked)  # fmt: skip
    # Batch-invariant chunks at batch 256 (one split) merge in the split
    # kernel: no merge launch, and no scratch (a binary of its own, as one
    # split of even chunks has).
    compile_all(launches, 13)
    assert len({sm90.specialized(launch)[0] for launch in launches}) == 8


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, fp8.E4M3])
def test_paged_decode_heads_first(kv_dtype: torch.dtype, launches: list[Launch]) -> None:
    """The engine's plans with a request's KV heads' programs placed together
    (``DecodePlan.heads_first``: the grid's axes swapped), split at batch 1
    and whole at 256."""
    from engine.attention import paged_decode as pd
    from engine.kvcache.pool import KVPool, KVPoolConfig

    c = ModelConfig.from_dict(PRESETS["llama-3.1-8b"], dtype=torch.bfloat16)
    d = c.head_dim
    pool = KVPool(KVPoolConfig(4, 16, c.num_layers, c.num_kv_heads, d, dtype=kv_dtype))
    for batch in (1, 256):
        q = _empty(batch, c.num_heads + 2 * c.num_kv_heads, d)[:, : c.num_heads]
        out = _empty(batch, c.num_heads, d)
        ints = torch.zeros(batch + 1, dtype=torch.int32)
        plan = pd.plan(batch, c.num_kv_heads, e4m3=kv_dtype == fp8.E4M3)._replace(heads_first=True)
        pd.paged_decode(q, pool.k_layer(3), pool.v_layer(3), ints, ints, ints[:batch], out,
                        d**-0.5, plan)  # fmt: skip
    split = [kw for k, _, kw in launches if k.fn.__name__ == "split_attend"]
    assert [kw["HEADS_FIRST"] for kw in split] == [True, True]
    compile_all(launches, 3)


@pytest.mark.parametrize("preset", ["llama-3.1-8b", "qwen3-30b-a3b"])
def test_decode_attention_widens_e4m3_v_before_the_tensor_cores(
    preset: str, monkeypatch: pytest.MonkeyPatch, launches: list[Launch]
) -> None:
    """``DecodePlan.widen_v`` over e4m3 pages, as on an H200 (``widens``), at
    the split tiles (batch 1) and the whole-request ones (batch 256): the
    conversion instruction is there, and V reaches the tensor cores through
    16-bit transposing matrix loads, not one byte a load. Without it the
    byte loads are there (what the option exists to remove)."""
    from engine.attention import paged_decode as pd
    from engine.kvcache.pool import KVPool, KVPoolConfig

    monkeypatch.setattr(pd, "widens", lambda device: True)
    c = ModelConfig.from_dict(PRESETS[preset], dtype=torch.bfloat16)
    d = c.head_dim
    pool = KVPool(KVPoolConfig(4, 16, c.num_layers, c.num_kv_heads, d, dtype=fp8.E4M3))
    plans = []
    for batch in (1, 256):
        q = _empty(batch, c.num_heads + 2 * c.num_kv_heads, d)[:, : c.num_heads]
        out = _empty(batch, c.num_heads, d)
        ints = torch.zeros(batch + 1, dtype=torch.int32)
        for widen in (True, False):
            plan = pd.plan(batch, c.num_kv_heads, e4m3=True, widen_v=widen)
            assert plan.widen_v is widen
            plans.append(plan)
            pd.paged_decode(q, pool.k_layer(3), pool.v_layer(3), ints, ints, ints[:batch], out,
                            d**-0.5, plan)  # fmt: skip
    attends = [launch for launch in launches if launch[0].fn.__name__ == "split_attend"]
    assert len(attends) == 4
    for plan, launch in zip(plans, attends, strict=True):
        assert launch[2]["WIDEN_V"] is plan.widen_v
        assert compile_sm90(launch) <= SM90_SHARED_BYTES
        body = ptx_sm90(launch)
        byte_loads = re.findall(r"ld\.shared(?:\.v\d)?\.(?:b8|u8|s8)\b", body)
        if plan.widen_v:
            assert "cvt.rn.f16x2.e4m3x2" in body and "ldmatrix.sync.aligned" in body
            assert ".trans" in body and not byte_loads, (plan, len(byte_loads))
        else:
            assert byte_loads, plan
    # On a device without the instruction, or on the CPU, the option is dropped.
    monkeypatch.undo()
    assert not pd.widens(torch.device("cpu"))


def test_every_decode_kernel_with_programmatic_dependent_launch(
    monkeypatch: pytest.MonkeyPatch, launches: list[Launch]
) -> None:
    """As on an H200 (``pdl.enabled``): every Triton kernel of a decode step
    is launched with ``launch_pdl`` and compiles with the wait for the kernel
    before it and the early launch of the next as its first instructions."""
    from engine.attention import paged_decode as pd
    from engine.attention.rope_kv_write import AppendIndex, QKPrologue, rope_kv_write
    from engine.kvcache.pool import KVPool, KVPoolConfig
    from engine.layers import pdl

    monkeypatch.setattr(pdl, "enabled", lambda device: True)
    n, k = LLAMA["down"]
    t = gemv.tiles(n, k)
    assert t is not None
    gemv.run_gemv(_empty(1, k), _empty(n, k), None, t)
    gemv.run_silu_gemv(_empty(1, 2 * k), _empty(n, k), t)
    n, k = LLAMA["qkv"]
    s = skinny.tiles(17, n, k)
    assert s is not None
    skinny.run_skinny(_empty(17, k), _empty(n, k), None, s)
    q = _empty(n, k, dtype=fp8.E4M3)
    rows = Quantized(_empty(3, k, dtype=fp8.E4M3), _empty(3, dtype=torch.float32), torch.bfloat16)
    f = fp8_skinny.fits(rows, q)
    assert f is not None
    fp8_skinny.run(rows, q, _empty(n, dtype=torch.float32), None, f)
    fp8_quant.norm_quantize(_empty(4, k), _empty(4, k), _empty(k), 1e-5)
    fp8_quant.silu_mul_quantize(_empty(4, 2 * k))
    fp8_quant.quantize_rows(_empty(4, k))
    norm_triton.add_rms_norm(_empty(4, k), _empty(4, k), _empty(k), 1e-5)
    c = ModelConfig.from_dict(PRESETS["qwen3-30b-a3b"], dtype=torch.bfloat16)
    assert c.moe is not None
    e, h, i = c.moe.num_experts, c.hidden_size, c.moe.intermediate_size
    moe_triton.warm_up(_empty(e, h), _empty(e, 2 * i, h), _empty(e, h, i), c.moe.top_k, True, 5)
    d = c.head_dim
    pool = KVPool(KVPoolConfig(4, 16, c.num_layers, c.num_kv_heads, d, dtype=torch.bfloat16))
    qkv = _empty(1, (c.num_heads + 2 * c.num_kv_heads) * d)
    qh, kh, vh = qkv.split([c.num_heads * d, c.num_kv_heads * d, c.num_kv_heads * d], dim=-1)
    ints = torch.zeros(2, dtype=torch.int32)
    index = AppendIndex(ints[:1], ints[:1], ints, ints[:1], ints[:1])
    pre = QKPrologue(torch.zeros(1, dtype=torch.int64), _empty(64, d, dtype=torch.float32),
                     _empty(d), _empty(d), 1e-6, None)  # fmt: skip
    rope_kv_write(qh.view(1, c.num_heads, d), kh.view(1, c.num_kv_heads, d),
                  vh.view(1, c.num_kv_heads, d), pre, pool.k_layer(0), pool.v_layer(0), index)  # fmt: skip
    plan = pd.plan(1, c.num_kv_heads, block_pages=4)
    out = _empty(1, c.num_heads, d)
    pd.paged_decode(qh.view(1, c.num_heads, d), pool.k_layer(0), pool.v_layer(0), ints, ints,
                    ints[:1], out, d**-0.5, plan)  # fmt: skip
    names = set()
    for launch in launches:
        name = launch[0].fn.__name__
        assert launch[2].get("launch_pdl") is True and launch[2].get("PDL") is True, name
        ptx = ptx_sm90(launch)
        body = ptx[ptx.index(".entry") :]
        assert "griddepcontrol.wait" in body and "griddepcontrol.launch_dependents" in body, name
        # Nothing is read before the wait, and by default nothing prefetched.
        assert body.index("griddepcontrol.wait") < body.find("ld.global") % len(body), name
        assert "prefetch" not in body, name
        names.add(name)
    expected = {"gemv", "silu_gemv", "skinny", "fp8_skinny", "route_kernel", "rms_norm_kernel",
                "gemv_gate_up_kernel", "gemv_down_kernel", "align_kernel", "split_attend", "merge"}  # fmt: skip
    assert expected <= names, expected - names
    assert len(names) >= 15


def test_products_prefetch_their_weight_before_the_wait(
    monkeypatch: pytest.MonkeyPatch, launches: list[Launch]
) -> None:
    """With ``pdl.PREFETCH_BYTES`` set, the one-row products (bf16 and FP8:
    plain, gated, split over K on deferred rows) ask L2 for their weight rows'
    first bytes (one bulk prefetch a row, two for the gated gate and up rows)
    before the wait, and still read nothing before it; the experts' down
    kernel at one token, its experts' rows (the expert ids, routed two
    kernels back, its only read before the wait); the routing, once it has
    chosen the experts, their first gate and up rows."""
    from engine.layers import pdl

    monkeypatch.setattr(pdl, "enabled", lambda device: True)
    monkeypatch.setattr(pdl, "PREFETCH_BYTES", 16 << 20)
    n, k = LLAMA["qkv"]
    t = gemv.tiles(n, k)
    assert t is not None
    gemv.run_gemv(_empty(1, k), _empty(n, k), None, t)
    n, k = LLAMA["down"]
    t = gemv.tiles(n, k)
    assert t is not None
    gemv.run_silu_gemv(_empty(1, 2 * k), _empty(n, k), t)
    rows = Quantized(
        _empty(1, 4096, dtype=fp8.E4M3), _empty(1, dtype=torch.float32), torch.bfloat16
    )
    n, k = LLAMA["qkv"]
    q = _empty(n, k, dtype=fp8.E4M3)
    f = fp8_skinny.fits(rows, q)
    assert f is not None
    fp8_skinny.run(rows, q, _empty(n, dtype=torch.float32), None, f)
    n, k = LLAMA["gate_up"]
    w13 = _empty(n, k, dtype=fp8.E4M3)
    g = fp8_skinny.gated_fits(rows, w13)
    assert g is not None
    h = fp8_skinny.gated(rows, w13, _empty(n, dtype=torch.float32), g)
    n, k = LLAMA["down"]
    w2 = _empty(n, k, dtype=fp8.E4M3)
    d = fp8_skinny.fits(h, w2)
    assert d is not None and d.split_k > 1
    fp8_skinny.run(h, w2, _empty(n, dtype=torch.float32), None, d)
    # One token of Qwen3-30B-A3B's experts: the down kernel's, over its
    # token's experts (their ids read from L2 before the wait, nothing else).
    c = ModelConfig.from_dict(PRESETS["qwen3-30b-a3b"], dtype=torch.bfloat16)
    assert c.moe is not None
    e, h, i, top = c.moe.num_experts, c.hidden_size, c.moe.intermediate_size, c.moe.top_k
    ids = torch.zeros(1, top, dtype=torch.int32)
    moe_triton.fused_experts(_empty(1, h), _empty(e, 2 * i, h), _empty(e, h, i),
                             _empty(1, top, dtype=torch.float32), ids)  # fmt: skip
    assert [k[0].fn.__name__ for k in launches[5:]] == ["gemv_gate_up_kernel", "gemv_down_kernel"]
    del launches[5]  # gate/up: its experts are the kernel before's output
    assert len(launches) == 6
    # The routing, after it has chosen them: the experts' first gate and up rows.
    w13 = _empty(e, 2 * i, h)
    moe_route.route(_empty(1, e), top, True, w13=w13)
    route = launches.pop()
    assert route[2]["PREFETCH"] > 0 and route[2]["w13"] is w13
    body = ptx_sm90(route)
    body = body[body.index(".entry") :]
    wait = body.index("griddepcontrol.wait")
    assert "cp.async.bulk.prefetch" not in body[:wait]
    assert body[wait:].count("cp.async.bulk.prefetch.L2.global") >= 2
    for launch, bulk in zip(launches, [1, 1, 1, 2, 1, top]):
        name, kwargs = launch[0].fn.__name__, launch[2]
        assert kwargs["PREFETCH"] > 0, name
        body = ptx_sm90(launch)
        body = body[body.index(".entry") :]
        wait = body.index("griddepcontrol.wait")
        assert body[:wait].count("cp.async.bulk.prefetch.L2.global") == bulk, name
        assert "cp.async.bulk.prefetch" not in body[wait:], name
        early = re.findall(r"ld\.global[.\w]*", body[:wait])
        assert early == (["ld.global.cg.b32"] * top if name == "gemv_down_kernel" else []), early


def test_the_check_fails_a_kernel_the_compiler_refuses(launches: list[Launch]) -> None:
    """A loop-carried value whose type changes in the loop: the interpreter
    runs it, the compiler refuses it; so must this check."""
    import triton.language as tl

    @triton.jit
    def bad(x, K: tl.constexpr, BLOCK: tl.constexpr):
        kk = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in tl.static_range(0, K, BLOCK):
            v = tl.load(x + k0 + kk).to(tl.float32)
            acc += v
        for k0 in range(0, K, BLOCK):
            v = tl.load(x + k0 + kk)  # bf16 now: v was float32 before the loop
            acc += v.to(tl.float32)
        tl.store(x + kk, acc.to(tl.bfloat16))

    bad[(1,)](_empty(256), K=256, BLOCK=128)
    with pytest.raises(triton.CompilationError, match="Loop-carried"):
        compile_all(launches, 1)


def test_the_check_fails_a_kernel_over_the_shared_memory(launches: list[Launch]) -> None:
    import triton.language as tl

    @triton.jit
    def wide(a, b, c, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        m, n, k = tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, BK)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, 4096, BK):
            x = tl.load(a + m[:, None] * 4096 + (k0 + k)[None, :])
            y = tl.load(b + (k0 + k)[:, None] * 4096 + n[None, :])
            acc = tl.dot(x, y, acc)
        tl.store(c + m[:, None] * 4096 + n[None, :], acc.to(tl.bfloat16))

    x = _empty(256, 4096)
    wide[(1,)](x, x, x, BM=256, BN=256, BK=128, num_stages=4)
    with pytest.raises(AssertionError, match="wide"):
        compile_all(launches, 1)


def test_decode_attention_register_cap(launches: list[Launch], tmp_path: Path) -> None:
    """``DecodePlan.registers`` reaches the compiler: the batch-invariant
    kernel at 8-page tiles on 8 warps takes more than 128 registers a
    thread by itself, and 128 with the cap (so two programs fit an SM)."""
    from engine.attention import paged_decode as pd
    from engine.kvcache.pool import KVPool, KVPoolConfig

    c = ModelConfig.from_dict(PRESETS["llama-3.1-8b"], dtype=torch.bfloat16)
    d = c.head_dim
    pool = KVPool(KVPoolConfig(4, 16, c.num_layers, c.num_kv_heads, d, dtype=torch.bfloat16))
    q = _empty(256, c.num_heads + 2 * c.num_kv_heads, d)[:, : c.num_heads]
    ints = torch.zeros(257, dtype=torch.int32)
    for cap in (0, 128):
        plan = pd.DecodePlan(1, 8, 8, chunk_pages=16, registers=cap)
        pd.paged_decode(q, pool.k_layer(0), pool.v_layer(0), ints, ints, ints[:256],
                        _empty(256, c.num_heads, d), d**-0.5, plan)  # fmt: skip
    # Caught on CPU tensors: the launch code passes maxnreg for CUDA only.
    assert all("maxnreg" not in launch[2] for launch in launches)
    used = []
    for cap, launch in zip((0, 128), launches, strict=True):
        used.append(sm90.sass(sm90.compile_launch(launch, cap).asm["cubin"], tmp_path))
    assert used[0].registers > 128 >= used[1].registers, used
    with pytest.raises(ValueError, match="registers"):
        pd.paged_decode(q, pool.k_layer(0), pool.v_layer(0), ints, ints, ints[:256],
                        _empty(256, c.num_heads, d), d**-0.5, pd.DecodePlan(1, registers=8))  # fmt: skip


@pytest.mark.parametrize("preset", ["llama-3.1-8b", "qwen3-30b-a3b"])
def test_e4m3_decode_tiles_fit_four_programs_an_sm(
    preset: str, monkeypatch: pytest.MonkeyPatch, launches: list[Launch], tmp_path: Path
) -> None:
    """What the e4m3 plan's 4-page tiles on 4 warps are for (``paged_decode.plan``):
    where the batch alone fills the GPU, four programs share an SM, by
    registers and by shared memory, with nothing spilled. Llama-3.1-8B's
    groups of 4 fit uncapped, where the 8-page tiles on 8 warps before them
    fit two; Qwen3-MoE's groups of 8 fit under the plan's register cap
    (uncapped, three from Triton 3.6, four from 3.9: the cap costs no
    program an SM on either)."""
    from engine.attention import paged_decode as pd
    from engine.kvcache.pool import KVPool, KVPoolConfig

    monkeypatch.setattr(pd, "widens", lambda device: True)  # as on an H200
    c = ModelConfig.from_dict(PRESETS[preset], dtype=torch.bfloat16)
    d, group = c.head_dim, c.num_heads // c.num_kv_heads
    pool = KVPool(KVPoolConfig(4, 16, c.num_layers, c.num_kv_heads, d, dtype=fp8.E4M3))
    q = _empty(256, c.num_heads + 2 * c.num_kv_heads, d)[:, : c.num_heads]
    ints = torch.zeros(257, dtype=torch.int32)
    plan = pd.plan(256, c.num_kv_heads, e4m3=True, group=group)
    assert (plan.splits, plan.block_pages, plan.warps, plan.widen_v) == (1, 4, 4, True)
    if group > 4:
        assert plan.registers == pd.WIDE_GROUP_REGISTERS
        other, others = plan._replace(registers=0), (3, 4)
    else:
        assert plan.registers == 0
        other, others = plan._replace(block_pages=8, warps=8), (2,)
    for p in (plan, other):
        pd.paged_decode(q, pool.k_layer(0), pool.v_layer(0), ints, ints, ints[:256],
                        _empty(256, c.num_heads, d), d**-0.5, p)  # fmt: skip
    held, stacks = [], []
    for p, launch in zip((plan, other), launches, strict=True):
        out = sm90.compile_launch(launch, p.registers)
        used = sm90.sass(out.asm["cubin"], tmp_path)
        held.append(used.blocks_per_sm(p.warps, out.metadata.shared))
        stacks.append(used.stack)
    assert held[0] == 4 and held[1] in others, held
    assert stacks[0] == 0, stacks


def test_kernel_sass_reads_the_decode_kernels_loop(tmp_path: Path) -> None:
    """``benchmarks.kernels.kernel_sass`` (run as a tool): the main loop of
    the batch-256 decode attention over e4m3 pages, from the binary. Widening
    V first removes the byte loads from shared memory and shortens the loop a
    token; both plans hold the GPU's tensor-core instructions in that loop."""
    out = tmp_path / "sass.json"
    cmd = [sys.executable, "-m", "benchmarks.kernels.kernel_sass", "--batch-sizes", "256",
           "--variants", "triton-plan-bytes", "triton-plan-wv", "--output-file", str(out)]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    plain, widened = rows["triton-plan-bytes"], rows["triton-plan-wv"]
    assert plain["plan"]["widen_v"] is False and widened["plan"]["widen_v"] is True
    for r in (plain, widened):
        assert r["loop"].get("HMMA.16816.F32", 0) > 0 and r["registers"] <= 255
    assert plain["loop"].get("LDS.U8", 0) > 0
    assert widened["loop"].get("LDS.U8", 0) == 0
    assert widened["instructions_per_token"] < plain["instructions_per_token"]


def test_kernel_sass_counts_the_fp8_products_programs(tmp_path: Path) -> None:
    """``kernel_sass --kernel fp8-products``: each dense product of the
    preset at one row, at the engine's tiles, compiled; its program count is
    the grid the launch code makes (weight rows over the tile, times the K
    split), and no more than 132 SMs are counted busy."""
    out = tmp_path / "fp8.json"
    cmd = [sys.executable, "-m", "benchmarks.kernels.kernel_sass", "--kernel", "fp8-products",
           "--batch-sizes", "1", "--output-file", str(out)]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["product"]: r for r in json.loads(out.read_text())["results"]}
    # At one row also the MLP's two kernels: gated gate/up, down on deferred rows.
    assert set(rows) == set(LLAMA) - {"lm_head"} | {"gated", "down-def"}
    shapes = {**LLAMA, "gated": LLAMA["gate_up"], "down-def": LLAMA["down"]}
    for name, r in rows.items():
        n, k = shapes[name]
        t = fp8_skinny.gated_tiles(n // 2, k) if name == "gated" else fp8_skinny.tiles(n, k)
        assert t is not None and r["tiles"] == t._asdict(), name
        assert r["programs"] == (n // 2 if name == "gated" else n) // t.block_n * t.split_k
        assert r["sms_busy"] == min(132, r["programs"]) and r["registers"] > 0
        assert (
            r["blocks_per_sm"] >= 1 and r["shared_bytes"] * r["blocks_per_sm"] <= SM90_SHARED_BYTES
        )


def test_kernel_sass_reads_what_the_fp8_activation_kernels_issue(tmp_path: Path) -> None:
    """``kernel_sass --kernel fp8-activations``: the norm and the SiLU-and-mul
    that quantize the products' inputs, at Llama-3.1-8B's widths and two row
    counts, compiled with the warps their launches ask for (one program a
    row); the instructions of a kernel without loops do not depend on the
    rows, and the issue estimate is instructions x warps over four
    schedulers."""
    out = tmp_path / "act.json"
    cmd = [sys.executable, "-m", "benchmarks.kernels.kernel_sass", "--kernel", "fp8-activations",
           "--batch-sizes", "1", "8", "--output-file", str(out)]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert [(r["rows"], r["kernel"]) for r in rows] == [
        (m, k) for m in (1, 8) for k in ("norm_quantize_kernel", "silu_mul_quantize_kernel")
    ]
    widths = {"norm_quantize_kernel": 4096, "silu_mul_quantize_kernel": 14336}
    for r in rows:
        assert r["width"] == widths[r["kernel"]] and r["programs"] == r["rows"]
        assert r["warps"] == fp8_quant._row_launch(r["width"])["num_warps"]
        assert 0 < r["registers"] <= 255 and r["stack_bytes"] == 0
        assert r["issue_cycles"] == r["instructions"] * r["warps"] / 4
    for kernel in widths:
        counts = {r["instructions"] for r in rows if r["kernel"] == kernel}
        assert len(counts) == 1 and counts.pop() > 100


@pytest.mark.parametrize(
    ("preset", "e4m3"),
    [("llama-3.1-8b", False), ("llama-3.2-1b", False), ("qwen3-30b-a3b", False),
     ("llama-3.1-8b", True), ("head-256", False)],
)  # fmt: skip
def test_fresh_prefill_compiles_to_tensor_cores(
    preset: str, e4m3: bool, launches: list[Launch], tmp_path: Path
) -> None:
    """The plan-free causal prefill (``engine.attention.fresh_prefill``) at each
    preset's heads (head_dim 128 and 64; and 256, the largest FlashInfer's
    kernels take, at 16 query and 8 KV heads), bf16 q, k and v as views into the
    QKV output, 1024 rows (and K and V rounded as e4m3 pages hold them):
    it fits the SM's shared memory, spills nothing and
    runs its products on the tensor cores in its key loop, with K and V
    copied 16 bytes at a time (the row strides specialized)."""
    from engine.attention import fresh_prefill as fp

    if preset == "head-256":
        h, kv, d = 16, 8, 256
    else:
        c = ModelConfig.from_dict(PRESETS[preset], dtype=torch.bfloat16)
        h, kv, d = c.num_heads, c.num_kv_heads, c.head_dim
    n = 1024
    qkv = _empty(n, h + 2 * kv, d)
    q, k, v = qkv[:, :h], qkv[:, h : h + kv], qkv[:, h + kv :]
    positions = torch.zeros(n, dtype=torch.int64)
    fp.fresh_prefill(q, k, v, positions, _empty(n, h, d), d**-0.5, kv_e4m3=e4m3)
    (launch,) = launches
    out = sm90.compile_launch(launch)
    used = sm90.sass(out.asm["cubin"], tmp_path)
    assert out.metadata.shared <= SM90_SHARED_BYTES, out.metadata.shared
    assert used.stack == 0, used
    tensor_ops = sum(c for op, c in used.loop.items() if op.startswith(("HGMMA", "HMMA")))
    assert tensor_ops > 0, used.loop
    wide_copies = [op for op in used.loop if op.startswith("LDGSTS") and op.endswith(".128")]
    assert wide_copies and not any(op.startswith("LDG.E.U16") for op in used.loop), used.loop
