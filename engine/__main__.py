"""``python -m engine``: generate offline with the engine (no server)."""

from __future__ import annotations

import argparse
import time

from engine.llm import LLM
from protocol.sampling import SamplingParams


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m engine",
        description="Run the engine offline on a prompt and print the completion.",
    )
    ap.add_argument(
        "--model",
        default=None,
        help="HF checkpoint directory (config.json, *.safetensors, tokenizer files); "
        "default: the built-in tiny model, built on first use into the user cache dir",
    )
    ap.add_argument(
        "--prompt",
        action="append",
        default=None,
        help="prompt text; repeat the flag for a batch (default: one sample prompt)",
    )
    ap.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]")
    ap.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens; -1 off")
    ap.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p * max prob")
    ap.add_argument("--seed", type=int, default=None, help="per-request seed (reproducible)")
    ap.add_argument("--ignore-eos", action="store_true", help="keep going past EOS")
    ap.add_argument(
        "--device", default="auto", help="torch device, e.g. cpu or cuda:0 (default: %(default)s)"
    )
    ap.add_argument(
        "--dtype", default="auto", help="auto (from config.json), float32, bfloat16, float16"
    )
    ap.add_argument("--page-size", type=int, default=1, help="tokens per KV page")
    ap.add_argument(
        "--kv-cache-memory-gb",
        type=float,
        default=None,
        help="memory for the paged KV pool (default: sized from the device on CUDA)",
    )
    args = ap.parse_args(argv)

    llm = LLM(
        args.model,
        device=args.device,
        dtype=args.dtype,
        page_size=args.page_size,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
    )
    prompts = args.prompt or ["The quick brown fox"]
    if args.chat:
        prompts = [
            llm.tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            )
            for p in prompts
        ]
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    for p, o in zip(prompts, outs):
        print(f"--- prompt: {p!r}")
        print(f"    output: {o.text!r}  ({len(o.token_ids)} tokens, finish={o.finish_reason})")
    total = sum(len(o.token_ids) for o in outs)
    print(f"generated {total} tokens in {dt:.2f}s")


if __name__ == "__main__":
    main()
