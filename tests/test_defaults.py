"""The defaults a new user gets: devices, the KV pool's size, graph sizes, the
transfer backend, the embedded workers' placement, and models by name."""

from __future__ import annotations

import pytest
import torch

import kvtransfer.nixl
from engine.checkpoints import ModelNotFound, is_repo_id, local_model_dir, served_name
from engine.config import CPU_TOKEN_BUDGET, EngineConfig, resolve_device
from engine.memory import GIB, MemoryPlan, NotEnoughMemory
from engine.model_config import ModelConfig
from gateway.__main__ import _embedded_config, build_parser
from gateway.embedded import EmbeddedConfig, EmbeddedWorkers
from kvtransfer import auto_backend
from worker.config import WorkerConfig

# -- devices -------------------------------------------------------------------------


def test_devices_resolve_to_an_index_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    assert resolve_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="no CUDA device"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="not a torch device"):
        resolve_device("gpu0")


def test_devices_resolve_to_the_current_cuda_device(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve_device("auto") == "cuda:1"
    assert resolve_device("cuda") == "cuda:1"
    assert resolve_device("CUDA:0") == "cuda:0"
    with pytest.raises(ValueError, match="only 2 CUDA device"):
        resolve_device("cuda:2")
    # Workers, the offline engine and benchmarks resolve through the same rule.
    engine = EngineConfig(model=str(tmp_path), device="cuda")
    assert engine.resolve_model_and_device().device == "cuda:1"


# -- the KV pool's size ----------------------------------------------------------------


def _plan(**kw: float) -> MemoryPlan:
    gib = {"total": 140, "free_at_start": 139, "weights": 15, "activations": 1, "graphs": 0.25}
    gib.update(kw)
    return MemoryPlan(
        utilization=kw.pop("utilization", 0.9),
        page_bytes=2 << 20,  # a page of 16 tokens of Llama-3.1-8B
        **{k: int(v * GIB) for k, v in gib.items() if k != "utilization"},
    )


def test_memory_plan_takes_a_share_of_the_total() -> None:
    plan = _plan()
    assert plan.budget == int(0.9 * 140 * GIB)
    assert plan.kv_bytes == int(0.9 * 140 * GIB) - int(16.25 * GIB)
    assert plan.num_pages == plan.kv_bytes // (2 << 20) + 1
    line = plan.describe()
    assert "0.9 of 140.00 GiB" in line and "weights 15.00" in line and "KV pool 109.75" in line
    # Two workers with half the share each, whichever starts first, get equal
    # pools: the share is of the total, and each found it free.
    first = _plan(utilization=0.45)
    second = _plan(utilization=0.45, free_at_start=139 - 63)
    assert first.num_pages == second.num_pages


def test_memory_plan_never_takes_more_than_was_free() -> None:
    # Another process holds most of the GPU: the budget is what was free, less
    # the reserve, and the log says so.
    plan = _plan(free_at_start=40)
    assert plan.budget == 39 * GIB
    assert "40.00 GiB free at start" in plan.describe()
    with pytest.raises(NotEnoughMemory, match="two workers on one GPU need a share each"):
        _ = _plan(free_at_start=14).num_pages
    with pytest.raises(NotEnoughMemory, match="weights 15.00"):
        _ = _plan(utilization=0.1).num_pages


def test_memory_plan_takes_only_what_is_still_free_before_the_pool() -> None:
    # Two workers started together with the default share both read 139 GiB
    # free at start; by the time the second allocates its pool the first
    # holds 0.9 of the GPU, and 14 GiB are left.
    plan = _plan(weights=2, free_before_pool=14)
    kept = int(14 * GIB) - int(1.25 * GIB) - GIB  # activations, graphs, reserve
    assert plan.kv_bytes == kept < _plan(weights=2).kv_bytes
    assert "capped: 14.00 GiB free before the pool" in plan.describe()
    # When enough is still free the share decides, and the log says nothing more.
    roomy = _plan(utilization=0.45, free_before_pool=120)
    assert roomy.kv_bytes == _plan(utilization=0.45).kv_bytes
    assert "capped" not in roomy.describe()


def test_pool_and_budget_defaults_off_cuda(tmp_path) -> None:
    mc = ModelConfig.load("llama-3.2-1b")
    cfg = EngineConfig(model="llama-3.2-1b", device="cpu").resolve(mc)
    assert cfg.pool_sized_by == "kv_cache_memory_gb"
    assert cfg.max_num_batched_tokens == CPU_TOKEN_BUDGET
    page = 16 * 16 * 2 * 8 * 64 * 2  # tokens x layers x K/V x heads x dim x bf16
    assert cfg.num_pages == (1 << 28) // page + 1  # 0.25 GiB
    on_gpu = EngineConfig(model="llama-3.2-1b", device="cpu", kv_cache_memory_gb=1.0)
    assert on_gpu.resolve(mc).num_pages == (1 << 30) // page + 1
    by_pages = EngineConfig(num_pages=9, device="cpu", kv_cache_memory_gb=2).resolve(mc)
    assert (by_pages.num_pages, by_pages.pool_sized_by) == (9, "num_pages")
    # On CUDA the runner sizes it from the device (see engine.memory).
    assert EngineConfig(device="cuda:0").pool_sized_by == "gpu_memory_utilization"
    assert EngineConfig(device="cuda:0", kv_cache_memory_gb=4).pool_sized_by == (
        "kv_cache_memory_gb"
    )
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5)


