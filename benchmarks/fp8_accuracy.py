"""How far FP8 weights move a model from its full-precision self, layer by layer.

    python -m benchmarks.fp8_accuracy --model llama-3.1-8b --device cuda:0
    python -m benchmarks.fp8_accuracy            # the built-in tiny model

One model's weights (a checkpoint's, or a preset's dummy weights) run one
prompt three ways: as they are (bf16 on CUDA, float32 on the CPU), and with
every attention and MLP projection in e4m3 with a scale per output row (what
``--quantization fp8`` makes of them at load) or with one scale per
checkpoint tensor (q, k, v, gate, up, o and down each: what per-tensor FP8
checkpoints store). Activations are scaled per token in both FP8 runs, as the
engine always does. Reported for each decoder layer: the relative error
``||x - x_ref|| / ||x_ref||`` of the residual stream after it, over all the
prompt's positions; for the logits: the relative error, the fraction of
positions whose top token agrees with the full-precision model's, and the
mean KL divergence from it. Also recorded: the norm of each full-precision
layer's stream (what the errors are relative to). Prints a table and writes a
JSON record.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import machine, write_record
from engine.config import EngineConfig, resolve_device
from engine.forward_batch import ExtendSpec, build_forward_batch
from engine.layers import fp8
from engine.model_config import ModelConfig
from engine.presets import PRESETS
from engine.runner import ModelRunner

SCALES = ("channel", "tensor")
"""The FP8 weight scales compared: one per output row, one per checkpoint tensor."""
PAGE_SIZE = 16


def make_runner(
    model: str, device: str, dtype: str, prompt_len: int, fp8_weights: bool
) -> ModelRunner:
    cfg = EngineConfig(
        model=model,
        load_format="dummy" if model in PRESETS else "auto",
        dtype=dtype,
        device=device,
        page_size=PAGE_SIZE,
        num_pages=-(-prompt_len // PAGE_SIZE) + 1,
        cuda_graph_max_bs=0,
        cuda_graph_max_tokens=0,  # eager, so that the layers' hooks see every forward
        quantization="fp8" if fp8_weights else None,
    )
    mc = ModelConfig.load(model, cfg.torch_dtype)
    return ModelRunner(cfg.resolve(mc), mc)


def quantized_rows(
    weight: torch.Tensor, scale: str, shards: dict[str, int] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q e4m3, scale float32 [N])`` of a full-precision ``[N, K]`` weight:
    one scale per row, or one per checkpoint tensor (a fused weight's shards,
    e.g. q/k/v, each with its own), every row given its tensor's."""
    if scale == "channel":
        return fp8.quantize_rows(weight)
    sizes = list(shards.values()) if shards else [weight.shape[0]]
    qs, scales = [], []
    for part in weight.split(sizes):
        s = (part.float().abs().amax() / fp8.E4M3_MAX).clamp_min(fp8.SCALE_FLOOR)
        qs.append((part.float() / s).clamp(-fp8.E4M3_MAX, fp8.E4M3_MAX).to(fp8.E4M3))
        scales.append(s.expand(part.shape[0]))
    return torch.cat(qs), torch.cat(scales)


@torch.no_grad()
def load_fp8_from(quant: ModelRunner, full: ModelRunner, scale: str) -> int:
    """Give the FP8 runner the full runner's weights: its projections quantized
    with ``scale``, everything else copied. Returns the projections quantized."""
    full_modules = dict(full.model.named_modules())
    done = 0
    for name, qmod in quant.model.named_modules():
        own = dict(qmod.named_parameters(recurse=False))
        if not own:
            continue
        src = full_modules[name]
        if own.get("weight_scale") is not None:
            q, s = quantized_rows(src.weight, scale, getattr(qmod, "shards", None))
            qmod.weight.copy_(q)
            qmod.weight_scale.copy_(s)
            if qmod.bias is not None:
                qmod.bias.copy_(src.bias)
            done += 1
            continue
        for pname, p in own.items():
            p.copy_(getattr(src, pname))
    return done


