"""Serving speed with default flags: what a new user gets on one GPU.

Starts each deployment with nothing beyond the model on the command line,
runs ``benchmarks.bench_serving`` (random prompts, ``--ignore-eos``, all requests
at once, at each concurrency) against its gateway, and stops it::

    python -m benchmarks.serve_defaults --model llama-3.1-8b --load-format dummy \\
        --output-file benchmarks/results/serving-defaults.jsonl

Deployments (``--deployments``):
  both      python -m decode_server --role both --model M, behind python -m gateway --decode URL
  embedded  python -m gateway --model M (its own prefill and decode workers)
  pair      a prefill and a decode worker sharing the GPU (each --gpu-memory-utilization 0.45)
            behind python -m gateway --prefill URL --decode URL
"""

from __future__ import annotations

import argparse
import contextlib
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from harness.procs import REPO, Proc, ProcError, free_port, running

START_TIMEOUT_S = 600.0
WORKLOADS = ("1024:256:1:12", "1024:256:64:192", "1024:256:256:512")
"""input tokens : output tokens : concurrency : prompts (several rounds of the batch)."""


@contextlib.contextmanager
def deployment(name: str, model: list[str], logs: Path) -> Iterator[str]:
    """Start deployment ``name``, ``model`` being the flags every worker gets
    (the model, and any others); yields the gateway's base URL."""
    env = {"DISAGG_CLUSTER_TOKEN": secrets.token_hex(16)}
    procs: list[Proc] = []

    def start(tag: str, args: list[str], port: int, health: str = "/health") -> Proc:
        cmd = [sys.executable, "-m", *args, "--port", str(port)]
        proc = Proc(f"{name}/{tag}", cmd, logs / f"{name}-{tag}.log", env, port)
        procs.insert(0, proc)  # stopped in the reverse order of starting
        proc.start().wait_http(health, START_TIMEOUT_S)
        return proc

    with running(procs):
        if name == "embedded":
            gateway = start("gateway", ["gateway", *model], free_port(), "/v1/models")
        else:
            routes: list[str] = []
            roles = [("both", "decode_server", "--decode")]
            share = []
            if name == "pair":
                share = ["--gpu-memory-utilization", "0.45"]
                roles = [
                    ("prefill", "prefill_server", "--prefill"),
                    ("decode", "decode_server", "--decode"),
                ]
            for role, module, flag in roles:
                worker = start(role, [module, "--role", role, *model, *share], free_port())
                routes += [flag, worker.url]
            gateway = start("gateway", ["gateway", *routes], free_port(), "/v1/models")
        yield gateway.url


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.serve_defaults",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--deployments", nargs="+", default=["both", "embedded", "pair"])
    ap.add_argument(
        "--workload",
        nargs="+",
        default=list(WORKLOADS),
        metavar="IN:OUT:C:N",
        help="input and output tokens, concurrency and prompts of each run (default: %(default)s)",
    )
    ap.add_argument(
        "--worker-args",
        default="",
        help="more flags for every worker (the embedded ones through the gateway), e.g. "
        "'--max-num-batched-tokens 4096'; recorded in the results (default: none)",
    )
    ap.add_argument("--output-file", default="serving-defaults.jsonl")
    ap.add_argument("--logs", default=".", help="folder for the processes' logs")
    args = ap.parse_args(argv)
    model = ["--model", args.model, "--load-format", args.load_format, *args.worker_args.split()]
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name in args.deployments:
        try:
            with deployment(name, model, logs) as url:
                for workload in args.workload:
                    n_in, n_out, c, n = workload.split(":")
                    label = f"{name} {args.worker_args or 'defaults'} {workload}"
                    cmd = [
                        sys.executable, "-m", "benchmarks.bench_serving",
                        "--base-url", url, "--dataset-name", "random",
                        "--random-input-len", n_in, "--random-output-len", n_out,
                        "--num-prompts", n, "--max-concurrency", c, "--request-rate", "inf",
                        "--ignore-eos", "--warmup-requests", "4", "--disable-progress",
                        "--output-file", args.output_file, "--label", label,
                        "--metadata", f"deployment={name}", f"model={args.model}",
                        f"worker_args={args.worker_args}",
                    ]  # fmt: skip
                    print(f"== {label}", flush=True)
                    failed += subprocess.run(cmd, cwd=REPO).returncode != 0
        except ProcError as e:
            print(f"{name}: {e}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
