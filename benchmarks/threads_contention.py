"""The embedded default (``python -m gateway``: one prefill and one decode
worker on the CPU) served alone and beside a busy process, with the engines'
intra-op threads at their default (``--torch-threads`` auto: half the cores
each) and at torch's own default (one per core each, forced here through
``OMP_NUM_THREADS``), measured with ``bench_serving``.

    python benchmarks/threads_contention.py --json benchmarks/results/threads-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cluster import REPO, START_TIMEOUT_S, log_tail
from benchmarks.common import git_commit, host_info
from worker.config import _usable_cores
from worker.processes import free_port, stop_processes, wait_http_ok

BUSY = "while True: pass"


def run_case(threads: str, busy: bool, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """One measurement; ``threads``: "auto" or a count forced on both engines."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if threads != "auto":
        env["OMP_NUM_THREADS"] = threads
    port = free_port()
    log = tmp / f"gateway-{threads}-{int(busy)}.log"
    cmd = [sys.executable, "-m", "gateway", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--page-size", "4", "--log-level", "warning"]
    procs: list[subprocess.Popen[bytes]] = []
    with open(log, "wb") as out:
        gw = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    procs.append(gw)
    try:
        try:
            wait_http_ok(gw, f"http://127.0.0.1:{port}/health", START_TIMEOUT_S, "gateway")
        except RuntimeError as e:
            raise RuntimeError(f"{e}\n{log_tail(log)}") from None
        if busy:
            procs.append(subprocess.Popen([sys.executable, "-c", BUSY]))
        result = tmp / f"bench-{threads}-{int(busy)}.jsonl"
        bench = [sys.executable, "benchmarks/bench_serving.py"]
        bench += ["--base-url", f"http://127.0.0.1:{port}", "--dataset-name", "random"]
        bench += ["--random-input-len", str(args.input_len)]
        bench += ["--random-output-len", str(args.output_len)]
        bench += ["--random-range-ratio", "1.0", "--random-prompt-kind", "token-ids"]
        bench += [
            "--num-prompts",
            str(args.num_prompts),
            "--max-concurrency",
            str(args.concurrency),
        ]
        bench += ["--ignore-eos", "--warmup-requests", "4", "--disable-progress"]
        bench += ["--output-file", str(result)]
        subprocess.run(bench, cwd=REPO, check=True, capture_output=True)
        m = json.loads(result.read_text().splitlines()[-1])
        metrics = m.get("metrics", m)
        return {
            "threads": threads,
            "busy_process": busy,
            "request_throughput": round(metrics["request_throughput"], 2),
            "output_throughput": round(metrics["output_throughput"], 1),
            "mean_tpot_ms": round(metrics["mean_tpot_ms"], 1),
            "mean_ttft_ms": round(metrics["mean_ttft_ms"], 1),
            "failed": metrics["failed"],
        }
    finally:
        stop_processes(list(reversed(procs)), 30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--num-prompts", type=int, default=80)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    cores = str(_usable_cores())
    tmp = Path(tempfile.mkdtemp(prefix="threads-"))
    rows = []
    for threads in ("auto", cores):
        for busy in (False, True):
            row = run_case(threads, busy, args, tmp)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.json is not None:
        record = {
            "benchmark": "threads_contention",
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "git_commit": git_commit(),
            "command": "python benchmarks/threads_contention.py "
            + " ".join(argv if argv is not None else sys.argv[1:]),
            "host": host_info(),
            "cores": int(cores),
            "workload": vars(args) | {"json": str(args.json)},
            "results": rows,
        }
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
