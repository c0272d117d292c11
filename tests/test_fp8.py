"""FP8 weights (``engine.layers.fp8``) on the CPU: the quantization, the
product against float64, online quantization at load against the full-precision
model, and the checkpoint formats (per-channel and per-tensor scales) against
the tensors they store."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from fp8_checkpoint import CHANNEL_CONFIG, cpu_runner, quantized_checkpoint

from engine.config import EngineConfig
from engine.forward_batch import ExtendSpec, build_forward_batch
from engine.kvcache.pool import KV_FP8, KVPool, KVPoolConfig
from engine.layers import fp8
from engine.model_config import ModelConfig, ModelConfigError
from engine.parallel.follower import RankContext
from engine.parallel.ranks import LeadRunner, make_runner
from engine.runner import ModelRunner


def test_rows_use_the_whole_range_and_round_to_e4m3() -> None:
    g = torch.Generator().manual_seed(0)
    # Rows of very different magnitudes: each gets its own scale.
    w = torch.randn(16, 96, generator=g) * torch.logspace(-4, 2, 16)[:, None]
    q, scale = fp8.quantize_rows(w)
    assert q.dtype == fp8.E4M3 and scale.shape == (16,)
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((16,), fp8.E4M3_MAX))
    err = (fp8.dequantize_rows(q, scale) - w).abs()
    # e4m3: 3 mantissa bits (half a step: 2^-4 of the value), subnormal steps of 2^-9.
    bound = w.abs() * 2**-4 + scale[:, None] * 2**-10
    assert (err <= bound * (1 + 1e-6)).all()
    zeros, zscale = fp8.quantize_rows(torch.zeros(2, 8))
    assert torch.equal(zeros.float(), torch.zeros(2, 8)) and (zscale > 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("path", ["scaled_mm", "reference"])
def test_product_matches_float64_of_the_quantized_operands(
    path: str, bias: bool, dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(7, 256, generator=g) * torch.logspace(-2, 1, 7)[:, None]).to(dtype)
    w = torch.randn(48 if path == "scaled_mm" else 40, 256, generator=g) * 0.05
    b = torch.randn(w.shape[0], generator=g).to(dtype) if bias else None
    q, scale = fp8.quantize_rows(w)
    assert fp8.scaled_mm_fits(q, q, dtype) == (path == "scaled_mm")  # 40 rows: not a x16
    got = fp8.linear(x, q, scale, b)
    xq, sx = fp8.quantize_rows(x)
    ref = fp8.dequantize_rows(xq, sx).double() @ fp8.dequantize_rows(q, scale).double().t()
    if b is not None:
        ref = ref + b.double()
    assert got.dtype == x.dtype and got.shape == ref.shape
    # float32: the sums' rounding; bf16: the result's (and the bias add's) rounding.
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("path", ["scaled_mm", "reference"])
def test_a_product_takes_rows_quantized_where_they_were_made(path: str) -> None:
    """Rows quantized upstream (a norm or SiLU-and-mul kernel's ``Quantized``)
    give the product of the same rows quantized here, bit for bit, through
    ``fp8.linear`` and the projections' ``any_linear``; a full-precision
    weight refuses them."""
    from engine.layers.fp8_quant import Quantized
    from engine.layers.linear import any_linear

    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 256, generator=g).to(torch.bfloat16)
    q, scale = fp8.quantize_rows(torch.randn(48 if path == "scaled_mm" else 40, 256, generator=g))
    b = torch.randn(q.shape[0], generator=g).to(torch.bfloat16)
    rows = Quantized(*fp8.quantize_rows(x), torch.bfloat16)
    want = fp8.linear(x, q, scale, b)
    assert torch.equal(fp8.linear(rows, q, scale, b), want)
    assert torch.equal(any_linear(rows, q, b, scale), want)
    assert rows.shape == x.shape
    with pytest.raises(AssertionError, match="full-precision weight"):
        any_linear(rows, q.float(), b, None)


def _logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    pages = runner.pool.allocator.alloc(-(-len(ids) // 4))
    assert pages is not None
    try:
        batch = build_forward_batch([ExtendSpec(ids, 0, pages, "all")], 4, "cpu")
        return runner.forward_logits(batch)
    finally:
        runner.pool.allocator.free(pages)


def _prompt(n: int = 29) -> list[int]:
    g = random.Random(3)
    return [g.randrange(3, 300) for _ in range(n)]


def test_online_quantization_stays_near_the_full_precision_model(hf_checkpoint) -> None:
    path, _ = hf_checkpoint("qwen2-gqa2")  # QKV biases too
    full, quant = cpu_runner(path), cpu_runner(path, "fp8")
    assert quant.model_config.fp8 and not full.model_config.fp8
    layer = quant.model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == fp8.E4M3
    assert layer.mlp.down_proj.weight_scale.shape == (quant.model_config.hidden_size,)
    assert quant.model.lm_head_weight.dtype == full.model.lm_head_weight.dtype
    ids = _prompt()
    ref, got = _logits(full, ids), _logits(quant, ids)
    rel = ((got - ref).norm() / ref.norm()).item()
    # e4m3 keeps 3 mantissa bits: each product's operands are off by up to
    # 2^-4 (rms ~3.6%), and this random 2-layer model has 8 products in a row.
    assert 1e-3 < rel < 0.25, rel
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.8, agree


def test_the_fp8_model_is_the_full_model_on_quantized_operands(hf_checkpoint) -> None:
    """The full-precision model given the dequantized FP8 weights and, before
    each of those projections, per-token quantized inputs: the FP8 model."""
    path, _ = hf_checkpoint("qwen2-gqa2")
    full, quant = cpu_runner(path), cpu_runner(path, "fp8")

    def quantized_input(module: torch.nn.Module, args: tuple) -> tuple:
        xq, sx = fp8.quantize_rows(args[0])
        return (fp8.dequantize_rows(xq, sx).to(args[0].dtype),)

    pairs = zip(full.model.named_modules(), quant.model.named_modules(), strict=True)
    projections = 0
    for (_, mod), (_, qmod) in pairs:
        if getattr(qmod, "weight_scale", None) is None:
            continue
        projections += 1
        with torch.no_grad():
            mod.weight.copy_(fp8.dequantize_rows(qmod.weight, qmod.weight_scale))
        mod.register_forward_pre_hook(quantized_input)
        if hasattr(mod, "silu_mul_forward"):  # the fused path would skip the hook
            mod.silu_mul_forward = lambda gate_up, act, m=mod: m(act(gate_up))
    assert projections == 4 * quant.model_config.num_layers
    ids = _prompt()
    ref, got = _logits(full, ids), _logits(quant, ids)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_a_quantized_lm_head_is_the_head_on_quantized_operands(hf_checkpoint) -> None:
    """``--quantize-lm-head``: the head in e4m3 with a scale per vocab row, the
    final norm's output quantized per token: float64 of those operands, and
    logits near those of the full-precision head."""
    path, _ = hf_checkpoint("qwen2-gqa2")
    plain, quant = cpu_runner(path, "fp8"), cpu_runner(path, "fp8", quantize_lm_head=True)
    head = quant.model.lm_head
    assert quant.model_config.fp8_lm_head and not plain.model_config.fp8_lm_head
    assert head.weight.dtype == fp8.E4M3 and head.weight_scale.shape == (head.weight.shape[0],)
    assert plain.model.lm_head.weight.dtype != fp8.E4M3
    torch.testing.assert_close(  # quantized at load from the same checkpoint tensor
        fp8.dequantize_rows(head.weight, head.weight_scale),
        plain.model.lm_head.weight.float(),
        rtol=2**-4,
        atol=head.weight_scale.max().item() * 2**-9,
    )
    g = torch.Generator().manual_seed(5)
    h = torch.randn(6, quant.model_config.hidden_size, generator=g).to(quant.model_config.dtype)
    with torch.no_grad():
        got = quant.model.compute_logits(h).double()
    xq, sx = fp8.quantize_rows(h)
    ref = fp8.dequantize_rows(xq, sx).double() @ (
        fp8.dequantize_rows(head.weight, head.weight_scale).double().t()
    )
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    ids = _prompt()
    ref, got = _logits(plain, ids), _logits(quant, ids)
    rel = ((got - ref).norm() / ref.norm()).item()
    assert 1e-3 < rel < 0.1, rel  # one more product on e4m3 operands
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.8, agree


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_a_tied_head_quantized_is_a_copy_of_the_embedding(hf_checkpoint, load_format) -> None:
    """A head tied to the embeddings, quantized: the embedding matrix stays in
    the model's dtype for the lookup, the head is its rows quantized."""
    path, _ = hf_checkpoint("llama-gqa4-tied")
    plain = cpu_runner(path, "fp8", load_format=load_format)
    quant = cpu_runner(path, "fp8", load_format=load_format, quantize_lm_head=True)
    assert plain.model.lm_head is None
    embed, head = quant.model.model.embed_tokens.weight, quant.model.lm_head
    assert embed.dtype != fp8.E4M3 and torch.equal(embed, plain.model.model.embed_tokens.weight)
    q, scale = fp8.quantize_rows(embed)
    assert torch.equal(head.weight.float(), q.float()) and torch.equal(head.weight_scale, scale)
    ids = _prompt()
    ref, got = _logits(plain, ids), _logits(quant, ids)
    rel = ((got - ref).norm() / ref.norm()).item()
    assert 1e-3 < rel < 0.1, rel


def test_a_quantized_lm_head_is_refused_where_it_cannot_be(hf_checkpoint) -> None:
    path, _ = hf_checkpoint("qwen2-gqa2")
    with pytest.raises(ModelConfigError, match="needs FP8 weights"):
        cpu_runner(path, quantize_lm_head=True)
    from engine.parallel import layers as tp_layers

    head = ModelConfig.load(path).with_quantization("fp8", lm_head=True)
    with pytest.raises(ModelConfigError, match="tensor parallelism"):
        tp_layers.lm_head(head, tp=object())  # refused before a rank's part is made


def test_a_per_channel_checkpoint_loads_as_online_quantization(model_dir, tmp_path) -> None:
    ckpt = tmp_path / "fp8-channel"
    quantized_checkpoint(Path(model_dir), ckpt, per_tensor=False)
    assert ModelConfig.load(ckpt).quantization == "fp8"
    stored = cpu_runner(ckpt)  # no flag: the checkpoint says FP8
    online = cpu_runner(model_dir, "fp8")
    assert stored.model_config.fp8
    for (name, a), (_, b) in zip(
        stored.model.named_parameters(), online.model.named_parameters(), strict=True
    ):
        assert a.dtype == b.dtype and torch.equal(a.float(), b.float()), name
    ids = _prompt()
    assert torch.equal(_logits(stored, ids), _logits(online, ids))


def test_a_per_tensor_checkpoint_gives_every_row_the_tensor_scale(model_dir, tmp_path) -> None:
    ckpt = tmp_path / "fp8-tensor"
    stored = quantized_checkpoint(Path(model_dir), ckpt, per_tensor=True)
    runner = cpu_runner(ckpt)
    layer = runner.model.model.layers[1]
    pre = "model.layers.1."
    # The fused QKV matrix: each shard's rows dequantize to its own tensor.
    qkv = layer.self_attn.qkv_proj
    parts = [f"{pre}self_attn.{p}_proj" for p in "qkv"]
    want = torch.cat([stored[f"{p}.weight"].float() * stored[f"{p}.weight_scale"] for p in parts])
    torch.testing.assert_close(fp8.dequantize_rows(qkv.weight, qkv.weight_scale), want)
    down = layer.mlp.down_proj
    torch.testing.assert_close(
        fp8.dequantize_rows(down.weight, down.weight_scale),
        stored[f"{pre}mlp.down_proj.weight"].float() * stored[f"{pre}mlp.down_proj.weight_scale"],
    )
    logits = _logits(runner, _prompt())
    assert torch.isfinite(logits).all()


def test_unsupported_quantizations_are_refused_by_name() -> None:
    base = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "vocab_size": 100,
    }
    block = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with pytest.raises(ModelConfigError, match="block-wise"):
        ModelConfig.from_dict({**base, "quantization_config": block})
    with pytest.raises(ModelConfigError, match="awq"):
        ModelConfig.from_dict({**base, "quantization_config": {"quant_method": "awq"}})
    int8 = json.loads(json.dumps(CHANNEL_CONFIG))
    int8["config_groups"]["group_0"]["weights"]["type"] = "int"
    with pytest.raises(ModelConfigError, match="compressed-tensors"):
        ModelConfig.from_dict({**base, "quantization_config": int8})
    plain = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    assert ModelConfig.from_dict({**base, "quantization_config": plain}).fp8
    moe = {
        **base,
        "architectures": ["Qwen3MoeForCausalLM"],
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
    }
    with pytest.raises(ModelConfigError, match="mixture-of-experts"):
        ModelConfig.from_dict(moe).with_quantization("fp8")
    with pytest.raises(ValueError, match="int4"):
        EngineConfig(quantization="int4")


