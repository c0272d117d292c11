"""On CUDA: the engine against HF transformers, and prefill -> decode through
the gateway with the KV pages moved between GPUs (NIXL when importable)."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from graph_decode import PAGE_SIZE, assert_graph_equals_eager, decode_specs, mixed_steps
from workers import launch_gateway, log_tail

from engine.config import EngineConfig
from engine.forward_batch import ExtendSpec, build_forward_batch
from engine.llm import LLM
from engine.model_config import ModelConfig
from engine.runner import ModelRunner
from kvtransfer.nixl import nixl_available
from protocol.sampling import SamplingParams
from worker.config import CLUSTER_TOKEN_ENV

pytestmark = pytest.mark.gpu

PROMPTS = [
    "The quick brown fox jumps over the lazy dog",
    "Once upon a time there was a little",
    "Hello world",
    "In the beginning",
]
MAX_TOKENS = 24
START_TIMEOUT_S = 180.0

KV_GB = 0.25
"""The offline engines and workers here share the GPU (two gateways' workers
are up at once): each takes a small fixed pool, not its share of the device."""


def _devices() -> tuple[str, str]:
    """Prefill and decode devices: two GPUs when there are two."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return ("cuda:0", "cuda:1") if n >= 2 else ("cuda:0", "cuda:0")


def test_engine_matches_hf_on_cuda(model_dir: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf = hf.to("cuda:0").eval()
    llm = LLM(model_dir, device="cuda:0", dtype="float32", page_size=16, kv_cache_memory_gb=KV_GB)
    ids = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate(ids, params)
    for p_ids, out in zip(ids, outs):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([p_ids], device="cuda:0"),
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                do_sample=False,
            )
        assert out.token_ids == ref[0, len(p_ids) :].tolist()
    sched, alloc = llm.engine.scheduler, llm.engine.runner.pool.allocator
    assert not sched.running and not sched.waiting
    if sched.cache is not None:  # finished prompts stay cached, unreferenced
        assert sched.cache.locked_pages == 0
        sched.cache.reset()
    assert alloc.num_free == alloc.capacity


TOKEN = "gpu-test-token"

KERNEL_MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "vocab_size": 1000,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}
"""Small, but in a head size the FlashInfer kernels are built for (bf16, 128)."""


def _kernel_runner(
    backend: str,
    graph_bs: int | None = None,
    num_pages: int = 128,
    kv_heads: int = 2,
    graph_tokens: int = 0,
    fresh: bool | None = None,
) -> ModelRunner:
    """``kv_heads`` 2: two query heads per KV head (CUDA-core decode); 1: four
    (tensor-core decode). ``graph_tokens``: piecewise graphs' largest forward;
    ``fresh``: ``fresh_prefill_graphs`` (None: auto)."""
    model = {**KERNEL_MODEL, "num_key_value_heads": kv_heads}
    mc = ModelConfig.from_dict(model, dtype=torch.bfloat16)
    cfg = EngineConfig(
        model="kernel-test",
        load_format="dummy",
        device="cuda:0",
        page_size=16,
        num_pages=num_pages,
        max_running_requests=256,
        attention_backend=backend,
        cuda_graph_max_bs=graph_bs,
        cuda_graph_max_tokens=graph_tokens,
        fresh_prefill_graphs=fresh,
    ).resolve(mc)
    assert cfg.attention_backend == backend
    return ModelRunner(cfg, mc)


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_flashinfer_matches_torch_native(kv_heads: int) -> None:
    """Same weights, same batches (prefill of several prompts, decode, a chunk
    after a cached prefix, a mixed batch) through both backends."""
    assert (
        EngineConfig(model="kernel-test", device="cuda:0")
        .resolve(ModelConfig.from_dict(KERNEL_MODEL, dtype=torch.bfloat16))
        .attention_backend
        == "flashinfer"
    ), "auto should pick flashinfer here"
    runners = [
        _kernel_runner("torch_native", kv_heads=kv_heads),
        _kernel_runner("flashinfer", graph_bs=0, kv_heads=kv_heads),  # eager
        # Decode of 4 rows: too big for graphs up to 2 (eager), a graph of 4 below.
        _kernel_runner("flashinfer", graph_bs=2, kv_heads=kv_heads),
        _kernel_runner("flashinfer", graph_bs=8, kv_heads=kv_heads),
        # Every forward from the piecewise graphs, decode rows included; and
        # with fresh prompts' forwards as one graph (Triton's attention:
        # checked against the reference only).
        _kernel_runner("flashinfer", graph_bs=0, kv_heads=kv_heads, graph_tokens=256, fresh=False),
        _kernel_runner("flashinfer", graph_bs=0, kv_heads=kv_heads, graph_tokens=256, fresh=True),
    ]
    assert runners[0].graphs is None and runners[1].graphs is None
    assert runners[3].graphs is not None and runners[3].graphs.sizes == [1, 2, 4, 8]
    assert runners[1].pieces is None and runners[4].pieces is not None
    assert runners[4].pieces.fresh_attn is None and runners[5].pieces.fresh_attn is not None
    ps = PAGE_SIZE
    steps, _ = mixed_steps(runners)
    for i, specs in enumerate(steps):
        ref, *outs = (r.forward_logits(build_forward_batch(specs, ps, "cuda:0")) for r in runners)
        scale = ref.abs().max().item()
        for j, got in enumerate(outs):
            diff = (got - ref).abs()
            what = f"step {i}, runner {j + 1}"
            assert diff.max().item() < 0.05 * scale, f"{what}: {diff.max().item()} vs {scale}"
            assert diff.mean().item() < 0.005 * scale, what
            agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
            assert agree > 0.9, f"{what}: argmax agrees on {agree:.0%}"
        # The graphs replay the eager kernels: same numbers up to the work split.
        assert (outs[2] - outs[0]).abs().max().item() < 0.01 * scale, f"step {i}: graph vs eager"
        assert (outs[3] - outs[0]).abs().max().item() < 0.01 * scale, f"step {i}: pieces vs eager"


