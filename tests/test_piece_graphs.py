"""The piecewise forward (``engine.piece_graphs``): the layers cut at attention,
padded to a bucket of token counts, must give the model's own forward on the
real rows. Checked on CPU with the pieces run eagerly (the same pieces, buffers
and padding the graphs capture); the CUDA-graph replay of them is a GPU test."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.forward_batch import ExtendSpec, build_forward_batch
from engine.model_config import ModelConfig
from engine.piece_graphs import PieceGraphs, bucket_sizes
from engine.runner import ModelRunner


def test_bucket_sizes() -> None:
    sizes = bucket_sizes(2048)
    assert sizes[0] == 64 and sizes[-1] == 2048
    assert sizes == sorted(set(sizes))
    for n in range(1, 2049):
        bucket = next(s for s in sizes if s >= n)
        # A step of 64 up to 512 tokens; past it, padding under an eighth.
        assert bucket - n < 64 or (n > 512 and (bucket - n) * 8 < n), n
    assert bucket_sizes(100) == [64, 100]
    assert bucket_sizes(1) == [1]


def _runner(model_dir: str, kv_cache_dtype: str = "auto") -> ModelRunner:
    mc = ModelConfig.load(model_dir, torch.float32)
    cfg = EngineConfig(
        model=model_dir, device="cpu", page_size=4, num_pages=96, kv_cache_dtype=kv_cache_dtype
    ).resolve(mc)
    assert cfg.cuda_graph_max_tokens == 0  # no graphs off CUDA
    return ModelRunner(cfg, mc)


@pytest.mark.parametrize("lens", [[(0, 37)], [(5, 1), (0, 30), (12, 40)], [(0, 64)]])
def test_pieces_equal_the_forward(model_dir: str, lens: list[tuple[int, int]]) -> None:
    """Requests given as (cached tokens, new tokens): a prompt, a mixed batch
    (one decoding row, a prompt, a chunk after a prefix), a whole bucket."""
    runner = _runner(model_dir)
    alloc = runner.pool.allocator
    free = alloc.num_free
    ps = runner.pool.page_size
    gen = torch.Generator().manual_seed(len(lens))
    specs = []
    for cached, new in lens:
        ids = torch.randint(3, 500, (cached + new,), generator=gen).tolist()
        table = alloc.alloc(-(-(cached + new) // ps))
        assert table is not None
        if cached:  # the prefix's KV in the pool first
            runner.forward_logits(
                build_forward_batch([ExtendSpec(ids[:cached], 0, table)], ps, "cpu")
            )
        specs.append(ExtendSpec(ids[cached:], cached, table, "all"))
    batch = build_forward_batch(specs, ps, "cpu")
    n = batch.input_ids.numel()
    pieces = PieceGraphs(runner.model, torch.device("cpu"), 96, capture=False)
    # Padding rows hold whatever the buffers held: NaN here must stay in them.
    pieces.attn_out.fill_(float("nan"))
    runner.attn.begin_forward(batch)
    want = runner.model(batch.input_ids, batch.positions, runner.attn)
    got = pieces.run(batch, runner.attn)  # plans attention itself
    assert got.shape == want.shape == (n, runner.model_config.hidden_size)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert n == 96 or pieces.attn_out[n:].isnan().all()  # the padding was never attended
    for spec in specs:
        alloc.free(spec.page_table)
    assert alloc.num_free == free


@pytest.mark.parametrize(
    ("variant", "lens"),
    [("tiny", [7]), ("tiny", [5, 30, 1]), ("tiny", [32, 32, 32]), ("qwen3-gqa4", [5, 30, 1]),
     ("qwen3moe-e8k2-norm", [5, 30, 1]), ("tiny-e4m3", [5, 30, 1])],
    ids=["one", "three", "full", "qwen3", "qwen3moe", "e4m3-pages"],
)  # fmt: skip
def test_fresh_prompts_whole_forward_equals_the_forward(
    model_dir: str, hf_checkpoint: Any, variant: str, lens: list[int]
) -> None:
    """Fresh prompts through the whole-forward path (eagerly: the buffers,
    padding and plan-free attention its graphs capture) against the model's
    own forward: the same hidden states on the real rows, the same K/V in
    the prompts' pages, and nothing written elsewhere but the scratch page
    (the padding's, whose slots are a larger forward's). A
    batch with a cached prefix is not taken. The built-in tiny Llama (also
    over e4m3 pages, attended as they hold K and V), and Qwen3 (q/k norms)
    and Qwen3-MoE (sparse layers in the graph)."""
    path = model_dir if variant.startswith("tiny") else str(hf_checkpoint(variant)[0])
    runner = _runner(path, kv_cache_dtype="fp8_e4m3" if variant.endswith("e4m3") else "auto")
    alloc, ps, kv = runner.pool.allocator, runner.pool.page_size, runner.pool.kv
    free = alloc.num_free
    gen = torch.Generator().manual_seed(sum(lens))
    specs = []
    for n in lens:
        table = alloc.alloc(-(-n // ps))
        assert table is not None
        ids = torch.randint(3, min(500, runner.model_config.vocab_size), (n,), generator=gen)
        specs.append(ExtendSpec(ids.tolist(), 0, table))
    batch = build_forward_batch(specs, ps, "cpu")
    pieces = PieceGraphs(runner.model, torch.device("cpu"), 96, capture=False, fresh=runner.attn)
    assert pieces.can_run_fresh(batch)
    assert not PieceGraphs(runner.model, torch.device("cpu"), 96, capture=False).can_run_fresh(
        batch
    )
    # A full bucket first, so the padding rows below hold its stale slots
    # (their positions are reset to 0).
    stale = alloc.alloc(96 // ps)
    assert stale is not None
    pieces.run_fresh(build_forward_batch([ExtendSpec([9] * 96, 0, stale)], ps, "cpu"))
    alloc.free(stale)
    runner.attn.begin_forward(batch)
    want = runner.model(batch.input_ids, batch.positions, runner.attn)
    want_kv = kv.clone()
    kv.zero_()
    got = pieces.run_fresh(batch)  # no begin_forward: nothing planned
    n = sum(lens)
    size = next(s for s in pieces.sizes if s >= n)
    assert not pieces.fresh_index.positions[n:size].any()  # the padding attends itself
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    used = torch.tensor([p for spec in specs for p in spec.page_table])
    # e4m3 pages: a product's last bit may move a value to the next e4m3 one.
    tol = (1e-6, 1e-6) if kv.dtype == torch.float32 else (0.13, 2**-9)
    torch.testing.assert_close(kv[used].float(), want_kv[used].float(), rtol=tol[0], atol=tol[1])
    others = torch.ones(kv.shape[0], dtype=torch.bool)
    others[used] = False
    others[0] = False
    assert not kv[others].any()
    assert sum(lens) == 96 or kv[0].any()  # the padding went to the scratch page
    prefix = ExtendSpec([5, 6], 3, specs[0].page_table)
    assert not pieces.can_run_fresh(build_forward_batch([prefix], ps, "cpu"))
    for spec in specs:
        alloc.free(spec.page_table)
    assert alloc.num_free == free


def test_piece_graph_settings() -> None:
    mc = ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "vocab_size": 100,
            "max_position_embeddings": 256,
        }  # fmt: skip
    )

    def resolved(**kw: object) -> EngineConfig:
        return EngineConfig(model="m", load_format="dummy", device="cpu", **kw).resolve(mc)

    assert resolved().cuda_graph_max_tokens == 0
    with pytest.raises(ValueError, match="flashinfer"):
        resolved(cuda_graph_max_tokens=512)
    with pytest.raises(ValueError, match=">= 0"):
        EngineConfig(cuda_graph_max_tokens=-1)
    assert resolved(cuda_graph_max_tokens=0).cuda_graph_max_tokens == 0
    # Whole-forward graphs of fresh prompts: off by default, and they need the
    # piecewise graphs.
    assert resolved().fresh_prefill_graphs is False
    fi = {"attention_backend": "flashinfer"}
    assert resolved(**fi).fresh_prefill_graphs is False
    assert resolved(**fi, fresh_prefill_graphs=True).fresh_prefill_graphs is True
    with pytest.raises(ValueError, match="fresh_prefill_graphs"):
        resolved(fresh_prefill_graphs=True)