def test_dummy_fp8_weights_have_the_dummy_spread(model_dir) -> None:
    runner = cpu_runner(model_dir, "fp8", load_format="dummy")
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    w = fp8.dequantize_rows(qkv.weight, qkv.weight_scale)
    assert 0.018 < w.std().item() < 0.022
    assert torch.isfinite(_logits(runner, _prompt())).all()


def _fp8_weights(runner: ModelRunner) -> dict[str, torch.Tensor]:
    """A runner's FP8 weights, dequantized, by module name."""
    out = {}
    for name, mod in runner.model.named_modules():
        if getattr(mod, "weight_scale", None) is not None:
            out[name] = fp8.dequantize_rows(mod.weight, mod.weight_scale)
    return out


def _rank_fp8_weights(ctx: RankContext) -> dict[str, torch.Tensor]:
    """``_fp8_weights`` of a rank (run on the rank by ``LeadRunner.call``)."""
    return _fp8_weights(ctx.runner)


def test_tp2_ranks_hold_their_part_of_an_fp8_checkpoint(model_dir, tmp_path) -> None:
    ckpt = tmp_path / "fp8-tp"
    quantized_checkpoint(Path(model_dir), ckpt, per_tensor=False)
    mc = ModelConfig.load(ckpt)
    cfg = EngineConfig(model=str(ckpt), device="cpu", page_size=4, num_pages=64, tp_size=2)
    one = cpu_runner(ckpt)
    group = make_runner(cfg.resolve(mc), mc)
    assert isinstance(group, LeadRunner)
    try:
        full = _fp8_weights(one)
        ranks = [_fp8_weights(group), group.call(1, _rank_fp8_weights)]
        q_size, kv_size = mc.q_size // 2, mc.kv_size // 2
        for rank, params in enumerate(ranks):
            # Column-parallel rows and row-parallel columns of the one-device
            # weights, each row with its checkpoint scale.
            whole = full["model.layers.0.self_attn.qkv_proj"]
            q = whole[rank * q_size : (rank + 1) * q_size]
            k0 = mc.q_size + rank * kv_size
            k = whole[k0 : k0 + kv_size]
            v = whole[k0 + mc.kv_size : k0 + mc.kv_size + kv_size]
            assert torch.equal(params["model.layers.0.self_attn.qkv_proj"], torch.cat([q, k, v]))
            o = full["model.layers.0.self_attn.o_proj"]
            cols = o.shape[1] // 2
            assert torch.equal(
                params["model.layers.0.self_attn.o_proj"], o[:, rank * cols : (rank + 1) * cols]
            )
        ids = _prompt()
        ref = _logits(one, ids)
        got = _logits(group, ids)
        # Each rank scales its own part of a row-parallel input per token.
        assert ((got - ref).norm() / ref.norm()).item() < 0.1
    finally:
        group.close()