@pytest.mark.parametrize("kv_heads", [2, 1])
@pytest.mark.parametrize("batch_size", [1, 3, 64, 256])
def test_cuda_graph_decode_equals_eager(batch_size: int, kv_heads: int) -> None:
    """A decode step replayed from a CUDA graph (padded to a captured size) gives
    the eager forward's tokens, with the fused layer kernels inside the graph."""
    runner = _kernel_runner("flashinfer", graph_bs=256, num_pages=1200, kv_heads=kv_heads)
    assert runner.graphs is not None and 256 in runner.graphs.sizes
    runner.pool.kv.normal_()
    batch = build_forward_batch(decode_specs(runner, batch_size), PAGE_SIZE, "cuda:0")
    assert_graph_equals_eager(runner, batch)


def test_cuda_graph_decode_with_shared_prefix_pages_beyond_the_pool() -> None:
    """Rows that share their prefix pages list more pages in all than the pool
    holds (64 rows x 10 pages over an 80-page pool): the graph replays them,
    as the eager forward runs them."""
    runner = _kernel_runner("flashinfer", graph_bs=64, num_pages=80)
    assert runner.graphs is not None and 64 in runner.graphs.sizes
    runner.pool.kv.normal_()
    ps, gen = 16, torch.Generator().manual_seed(5)
    shared = runner.pool.allocator.alloc(9)
    assert shared is not None
    specs = []
    for i in range(64):
        own = runner.pool.allocator.alloc(1)  # the page the row's new token goes to
        assert own is not None
        ctx = 9 * ps + i % ps
        token = int(torch.randint(3, 1000, (1,), generator=gen))
        specs.append(ExtendSpec([token], ctx, shared + own))
    batch = build_forward_batch(specs, ps, "cuda:0")
    assert sum(len(t) for t in batch.page_tables) > runner.pool.allocator.num_pages + 64
    assert_graph_equals_eager(runner, batch)


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_short_prefill_replays_as_decode_rows(kv_heads: int) -> None:
    """Short prompts, a short chunk after a cached prefix and a decoding row in
    one batch replay a decode graph (one row per new token) and give the eager
    prefill's logits and the torch reference's."""
    runners = [
        _kernel_runner("torch_native", kv_heads=kv_heads),
        _kernel_runner("flashinfer", graph_bs=0, kv_heads=kv_heads),
        _kernel_runner("flashinfer", graph_bs=32, kv_heads=kv_heads),
    ]
    graphs = runners[2].graphs
    assert graphs is not None
    gen = torch.Generator().manual_seed(kv_heads)
    prompts = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (7, 1, 40)]
    tables = []
    for r in runners:
        r.pool.kv.zero_()
        tables = [r.pool.allocator.alloc(4) for _ in prompts]
    assert all(t is not None for t in tables)
    ps = 16
    # The third prompt's first 33 tokens are computed first (eagerly: too many
    # tokens for the graphs), then 7 more come with the other two prompts.
    first = [ExtendSpec(prompts[2][:33], 0, tables[2], "none")]
    second = [
        ExtendSpec(prompts[0], 0, tables[0], "all"),
        ExtendSpec(prompts[1], 0, tables[1], "last"),
        ExtendSpec(prompts[2][33:], 33, tables[2], "all"),
    ]
    assert graphs.as_decode_rows(build_forward_batch(first, ps, "cuda:0")) is None
    batch = build_forward_batch(second, ps, "cuda:0")
    assert graphs.as_decode_rows(batch) is not None
    for r in runners:
        r.forward_logits(build_forward_batch(first, ps, "cuda:0"))
    ref, eager, graph = (r.forward_logits(batch).float() for r in runners)
    assert ref.shape == graph.shape == (15, KERNEL_MODEL["vocab_size"])
    scale = ref.abs().max().item()
    for what, got in (("eager", eager), ("graph", graph)):
        assert (got - ref).abs().max().item() < 0.05 * scale, what
        assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() > 0.9, what
    assert (graph - eager).abs().max().item() < 0.01 * scale


