"""Serving speed with default flags: what a new user gets on one GPU.

Starts each deployment with nothing beyond the model on the command line,
runs ``bench_serving.py`` (random prompts, ``--ignore-eos``, all requests at
once, at each concurrency) against its gateway, and stops it::

    python benchmarks/serve_defaults.py --model llama-3.1-8b --load-format dummy \\
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
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from worker.processes import free_port, stop_processes, wait_http_ok  # noqa: E402

START_TIMEOUT_S = 600.0
WORKLOADS = ("1024:256:1:12", "1024:256:64:192", "1024:256:256:512")
"""input tokens : output tokens : concurrency : prompts (several rounds of the batch)."""


@contextlib.contextmanager
def deployment(name: str, model: list[str], logs: Path) -> Iterator[str]:
    """``model``: the flags every worker gets (the model, and any others)."""
    """Start deployment ``name``; yields the gateway's base URL."""
    env = {**os.environ, "DISAGG_CLUSTER_TOKEN": secrets.token_hex(16)}
    procs: list[subprocess.Popen[bytes]] = []

    def start(tag: str, args: list[str], health: str) -> None:
        log = open(logs / f"{name}-{tag}.log", "wb")  # noqa: SIM115 (closed with the process)
        proc = subprocess.Popen(
            [sys.executable, "-m", *args], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO
        )
        procs.append(proc)
        try:
            wait_http_ok(proc, health, START_TIMEOUT_S, f"{name}/{tag}")
        except RuntimeError:
            print((logs / f"{name}-{tag}.log").read_text()[-4000:], file=sys.stderr)
            raise

    gw_port = free_port()
    gateway = f"http://127.0.0.1:{gw_port}"
    try:
        if name == "embedded":
            start("gateway", ["gateway", "--port", str(gw_port), *model], f"{gateway}/v1/models")
        else:
            routes: list[str] = []
            roles = [("both", "decode_server", "--decode")]
            if name == "pair":
                share = ["--gpu-memory-utilization", "0.45"]
                roles = [
                    ("prefill", "prefill_server", "--prefill"),
                    ("decode", "decode_server", "--decode"),
                ]
            else:
                share = []
            for role, module, flag in roles:
                port = free_port()
                args = [module, "--role", role, "--port", str(port), *model, *share]
                start(role, args, f"http://127.0.0.1:{port}/health")
                routes += [flag, f"http://127.0.0.1:{port}"]
            start("gateway", ["gateway", "--port", str(gw_port), *routes], f"{gateway}/v1/models")
        yield gateway
    finally:
        stop_processes(procs[::-1], 30.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
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
                        sys.executable, str(REPO / "benchmarks" / "bench_serving.py"),
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
        except RuntimeError as e:
            print(f"{name}: {e}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
