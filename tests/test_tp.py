"""Tensor parallelism in one engine (CPU, gloo, real rank processes): a group's
logits and every rank's KV pool against the single-device runner on the same
checkpoint, the split rules, and the loss of a rank."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch

from engine.config import EngineConfig
from engine.forward_batch import ExtendSpec, build_forward_batch
from engine.model_config import ModelConfig
from engine.parallel.follower import RankContext
from engine.parallel.ranks import LeadRunner, RankError, make_runner, rank_device
from engine.parallel.shard import Shard, ShardError, check_split, kv_head_range, kv_head_ranges
from engine.runner import ModelRunner

TOL = 1e-4
PAGE_SIZE = 4


def _config(path: object, tp: int) -> EngineConfig:
    mc = ModelConfig.load(str(path))
    return EngineConfig(
        model=str(path), device="cpu", page_size=PAGE_SIZE, num_pages=64, tp_size=tp
    ).resolve(mc)


def _pool(ctx: RankContext) -> torch.Tensor:
    """A rank's KV pool (run on the rank by ``LeadRunner.call``)."""
    return ctx.runner.pool.kv.clone()


def _steps(rng: random.Random, vocab: int) -> list[list[ExtendSpec]]:
    """A mixed prefill batch, a chunk beside a decode row, then decode steps."""
    pages = list(range(1, 64))
    rng.shuffle(pages)
    a_pages, b_pages = pages[:8], pages[8:16]
    a = [rng.randrange(3, vocab) for _ in range(11)]
    b = [rng.randrange(3, vocab) for _ in range(13)]
    steps = [
        [ExtendSpec(a, 0, a_pages, "all"), ExtendSpec(b[:6], 0, b_pages, "none")],
        [ExtendSpec(b[6:], 6, b_pages, "all"), ExtendSpec([7], 11, a_pages)],
    ]
    for i in range(3):
        steps.append([ExtendSpec([9 + i], 12 + i, a_pages), ExtendSpec([11 + i], 13 + i, b_pages)])
    return steps


@pytest.mark.parametrize(
    "variant",
    [
        "llama-mha-llama3rope",
        "llama-gqa4-tied",
        "qwen2-gqa2",
        "qwen3-gqa4",
        "llama-mqa",
        "qwen3moe-e8k2-norm",
        "qwen2moe-shared",
    ],
)
def test_tp2_logits_and_pools_equal_one_device(hf_checkpoint, variant: str) -> None:
    path, _ = hf_checkpoint(variant)
    mc = ModelConfig.load(str(path))
    one = ModelRunner(_config(path, 1), mc)
    group = make_runner(_config(path, 2), mc)
    assert isinstance(group, LeadRunner)
    try:
        for i, specs in enumerate(_steps(random.Random(0), mc.vocab_size)):
            fb = build_forward_batch(specs, PAGE_SIZE, "cpu")
            ref = one.forward_logits(fb)
            ours = group.forward_logits(fb)
            assert ours.shape == ref.shape == (fb.logits_indices.numel(), mc.vocab_size)
            assert (ours - ref).abs().max().item() < TOL, f"step {i}"
        # Every rank's pool holds exactly its KV heads of the one-device pool.
        pools = [group.pool.kv, group.call(1, _pool)]
        for rank, pool in enumerate(pools):
            k0, k1 = kv_head_range(mc.num_kv_heads, 2, rank)
            want = one.pool.kv[..., k0:k1, :]
            assert pool.shape == want.shape
            assert (pool - want).abs().max().item() < TOL, f"rank {rank}"
        assert group.failure() is None
    finally:
        group.close()


def test_tp4_with_fewer_kv_heads_than_ranks(hf_checkpoint) -> None:
    """Two KV heads over four ranks: each is held by the two ranks whose query
    heads use it."""
    path, _ = hf_checkpoint("qwen3-gqa4")
    mc = ModelConfig.load(str(path))
    one = ModelRunner(_config(path, 1), mc)
    group = make_runner(_config(path, 4), mc)
    try:
        for specs in _steps(random.Random(1), mc.vocab_size)[:3]:
            fb = build_forward_batch(specs, PAGE_SIZE, "cpu")
            assert (group.forward_logits(fb) - one.forward_logits(fb)).abs().max().item() < TOL
        assert isinstance(group, LeadRunner)
        for rank in (1, 3):
            k = rank // 2
            want = one.pool.kv[..., k : k + 1, :]
            assert (group.call(rank, _pool) - want).abs().max().item() < TOL
    finally:
        group.close()


def test_split_rules() -> None:
    assert kv_head_ranges(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert kv_head_ranges(2, 4) == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert kv_head_ranges(1, 2) == [(0, 1), (0, 1)]
    assert Shard(1, 3).vocab(320) == (107, 214, 107)
    assert Shard(2, 3).vocab(320) == (214, 320, 107)
    check_split(4, num_heads=8, num_kv_heads=2, intermediate_size=128)
    with pytest.raises(ShardError, match=r"num_attention_heads \(4\).*intermediate_size"):
        check_split(3, num_heads=4, num_kv_heads=4, intermediate_size=128)
    with pytest.raises(ShardError, match=r"moe_intermediate_size \(6\)"):
        check_split(
            4,
            num_heads=8,
            num_kv_heads=2,
            intermediate_size=8,
            expert_sizes={"moe_intermediate_size": 6},
        )
    with pytest.raises(ShardError, match=r"num_key_value_heads \(2\)"):
        check_split(3, num_heads=6, num_kv_heads=2, intermediate_size=6)
    assert rank_device("cuda", 1) == "cuda:1"
    assert rank_device("cuda:2", 1) == "cuda:3"
    assert rank_device("cpu", 1) == "cpu"


def test_impossible_tp_size_refused_at_resolve(model_dir: str) -> None:
    mc = ModelConfig.load(model_dir)
    with pytest.raises(ValueError, match="cannot be split over tp_size 3"):
        EngineConfig(model=model_dir, device="cpu", tp_size=3).resolve(mc)


def test_lost_rank_fails_the_group(hf_checkpoint) -> None:
    path, _ = hf_checkpoint("qwen2-gqa2")
    mc = ModelConfig.load(str(path))
    group = make_runner(_config(path, 2), mc)
    try:
        (pid,) = group.rank_pids
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while group.failure() is None:
            assert time.monotonic() < deadline, "the lost rank was not noticed"
            time.sleep(0.02)
        assert f"pid {pid}" in (group.failure() or "")
        fb = build_forward_batch([ExtendSpec([5, 6, 7], 0, [1])], PAGE_SIZE, "cpu")
        with pytest.raises((RankError, RuntimeError)):
            group.forward_logits(fb)
    finally:
        group.close()
