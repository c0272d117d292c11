"""``python -m benchmarks.fp8_accuracy`` on the tiny model on the CPU, against
figures computed here independently: the logits' errors against those of the
loader's own FP8 models (``--quantization fp8``; a per-tensor FP8
checkpoint), and the full-precision residual stream against HF transformers'
hidden states on the same weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fp8_checkpoint import cpu_runner, quantized_checkpoint

from engine.forward_batch import ExtendSpec, build_forward_batch
from engine.runner import ModelRunner

PROMPT = 24
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def report(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("fp8-accuracy") / "acc.json"
    cmd = [sys.executable, "-m", "benchmarks.fp8_accuracy", "--model", model_dir]
    cmd += ["--device", "cpu", "--prompt-len", str(PROMPT), "--output-file", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "channel scale" in done.stdout  # the table
    return json.loads(out.read_text())


def _ids(vocab: int) -> list[int]:
    """The tool's prompt: ``--seed 0``."""
    return torch.randint(3, vocab, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()


def _logits(runner: ModelRunner) -> torch.Tensor:
    ids = _ids(runner.model_config.vocab_size)
    pages = runner.pool.allocator.alloc(-(-len(ids) // 4))
    assert pages is not None
    try:
        with torch.inference_mode():
            return runner.forward_logits(
                build_forward_batch([ExtendSpec(ids, 0, pages, "all")], 4, "cpu")
            )
    finally:
        runner.pool.allocator.free(pages)


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).norm() / ref.double().norm()).item()


def test_per_channel_figures_are_the_loaders_fp8_model(report: dict, model_dir: str) -> None:
    ref, got = _logits(cpu_runner(model_dir)), _logits(cpu_runner(model_dir, "fp8"))
    # Two processes: their float32 sums may differ in the last bits.
    assert report["channel"]["logits_rel_err"] == pytest.approx(_rel(got, ref), rel=1e-4)
    top1 = (got.argmax(-1) == ref.argmax(-1)).double().mean().item()
    assert report["channel"]["top1_agreement"] == pytest.approx(top1, abs=1.5 / PROMPT)


def test_per_tensor_figures_are_a_per_tensor_checkpoints(
    report: dict, model_dir: str, tmp_path
) -> None:
    """q, k, v (and gate, up) each with their own scale, as the checkpoint's
    separate tensors have."""
    ckpt = tmp_path / "fp8-tensor"
    quantized_checkpoint(Path(model_dir), ckpt, per_tensor=True)
    loaded = cpu_runner(ckpt)
    assert loaded.model_config.fp8
    ref, got = _logits(cpu_runner(model_dir)), _logits(loaded)
    assert report["tensor"]["logits_rel_err"] == pytest.approx(_rel(got, ref), rel=1e-4)
    assert report["tensor"]["logits_rel_err"] != report["channel"]["logits_rel_err"]


def test_the_streams_are_the_models_residual_stream(report: dict, model_dir: str) -> None:
    """HF's hidden state after each layer but the last (the last is normed)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([_ids(hf.config.vocab_size)])
    with torch.no_grad():
        hidden = hf(ids, output_hidden_states=True).hidden_states
    norms = report["ref_stream_norms"]
    assert len(norms) == hf.config.num_hidden_layers
    for i, norm in enumerate(norms[:-1]):
        assert norm == pytest.approx(hidden[i + 1][0].double().norm().item(), rel=1e-4)


def test_every_layer_moves_and_none_far(report: dict) -> None:
    assert report["projections"] == 4 * len(report["ref_stream_norms"])
    for scale in ("channel", "tensor"):
        r = report[scale]
        # e4m3 rounds each operand by up to 2^-4 (rms ~3.6%).
        assert all(1e-3 < e < 0.25 for e in r["layer_rel_err"]), r
        assert 1e-3 < r["logits_rel_err"] < 0.25 and r["mean_kl"] > 0