def test_overlap_with_cuda_graphs_matches_sync(tmp_path: Path) -> None:
    """The overlap loop plans step N+1 while step N may still be queued: with
    plan slots it gives exactly the tokens of the synchronous loop, through
    CUDA graphs of several padded sizes and eager prefills."""
    (tmp_path / "config.json").write_text(json.dumps(KERNEL_MODEL))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in range(5, 70, 4)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    outs = []
    for overlap in (True, False):
        llm = LLM(
            str(tmp_path),
            load_format="dummy",
            device="cuda:0",
            dtype="bfloat16",
            page_size=16,
            max_num_batched_tokens=256,
            cuda_graph_max_bs=12,
            kv_cache_memory_gb=KV_GB,
            overlap=overlap,
        )
        assert llm.engine.runner.graphs is not None
        outs.append([o.token_ids for o in llm.generate(prompts, params)])
        del llm
    assert outs[0] == outs[1]


@contextlib.contextmanager
def _pd_gateway(model_dir: str, log_path: Path) -> Iterator[str]:
    """The embedded gateway on ``model_dir``: prefill on the first GPU, decode on
    the second (NIXL when importable); its log is printed when anything fails."""
    prefill_dev, decode_dev = _devices()
    backend = "nixl" if nixl_available()[0] else "tcp"
    args = ["--prefill-device", prefill_dev, "--decode-device", decode_dev]
    args += ["--transfer-backend", backend, "--model", model_dir]
    # A fixed pool: the module's two gateways are up at the same time.
    args += ["--kv-cache-memory-gb", str(KV_GB)]
    try:
        with launch_gateway(args, log_path, START_TIMEOUT_S, {CLUSTER_TOKEN_ENV: TOKEN}) as (
            url,
            _,
        ):
            yield url
    except BaseException:
        print(log_tail(log_path), file=sys.stderr)
        raise


def _greedy_ids(client: openai.OpenAI, prompt: list[int], **extra: bool) -> list[int]:
    """The token ids of one greedy completion of MAX_TOKENS."""
    model = client.models.list().data[0].id
    resp = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True, **extra},
    )
    return (resp.choices[0].model_extra or {}).get("token_ids")


@pytest.fixture(scope="module")
def gateway(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with _pd_gateway(model_dir, tmp_path_factory.mktemp("gpu-gateway") / "gateway.log") as url:
        yield url


def _worker_stats(url: str) -> list[dict]:
    # The cluster token is also the admin key (the admin API is never open).
    headers = {"Authorization": f"Bearer {TOKEN}"}
    workers = httpx.get(f"{url}/admin/workers", headers=headers, timeout=10).json()["workers"]
    return [httpx.get(f"{w['url']}/server_info", timeout=10).json()["stats"] for w in workers]


def test_pd_across_gpus_matches_offline(gateway: str, model_dir: str) -> None:
    start = _worker_stats(gateway)
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0, timeout=120)
    llm = LLM(model_dir, device=_devices()[1], page_size=16, kv_cache_memory_gb=KV_GB)
    tok = llm.tokenizer
    ids = [tok.encode(p) for p in PROMPTS]
    wants = llm.generate(ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    for p_ids, want in zip(ids, wants):
        assert _greedy_ids(client, p_ids) == want.token_ids
    deadline = time.monotonic() + 10
    while True:
        now = _worker_stats(gateway)
        if [s["available_pages"] for s in now] == [s["available_pages"] for s in start]:
            break
        assert time.monotonic() < deadline, f"pools not back: {now} vs {start}"
        time.sleep(0.1)
    assert all(s["running"] == 0 for s in now)


def test_pd_with_flashinfer_matches_offline(tmp_path: Path) -> None:
    """A bf16 model in a kernel head size: prefill (FlashInfer) on GPU 0, KV over
    NIXL into GPU 1's pool, decode there from CUDA graphs; one request at a time,
    the tokens equal the offline engine's (same kernels, batch of one)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.dummy_model import write_dummy_model

    cfg = {**KERNEL_MODEL, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}
    model_dir = write_dummy_model(cfg, tmp_path / "kernel-model")
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.bfloat16)
    hf.save_pretrained(model_dir)  # weights (and its own config.json) beside the tokenizer
    llm = LLM(str(model_dir), device=_devices()[1], page_size=16, kv_cache_memory_gb=KV_GB)
    assert llm.engine.config.attention_backend == "flashinfer"
    assert llm.engine.runner.graphs is not None
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (7, 33, 150)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    wants = [llm.generate([p], params)[0].token_ids for p in prompts]
    with _pd_gateway(str(model_dir), tmp_path / "gateway.log") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        for p, want in zip(prompts, wants):
            assert _greedy_ids(client, p, ignore_eos=True) == want
