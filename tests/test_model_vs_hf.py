"""Our forward against HF transformers' own model on the same weights (fp32, CPU)."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import TINY_VARIANTS
from engine.config import EngineConfig
from engine.forward_batch import ExtendSpec, build_forward_batch
from engine.model_config import ModelConfig
from engine.runner import ModelRunner

TOL = 1e-4


def make_runner(model_dir, page_size: int, num_pages: int = 256) -> ModelRunner:
    mc = ModelConfig.load(model_dir)
    cfg = EngineConfig(
        model=str(model_dir), device="cpu", page_size=page_size, num_pages=num_pages
    ).resolve(mc)
    return ModelRunner(cfg, mc)


def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def random_pages(runner: ModelRunner, n_tokens: int, rng: random.Random) -> list[int]:
    """Allocate, then shuffle, so page tables are not in pool order."""
    n = -(-n_tokens // runner.pool.page_size)
    pages = runner.pool.allocator.alloc(n)
    assert pages is not None
    rng.shuffle(pages)
    return pages


def prompt(n: int, seed: int, vocab: int = 320) -> list[int]:
    g = random.Random(seed)
    return [g.randrange(3, vocab) for _ in range(n)]


@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_full_prompt_logits(hf_checkpoint, variant: str) -> None:
    path, hf = hf_checkpoint(variant)
    runner = make_runner(path, page_size=1)
    ids = prompt(37, 1)
    pages = random_pages(runner, len(ids), random.Random(0))
    fb = build_forward_batch([ExtendSpec(ids, 0, pages, "all")], 1, "cpu")
    ours = runner.forward_logits(fb)
    ref = hf_logits(hf, ids)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < TOL


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_decode_token_by_token(hf_checkpoint, variant: str, page_size: int) -> None:
    path, hf = hf_checkpoint(variant)
    runner = make_runner(path, page_size=page_size)
    ids = prompt(23, 2)
    pages = random_pages(runner, len(ids), random.Random(1))
    ref = hf_logits(hf, ids)
    for pos, tok in enumerate(ids):
        fb = build_forward_batch([ExtendSpec([tok], pos, pages)], page_size, "cpu")
        ours = runner.forward_logits(fb)[0]
        assert (ours - ref[pos]).abs().max().item() < TOL, f"position {pos}"


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("variant", ["llama-mha-llama3rope", "qwen2-gqa2", "qwen3-gqa4"])
def test_chunked_prefill(hf_checkpoint, variant: str, page_size: int) -> None:
    path, hf = hf_checkpoint(variant)
    runner = make_runner(path, page_size=page_size)
    ids = prompt(40, 3)
    pages = random_pages(runner, len(ids), random.Random(2))
    ref = hf_logits(hf, ids)
    chunk = 7
    for start in range(0, len(ids), chunk):
        new = ids[start : start + chunk]
        fb = build_forward_batch([ExtendSpec(new, start, pages, "all")], page_size, "cpu")
        ours = runner.forward_logits(fb)
        diff = (ours - ref[start : start + len(new)]).abs().max().item()
        assert diff < TOL, f"chunk at {start}: {diff}"


@pytest.mark.parametrize("variant", ["llama-gqa4-tied", "qwen3-gqa2-tied"])
def test_mixed_batch(hf_checkpoint, variant: str) -> None:
    """Several requests in one forward: one prefilling a chunk, others decoding."""
    path, hf = hf_checkpoint(variant)
    page_size = 4
    runner = make_runner(path, page_size=page_size)
    rng = random.Random(3)
    prompts = [prompt(n, 10 + n) for n in (5, 18, 31)]
    refs = [hf_logits(hf, p) for p in prompts]
    tables = [random_pages(runner, len(p), rng) for p in prompts]
    # Prefill all but the last token of the two short prompts first.
    warm = [ExtendSpec(p[:-1], 0, t, "none") for p, t in zip(prompts[:2], tables[:2])]
    runner.forward_logits(build_forward_batch(warm, page_size, "cpu"))
    specs = [
        ExtendSpec(prompts[0][-1:], len(prompts[0]) - 1, tables[0]),
        ExtendSpec(prompts[2][:13], 0, tables[2], "all"),
        ExtendSpec(prompts[1][-1:], len(prompts[1]) - 1, tables[1]),
    ]
    ours = runner.forward_logits(build_forward_batch(specs, page_size, "cpu"))
    assert (ours[0] - refs[0][-1]).abs().max() < TOL
    assert (ours[1:14] - refs[2][:13]).abs().max() < TOL
    assert (ours[14] - refs[1][-1]).abs().max() < TOL


def test_sharded_checkpoint(hf_checkpoint) -> None:
    path, hf = hf_checkpoint("qwen2-gqa2", shard=True)
    assert (path / "model.safetensors.index.json").is_file()
    runner = make_runner(path, page_size=1)
    ids = prompt(9, 4)
    pages = random_pages(runner, len(ids), random.Random(5))
    ours = runner.forward_logits(build_forward_batch([ExtendSpec(ids, 0, pages, "all")], 1, "cpu"))
    assert (ours - hf_logits(hf, ids)).abs().max() < TOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close_to_hf(hf_checkpoint, dtype: torch.dtype) -> None:
    path, hf = hf_checkpoint("qwen3-gqa2-tied")
    mc = ModelConfig.load(path, dtype)
    cfg = EngineConfig(model=str(path), device="cpu", page_size=4, num_pages=64).resolve(mc)
    runner = ModelRunner(cfg, mc)
    assert runner.pool.kv.dtype == dtype
    assert next(runner.model.parameters()).dtype == dtype
    ids = prompt(21, 6)
    pages = random_pages(runner, len(ids), random.Random(7))
    ours = runner.forward_logits(build_forward_batch([ExtendSpec(ids, 0, pages, "all")], 4, "cpu"))
    ref = hf_logits(hf, ids)
    # Half precision: close to the fp32 reference, not equal.
    assert (ours - ref).abs().max() < 0.1 * ref.abs().max()
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