def test_graph_sizes_the_pool_cannot_hold_are_skipped() -> None:
    cfg = EngineConfig(device="cpu", cuda_graph_max_bs=256)
    small, warning = cfg.with_pool(129)
    assert (small.num_pages, small.cuda_graph_max_bs) == (129, 128)
    assert warning is not None and "above 128 are not captured" in warning
    big, warning = cfg.with_pool(100_000)
    assert (big.cuda_graph_max_bs, warning) == (256, None)
    off, warning = EngineConfig(device="cpu", cuda_graph_max_bs=0).with_pool(2)
    assert (off.cuda_graph_max_bs, warning) == (0, None)


# -- the transfer backend -----------------------------------------------------------


def test_transfer_backend_defaults_to_nixl_on_cuda_where_it_imports(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert WorkerConfig().transfer_backend == "auto"
    assert auto_backend("cpu") == "tcp"
    monkeypatch.setattr(kvtransfer.nixl, "nixl_available", lambda: (True, ""))
    assert auto_backend("cuda:0") == "nixl"
    assert auto_backend("cpu") == "tcp"
    monkeypatch.setattr(kvtransfer.nixl, "nixl_available", lambda: (False, "no nixl"))
    assert auto_backend("cuda:0") == "tcp"
    resolved = WorkerConfig.from_settings(device="cpu", role="decode").resolve()
    assert resolved.transfer_backend == "tcp" and resolved.is_resolved
    explicit = WorkerConfig.from_settings(device="cpu", transfer_backend="nixl").resolve()
    assert explicit.transfer_backend == "nixl"


# -- the embedded workers -----------------------------------------------------------


@pytest.mark.parametrize(
    "flags, gpus, expected",
    [
        ([], 0, ("cpu", "cpu", 0.9)),
        ([], 1, ("cuda:0", "cuda:0", 0.45)),
        ([], 2, ("cuda:0", "cuda:1", 0.9)),
        (["--device", "cuda"], 8, ("cuda:0", "cuda:1", 0.9)),
        (["--tp-size", "2"], 2, ("cuda:0", "cuda:0", 0.45)),
        (["--tp-size", "2"], 4, ("cuda:0", "cuda:2", 0.9)),
        (["--device", "cuda:3"], 4, ("cuda:3", "cuda:3", 0.45)),
        (["--gpu-memory-utilization", "0.6"], 1, ("cuda:0", "cuda:0", 0.3)),
        (["--decode-device", "cuda:1"], 1, ("cuda:0", "cuda:1", 0.9)),
        (["--device", "cpu"], 2, ("cpu", "cpu", 0.9)),
    ],
)
def test_embedded_workers_placement(
    flags: list[str], gpus: int, expected: tuple[str, str, float]
) -> None:
    config = _embedded_config(build_parser().parse_args(flags))
    prefill, decode, share = config.placement(gpus)
    assert (prefill, decode, share) == pytest.approx(expected)


def test_embedded_workers_take_the_workers_flags() -> None:
    argv = ["--model", "qwen3-8b", "--load-format", "dummy", "--tp-size", "2"]
    argv += ["--cuda-graph-max-bs", "64", "--max-num-batched-tokens", "4096", "--dtype", "float16"]
    config = _embedded_config(build_parser().parse_args(argv))
    engine = config.worker.engine
    assert (engine.model, engine.load_format, engine.tp_size) == ("qwen3-8b", "dummy", 2)
    assert (engine.cuda_graph_max_bs, engine.max_num_batched_tokens) == (64, 4096)
    cmd = EmbeddedWorkers(config)._cmd("decode_server", "decode", 1234, "cuda:0", 0.45)
    joined = " ".join(cmd)
    for part in ("--role decode", "--port 1234", "--device cuda:0", "--model qwen3-8b"):
        assert part in joined
    for part in ("--load-format dummy", "--tp-size 2", "--gpu-memory-utilization 0.45"):
        assert part in joined
    assert "--dtype float16" in joined and "--max-num-batched-tokens 4096" in joined
    assert EmbeddedConfig() == _embedded_config(build_parser().parse_args([]))


# -- models by name -------------------------------------------------------------------


def test_a_preset_with_dummy_weights_serves_a_tokenizer(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DISAGG_CACHE_DIR", str(tmp_path))
    path = local_model_dir("qwen3-0.6b", "dummy")
    assert path.startswith(str(tmp_path)) and path.endswith("qwen3-0.6b")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    assert tok.decode([5, 77]) == "t5 t77"
    assert ModelConfig.load(path) == ModelConfig.load("qwen3-0.6b")
    assert local_model_dir("qwen3-0.6b", "dummy") == path  # built once
    assert served_name("qwen3-0.6b") == "qwen3-0.6b"
    assert WorkerConfig.from_settings(model="qwen3-0.6b").model_name == "qwen3-0.6b"
    with pytest.raises(ModelNotFound, match="add --load-format dummy"):
        local_model_dir("qwen3-0.6b", "auto")
    with pytest.raises(ModelNotFound, match="not a directory, a preset"):
        local_model_dir(str(tmp_path / "missing"), "auto")


def test_a_repo_id_offline_is_one_clear_line(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    repo = "Qwen/Qwen2.5-0.5B-Instruct"
    assert is_repo_id(repo) and not is_repo_id(str(tmp_path))
    assert served_name(repo) == repo
    assert WorkerConfig.from_settings(model=repo).model_name == repo
    with pytest.raises(ModelNotFound) as err:
        local_model_dir(repo, "auto")
    message = str(err.value)
    assert "\n" not in message and "cannot fetch 'Qwen/Qwen2.5-0.5B-Instruct'" in message