# -- FP8 KV pages ------------------------------------------------------------


def test_fp8_pages_saturate_instead_of_overflowing() -> None:
    pool = KVPool(KVPoolConfig(num_pages=4, page_size=2, num_layers=1, num_kv_heads=2, head_dim=8, dtype=KV_FP8))  # fmt: skip
    g = torch.Generator().manual_seed(0)
    k = torch.randn(3, 2, 8, generator=g) * 100
    k[0, 0, 0], k[1, 1, 1] = 1e4, -1e4  # beyond e4m3's 448
    v = torch.randn(3, 2, 8, generator=g)
    pages, slots = torch.tensor([1, 1, 2]), torch.tensor([0, 1, 0])
    pool.write(0, pages, slots, k, v)
    got_k = pool.k_layer(0)[pages, slots].float()
    assert torch.isfinite(got_k).all()
    assert got_k[0, 0, 0] == 448 and got_k[1, 1, 1] == -448
    inside = k.abs() <= 448
    err = (got_k - k).abs()[inside]
    assert (err <= k.abs()[inside] * 2**-4 + 2**-10).all()


def _same_pages(a: ModelRunner, b: ModelRunner, n: int) -> list[int]:
    """``n`` pages, the same ones in both runners' (fresh) pools."""
    pages = a.pool.allocator.alloc(n)
    assert pages is not None and b.pool.allocator.alloc(n) == pages
    return pages


