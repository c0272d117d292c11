"""``benchmarks.fp8_accuracy`` on the CPU: the FP8 models it builds from the
full-precision weights are the ones the loader makes (online quantization, a
per-tensor FP8 checkpoint), the residual streams it reports are the model's,
and its figures are those of the logits it compares."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fp8_checkpoint import quantized_checkpoint

from benchmarks import fp8_accuracy as acc

PROMPT = 24


@pytest.fixture(scope="module")
def full(model_dir: str) -> acc.ModelRunner:
    return acc.make_runner(model_dir, "cpu", "float32", PROMPT, fp8_weights=False)


def _ids(runner: acc.ModelRunner) -> list[int]:
    g = torch.Generator().manual_seed(5)
    return torch.randint(3, runner.model_config.vocab_size, (PROMPT,), generator=g).tolist()


def test_per_channel_is_what_the_loader_quantizes(model_dir: str, full) -> None:
    built = acc.make_runner(model_dir, "cpu", "float32", PROMPT, fp8_weights=True)
    assert acc.load_fp8_from(built, full, "channel") == 4 * full.model_config.num_layers
    loaded = acc.make_runner(model_dir, "cpu", "float32", PROMPT, fp8_weights=True)
    ids = _ids(full)
    assert torch.equal(acc.run(built, ids)[1], acc.run(loaded, ids)[1])


def test_per_tensor_is_what_a_per_tensor_checkpoint_stores(model_dir: str, full, tmp_path) -> None:
    """q, k, v (and gate, up) each keep their own scale, as the checkpoint's
    separate tensors do."""
    ckpt = tmp_path / "fp8-tensor"
    quantized_checkpoint(Path(model_dir), ckpt, per_tensor=True)
    loaded = acc.make_runner(str(ckpt), "cpu", "float32", PROMPT, fp8_weights=False)
    assert loaded.model_config.fp8
    built = acc.make_runner(model_dir, "cpu", "float32", PROMPT, fp8_weights=True)
    acc.load_fp8_from(built, full, "tensor")
    qkv = built.model.model.layers[0].self_attn.qkv_proj
    assert len(set(qkv.weight_scale.tolist())) == len(qkv.shards)  # one scale per shard
    ids = _ids(full)
    assert torch.equal(acc.run(built, ids)[1], acc.run(loaded, ids)[1])


def test_the_streams_are_the_models_residual_stream(full) -> None:
    """The final norm of the last layer's stream gives the model's logits."""
    streams, logits = acc.run(full, _ids(full))
    assert len(streams) == full.model_config.num_layers
    with torch.inference_mode():
        again = full.model.compute_logits(full.model.model.norm(streams[-1]))
    torch.testing.assert_close(again, logits, rtol=1e-5, atol=1e-5)


def test_the_report_holds_the_figures_of_its_logits(model_dir: str, tmp_path) -> None:
    out = tmp_path / "acc.json"
    body = acc.main(["--model", model_dir, "--prompt-len", "40", "--output-file", str(out)])
    record = json.loads(out.read_text())
    assert record["channel"] == body["channel"] and record["dtype"] == "torch.float32"
    for scale in acc.SCALES:
        r = body[scale]
        assert len(r["layer_rel_err"]) == 2
        # e4m3 rounds each operand by up to 2^-4: every layer moves, none far.
        assert all(1e-3 < e < 0.25 for e in r["layer_rel_err"]), r
        assert 1e-3 < r["logits_rel_err"] < 0.25 and 0.5 <= r["top1_agreement"] <= 1.0
        assert r["mean_kl"] > 0
    # The same figures from the two runs done here.
    full = acc.make_runner(model_dir, "cpu", "float32", 40, fp8_weights=False)
    quant = acc.make_runner(model_dir, "cpu", "float32", 40, fp8_weights=True)
    ids = torch.randint(
        3, full.model_config.vocab_size, (40,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    (ref_streams, ref), (streams, got) = acc.run(full, ids), acc.run(quant, ids)
    assert body["channel"]["logits_rel_err"] == pytest.approx(acc.rel_err(got, ref), rel=1e-9)
    first = ((streams[0] - ref_streams[0]).norm() / ref_streams[0].norm()).item()
    assert body["channel"]["layer_rel_err"][0] == pytest.approx(first, rel=1e-5)
