"""Short prefills replayed as decode rows (``engine.cuda_graph.as_decode_rows``):
one row per new token, each attending to its request's pages up to its own
position, must give the logits of the causal prefill. Checked on CPU with the
reference attention; the CUDA-graph replay of the same is a GPU test."""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.cuda_graph import MAX_EXPANDED_KV_TOKENS, as_decode_rows
from engine.forward_batch import ExtendSpec, build_forward_batch
from engine.model_config import ModelConfig
from engine.runner import ModelRunner


def _runner(model_dir: str) -> ModelRunner:
    mc = ModelConfig.load(model_dir, torch.float32)
    cfg = EngineConfig(model=model_dir, device="cpu", page_size=4, num_pages=64).resolve(mc)
    return ModelRunner(cfg, mc)


def test_prefill_as_decode_rows_equals_causal_prefill(model_dir: str) -> None:
    runner = _runner(model_dir)
    alloc = runner.pool.allocator
    gen = torch.Generator().manual_seed(0)
    a, b, c = (torch.randint(3, 500, (n,), generator=gen).tolist() for n in (6, 9, 5))
    ta, tb, tc = (alloc.alloc(4) for _ in range(3))
    assert ta is not None and tb is not None and tc is not None
    ps = runner.pool.page_size
    # c's first 2 tokens are cached: its chunk continues after them.
    runner.forward_logits(build_forward_batch([ExtendSpec(c[:2], 0, tc, "none")], ps, "cpu"))
    specs = [
        ExtendSpec(a, 0, ta, "all"),
        ExtendSpec(b[:1], 0, tb, "last"),  # a one-token chunk between two longer ones
        ExtendSpec(c[2:], 2, tc, "all"),
    ]
    batch = build_forward_batch(specs, ps, "cpu")
    rows = as_decode_rows(batch, max_rows=16)
    assert rows is not None and rows.is_decode
    assert rows.seq_lens == [1, 2, 3, 4, 5, 6, 1, 3, 4, 5]
    t = batch.page_tables
    assert rows.page_tables == [t[0]] * 6 + [t[1]] + [t[2]] * 3
    want = runner.forward_logits(batch)
    got = runner.forward_logits(rows)
    assert want.shape == got.shape == (10, runner.model_config.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_decode_rows_limits() -> None:
    def batch(lens: list[tuple[int, int]]):  # (start, new tokens) per request
        specs = [ExtendSpec([5] * n, start, list(range(1, 400))) for start, n in lens]
        return build_forward_batch(specs, 16, "cpu")

    decode = batch([(10, 1), (20, 1)])
    assert as_decode_rows(decode, 2) is decode
    assert as_decode_rows(decode, 1) is None
    assert as_decode_rows(batch([(0, 9)]), 8) is None  # more tokens than rows
    # A chunk after a long prefix would read that prefix once per token.
    n = 64
    start = MAX_EXPANDED_KV_TOKENS // n
    assert as_decode_rows(batch([(0, n)]), 256) is not None
    assert as_decode_rows(batch([(start, n)]), 256) is None