def test_attention_reads_fp8_pages_as_their_values(model_dir) -> None:
    """The FP8-KV engine against one whose float32 pool holds the same
    (rounded) values: prefill, then decode steps over the cached pages."""
    a, b = cpu_runner(model_dir, kv_cache_dtype="fp8_e4m3"), cpu_runner(model_dir)
    assert a.config.attention_backend == "torch_native"
    assert a.pool.kv.dtype == KV_FP8 and a.pool.config.page_bytes * 4 == b.pool.config.page_bytes
    ids = _prompt(13)
    pages = _same_pages(a, b, 5)
    first = build_forward_batch([ExtendSpec(ids, 0, pages, "all")], 4, "cpu")
    a.forward_logits(first)
    b.forward_logits(first)
    b.pool.kv.copy_(a.pool.kv.float())  # the same KV values in both pools
    # ... and the float32 pool stores new rows rounded as the FP8 pool does.
    b.pool.stored = lambda x: a.pool.stored(x).float()
    for step in range(3):
        batch = build_forward_batch([ExtendSpec([7 + step], 13 + step, pages)], 4, "cpu")
        got, want = a.forward_logits(batch), b.forward_logits(batch)
        assert torch.equal(a.pool.kv.float(), b.pool.kv)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fp8_kv_stays_near_full_precision_kv(model_dir) -> None:
    ids = _prompt()
    fp8_kv = cpu_runner(model_dir, kv_cache_dtype="fp8_e4m3")
    ref, got = _logits(cpu_runner(model_dir), ids), _logits(fp8_kv, ids)
    rel = ((got - ref).norm() / ref.norm()).item()
    assert 1e-4 < rel < 0.1, rel


