"""``python -m engine``: generate offline with the engine (no server)."""

from __future__ import annotations

import argparse
import time

from engine.config import EngineConfig
from engine.llm import LLM
from protocol import settings
from protocol.sampling import SamplingParams

ENGINE_FLAGS = settings.flags(EngineConfig)
"""The engine's own settings, one flag each, as the workers offer them."""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m engine",
        description="Run the engine offline on a prompt and print the completion.",
    )
    ap.add_argument(
        "--prompt",
        action="append",
        default=None,
        help="prompt text; repeat the flag for a batch (default: one sample prompt)",
    )
    ap.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=32,
        help="tokens to generate per prompt (default: %(default)s)",
    )
    ap.add_argument(
        "--temperature", type=float, default=0.0, help="0 means greedy (default: %(default)s)"
    )
    ap.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus sampling mass in (0, 1] (default: %(default)s)",
    )
    ap.add_argument(
        "--top-k",
        type=int,
        default=-1,
        help="keep the k most likely tokens; -1 off (default: %(default)s)",
    )
    ap.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="drop tokens below min_p * max prob (default: %(default)s)",
    )
    ap.add_argument(
        "--request-seed",
        type=int,
        default=None,
        help="per-request seed (reproducible) (default: %(default)s)",
    )
    ap.add_argument("--ignore-eos", action="store_true", help="keep going past EOS")
    settings.add_flags(ap, ENGINE_FLAGS)
    args = ap.parse_args(argv)

    engine_settings = settings.values(args, ENGINE_FLAGS)
    llm = LLM(engine_settings.pop("model"), **engine_settings)
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
        seed=args.request_seed,
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
