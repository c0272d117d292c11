"""Tensor parallelism on CUDA (two GPUs; skipped with fewer): NCCL all-reduce
and logits gather, CUDA graphs that contain them, and KV moved between a
prefill and a decode group of different sizes over NIXL."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from workers import dump_log, free_port, launch_workers, worker_cmd

from engine.config import EngineConfig
from engine.forward_batch import ExtendSpec, build_forward_batch
from engine.llm import LLM
from engine.model_config import ModelConfig
from engine.parallel.ranks import LeadRunner, make_runner
from engine.runner import ModelRunner
from kvtransfer.nixl import nixl_available
from protocol.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs two CUDA devices",
    ),
]

PAGE = 16


@pytest.fixture(scope="module")
def kernel_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real weights in a head size the FlashInfer kernels are built for."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        max_position_embeddings=1024,
        initializer_range=0.05,
    )
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("tp-kernel-model")
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(d)
    return d


def _runner(path: object, tp: int, **kw: object) -> ModelRunner:
    dtype = kw.pop("dtype", None)
    mc = ModelConfig.load(str(path), dtype)  # type: ignore[arg-type]
    cfg = EngineConfig(
        model=str(path), device="cuda:0", page_size=PAGE, num_pages=64, tp_size=tp, **kw
    ).resolve(mc)  # type: ignore[arg-type]
    return make_runner(cfg, mc)


def _steps(vocab: int) -> list[list[ExtendSpec]]:
    rng = random.Random(0)
    pages = list(range(1, 40))
    rng.shuffle(pages)
    tables = [pages[i * 8 : (i + 1) * 8] for i in range(3)]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (9, 30, 17)]
    steps = [[ExtendSpec(p, 0, t) for p, t in zip(prompts, tables)]]
    for i in range(4):  # decode rows: replayed as graphs where there are graphs
        steps.append([ExtendSpec([5 + i], len(p) + i, t) for p, t in zip(prompts, tables)])
    return steps


def test_tp2_fp32_logits_equal_one_device(hf_checkpoint) -> None:
    path, _ = hf_checkpoint("qwen2-gqa2")
    one = _runner(path, 1)
    group = _runner(path, 2)
    try:
        for specs in _steps(320):
            fb = build_forward_batch(specs, PAGE, "cuda:0")
            diff = (group.forward_logits(fb) - one.forward_logits(fb)).abs().max().item()
            assert diff < 1e-4
    finally:
        group.close()


def test_tp2_cuda_graphs_contain_the_all_reduce(kernel_checkpoint: Path) -> None:
    """bf16, FlashInfer: the graphs of a group replay what its eager forward
    computes, and both are the one-device model's logits up to bf16 sums."""
    kw = dict(attention_backend="flashinfer", dtype=torch.bfloat16)
    graphs = _runner(kernel_checkpoint, 2, cuda_graph_max_bs=4, **kw)
    eager = _runner(kernel_checkpoint, 2, cuda_graph_max_bs=0, **kw)
    one = _runner(kernel_checkpoint, 1, cuda_graph_max_bs=4, **kw)
    try:
        assert isinstance(graphs, LeadRunner) and graphs.graphs is not None
        for i, specs in enumerate(_steps(1000)):
            fb = build_forward_batch(specs, PAGE, "cuda:0")
            g, e, o = (r.forward_logits(fb) for r in (graphs, eager, one))
            torch.testing.assert_close(g, e, atol=2e-2, rtol=2e-2, msg=f"step {i}")
            torch.testing.assert_close(g, o, atol=1e-1, rtol=5e-2, msg=f"step {i}")
            assert (g.argmax(-1) == o.argmax(-1)).float().mean().item() >= 2 / 3
    finally:
        graphs.close()
        eager.close()


@pytest.mark.e2e
@pytest.mark.skipif(not nixl_available()[0], reason="nixl not importable")
@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1), (2, 2)])
def test_pd_across_tp_sizes_over_nixl(
    model_dir: str, tmp_path: Path, request: pytest.FixtureRequest, p_tp: int, d_tp: int
) -> None:
    """Greedy fp32 tokens of prefill TP ``p_tp`` -> decode TP ``d_tp`` equal
    the one-device engine's (the test plays the gateway)."""
    import asyncio

    from test_pd_e2e import TOKEN, clients, final, pd_request

    from worker.cli import CLUSTER_TOKEN_ENV

    env = {CLUSTER_TOKEN_ENV: TOKEN}
    engine = dict(page_size=PAGE, num_pages=256, context_length=256, transfer_backend="nixl")
    specs = []
    for name, module, role, tp in (
        ("prefill", "prefill_server", "prefill", p_tp),
        ("decode", "decode_server", "decode", d_tp),
    ):
        port = free_port()
        flags = ("--device", "cuda:0", "--dtype", "float32")
        cmd = worker_cmd(module, model_dir, port, role=role, flags=flags, tp_size=tp, **engine)
        specs.append((cmd, port, tmp_path / f"{name}.log", env))
    prompts = [[(11 * i + j) % 400 + 3 for j in range(n)] for i, n in enumerate((7, 40, 100))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = LLM(model_dir, device="cuda:0", dtype="float32", page_size=PAGE, kv_cache_memory_gb=0.25)
    want = [o.token_ids for o in llm.generate(prompts, params)]
    failed = request.session.testsfailed
    with launch_workers(specs) as (p, d):
        try:

            async def run() -> list[list[int]]:
                pc, dc = clients(p, d)
                out = []
                try:
                    for i, prompt in enumerate(prompts):
                        res = await pd_request(pc, dc, p, d, f"tp-{i}", prompt, params)
                        assert final(res.decode).finish_reason == "length"
                        out.append(res.tokens)
                finally:
                    await pc.close()
                    await dc.close()
                return out

            assert asyncio.run(run()) == want
        finally:
            if request.session.testsfailed > failed:
                for w in (p, d):
                    dump_log(request.config, w.log_path)