def test_kv_scale_names() -> None:
    from engine.models.llama import kv_scale_target

    assert kv_scale_target("model.layers.3.self_attn.k_scale") == (3, 0)
    assert kv_scale_target("model.layers.12.self_attn.v_proj.output_scale") == (12, 1)
    assert kv_scale_target("model.layers.3.self_attn.o_proj.output_scale") is None
    assert kv_scale_target("model.layers.3.mlp.down_proj.weight") is None


def _kv_scaled_pair(model_dir: str, tmp_path: Path) -> tuple[ModelRunner, ModelRunner]:
    """A checkpoint with K/V scales 0.1 / 0.2 in every layer, in an e4m3 pool
    and in a float32 one (where the scales are not used)."""
    ckpt = tmp_path / "fp8-kv-scales"
    quantized_checkpoint(Path(model_dir), ckpt, per_tensor=True)
    return cpu_runner(ckpt, kv_cache_dtype="fp8_e4m3"), cpu_runner(ckpt)


def test_a_checkpoints_kv_scales_divide_what_the_fp8_pages_hold(model_dir, tmp_path) -> None:
    scaled, plain = _kv_scaled_pair(model_dir, tmp_path)
    scales = (torch.tensor(0.1).item(), torch.tensor(0.2).item())  # as stored: float32
    assert [lay.self_attn.kv_scales for lay in scaled.model.model.layers] == [scales] * 2
    assert all(lay.self_attn.kv_scales is None for lay in plain.model.model.layers)
    ids = _prompt(13)
    pages = _same_pages(scaled, plain, 4)
    batch = build_forward_batch([ExtendSpec(ids, 0, pages, "all")], 4, "cpu")
    scaled.forward_logits(batch)
    plain.forward_logits(batch)
    # Layer 0's K and V come from the same embeddings in both: the e4m3 pages
    # hold them divided by the scales, rounded (later layers' inputs differ).
    ks, vs = scaled.model.model.layers[0].self_attn.kv_scales
    assert torch.equal(
        scaled.pool.k_layer(0)[pages], scaled.pool.stored(plain.pool.k_layer(0)[pages] / ks)
    )
    assert torch.equal(
        scaled.pool.v_layer(0)[pages], scaled.pool.stored(plain.pool.v_layer(0)[pages] / vs)
    )


def test_scaled_fp8_pages_attend_as_their_values_times_the_scales(model_dir, tmp_path) -> None:
    """Against a float32 pool holding each page times its layer's scales (and
    storing new rows rounded as the scaled e4m3 pool does): the same logits."""
    scaled, plain = _kv_scaled_pair(model_dir, tmp_path)
    ks, vs = scaled.model.model.layers[0].self_attn.kv_scales
    ids = _prompt(13)
    pages = _same_pages(scaled, plain, 5)
    scaled.forward_logits(build_forward_batch([ExtendSpec(ids, 0, pages, "all")], 4, "cpu"))
    plain.pool.kv[:, :, 0] = scaled.pool.kv[:, :, 0].float() * ks
    plain.pool.kv[:, :, 1] = scaled.pool.kv[:, :, 1].float() * vs
    write = plain.pool.write

    def write_as_scaled(layer, page_idx, slot_idx, k, v) -> None:
        e4m3 = scaled.pool.stored
        write(layer, page_idx, slot_idx, e4m3(k / ks).float() * ks, e4m3(v / vs).float() * vs)

    plain.pool.write = write_as_scaled
    for step in range(3):
        batch = build_forward_batch([ExtendSpec([7 + step], 13 + step, pages)], 4, "cpu")
        got, want = scaled.forward_logits(batch), plain.forward_logits(batch)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