@contextmanager
def residual_streams(runner: ModelRunner, out: list[torch.Tensor]) -> Iterator[None]:
    """Append each decoder layer's residual stream after it (its MLP output
    plus the stream before, float32) to ``out`` as a forward runs. Taken as the
    layer returns: the next layer's fused add-and-norm may overwrite them."""

    def hook(module: torch.nn.Module, args: Any, result: tuple[torch.Tensor, torch.Tensor]) -> None:
        h, residual = result
        out.append(h.float() + residual.float())

    handles = [layer.register_forward_hook(hook) for layer in runner.model.model.layers]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def run(runner: ModelRunner, ids: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The residual stream after every layer, and the logits of every position."""
    pages = runner.pool.allocator.alloc(-(-len(ids) // PAGE_SIZE))
    assert pages is not None
    streams: list[torch.Tensor] = []
    try:
        batch = build_forward_batch([ExtendSpec(ids, 0, pages, "all")], PAGE_SIZE, runner.device)
        with torch.inference_mode(), residual_streams(runner, streams):
            logits = runner.forward_logits(batch)
    finally:
        runner.pool.allocator.free(pages)
    return streams, logits


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).norm() / ref.double().norm()).item()


def compare(
    ref: tuple[list[torch.Tensor], torch.Tensor], got: tuple[list[torch.Tensor], torch.Tensor]
) -> dict[str, Any]:
    (ref_streams, ref_logits), (streams, logits) = ref, got
    ref_lp, lp = ref_logits.double().log_softmax(-1), logits.double().log_softmax(-1)
    return {
        "layer_rel_err": [rel_err(g, r) for g, r in zip(streams, ref_streams, strict=True)],
        "logits_rel_err": rel_err(logits, ref_logits),
        "top1_agreement": (logits.argmax(-1) == ref_logits.argmax(-1)).double().mean().item(),
        "mean_kl": (ref_lp.exp() * (ref_lp - lp)).sum(-1).mean().item(),
    }


def measure(model: str, device: str, dtype: str, prompt_len: int, seed: int) -> dict[str, Any]:
    full = make_runner(model, device, dtype, prompt_len, fp8_weights=False)
    gen = torch.Generator().manual_seed(seed)
    vocab = full.model_config.vocab_size
    ids = torch.randint(3, vocab, (prompt_len,), generator=gen).tolist()
    ref = run(full, ids)
    quant = make_runner(model, device, dtype, prompt_len, fp8_weights=True)
    out: dict[str, Any] = {
        "dtype": str(full.model_config.dtype),
        "prompt_len": prompt_len,
        "ref_stream_norms": [x.double().norm().item() for x in ref[0]],
    }
    for scale in SCALES:
        out["projections"] = load_fp8_from(quant, full, scale)
        out[scale] = compare(ref, run(quant, ids))
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.fp8_accuracy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--model",
        default=None,
        help=f"checkpoint dir or preset ({', '.join(PRESETS)}); default: the built-in tiny model",
    )
    ap.add_argument("--device", default="auto", help="torch device (default: auto)")
    ap.add_argument(
        "--dtype",
        default="auto",
        help="the full-precision run's dtype (default: bf16 on CUDA, float32 on the CPU)",
    )
    ap.add_argument(
        "--prompt-len", type=int, default=512, help="prompt tokens (default: %(default)s)"
    )
    ap.add_argument("--seed", type=int, default=0, help="the prompt's seed (default: %(default)s)")
    ap.add_argument("--output-file", default=None, help="JSON record (default: results dir)")
    return ap


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    model = args.model
    if model is None:
        from engine.tiny import ensure_tiny_model

        model = str(ensure_tiny_model())
    device = resolve_device(args.device)
    dtype = args.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    body = {"model": model, **measure(model, device, dtype, args.prompt_len, args.seed)}
    print(
        f"model={model} dtype={body['dtype']} prompt={args.prompt_len} projections={body['projections']}"
    )
    print(f"{'layer':>6} " + " ".join(f"{s + ' scale':>14}" for s in SCALES))
    for i, errs in enumerate(zip(*(body[s]["layer_rel_err"] for s in SCALES), strict=True)):
        print(f"{i:>6} " + " ".join(f"{e:>14.4f}" for e in errs))
    for key in ("logits_rel_err", "top1_agreement", "mean_kl"):
        print(f"{key:>16} " + " ".join(f"{body[s][key]:>14.4g}" for s in SCALES))
    write_record(
        "benchmarks.fp8_accuracy",
        argv,
        body,
        args.output_file,
        f"fp8-accuracy-{Path(model).name}",
        machine(device),
    )
    return body


if __name__ == "__main__":
    main()
