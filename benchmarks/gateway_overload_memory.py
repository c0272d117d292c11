r"""Gateway memory under overload: ``python -m gateway`` in front of the fake
worker of ``bench_gateway_cpu.py``, driven by ``--overload`` times as many
streaming clients as it admits.

    python benchmarks/gateway_overload_memory.py --admitted 8 --overload 10 --duration-s 20

The gateway runs with ``--max-concurrent-requests ADMITTED`` and its other
admission settings at their defaults (no queue: a request that finds no slot
gets a 429 at once). Each client streams a request to its end, or takes its
429, and sends the next one at once, so the gateway sees ``ADMITTED *
OVERLOAD`` connections all the time. The gateway's resident memory
(``VmRSS`` of ``/proc/PID/status``) is sampled every 50 ms: idle (after one
warm-up request), then under load; the peak is the largest sample, checked
against the kernel's high-water mark (``VmHWM``). Writes a JSON record under
``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_gateway_cpu import (  # noqa: E402
    RESULTS_DIR,
    FakeWorker,
    gateway_cmd,
    post_stream,
    request_body,
)
from benchmarks.common import git_commit, host_info  # noqa: E402
from worker.processes import free_port, stop_processes, wait_http_ok  # noqa: E402

TOKENS_PER_S_PER_STREAM = 100.0
"""The fake worker's speed for one stream (its step is 1 / this)."""


def memory_kib(pid: int, key: str) -> int:
    """A ``/proc/PID/status`` memory line (``VmRSS``, ``VmHWM``) in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


@dataclass
class Sampler:
    """The largest ``VmRSS`` of a process while it runs."""

    pid: int
    peak_kib: int = 0
    samples: int = 0

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.peak_kib = max(self.peak_kib, memory_kib(self.pid, "VmRSS"))
            self.samples += 1
            await asyncio.sleep(0.05)


@dataclass
class Tally:
    served: int = 0
    tokens: int = 0
    refused: int = 0
    """429s."""
    failed: int = 0
    """Any other answer, or a stream without its usage chunk."""


async def request_once(port: int, max_tokens: int, i: int, tally: Tally) -> None:
    """One streamed chat request over its own connection, read to the end."""
    path, body = request_body("chat", max_tokens, i)
    result = await post_stream(port, body, path)
    if result.head.startswith(b"HTTP/1.1 429"):
        tally.refused += 1
    elif result.head.startswith(b"HTTP/1.1 200") and result.tokens is not None:
        tally.served += 1
        tally.tokens += result.tokens
    else:
        tally.failed += 1


async def client_loop(port: int, max_tokens: int, deadline: float, tally: Tally) -> None:
    i = 0
    while time.monotonic() < deadline:
        await request_once(port, max_tokens, i, tally)
        i += 1


async def measure(args: argparse.Namespace, model_dir: Path, log_path: Path) -> dict:
    worker = FakeWorker(model_dir, 1.0 / TOKENS_PER_S_PER_STREAM)
    await worker.start()
    port = free_port()
    cmd = [*gateway_cmd(port, worker.url, None), "--max-concurrent-requests", str(args.admitted)]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[1]
        )
    try:
        await asyncio.to_thread(
            wait_http_ok, proc, f"http://127.0.0.1:{port}/health", 60.0, "gateway"
        )
        await request_once(port, 8, -1, Tally())
        await asyncio.sleep(1.0)
        idle_kib = memory_kib(proc.pid, "VmRSS")
        clients = args.admitted * args.overload
        tally = Tally()
        stop = asyncio.Event()
        sampler = Sampler(proc.pid)
        sampling = asyncio.create_task(sampler.run(stop))
        t0 = time.monotonic()
        deadline = t0 + args.duration_s
        await asyncio.gather(
            *(client_loop(port, args.max_tokens, deadline, tally) for _ in range(clients))
        )
        wall = time.monotonic() - t0
        stop.set()
        await sampling
        after_kib = memory_kib(proc.pid, "VmRSS")
        hwm_kib = memory_kib(proc.pid, "VmHWM")
    finally:
        await asyncio.to_thread(stop_processes, [proc], 30.0)
        await worker.stop()
    return {
        "admitted": args.admitted,
        "clients": clients,
        "max_tokens": args.max_tokens,
        "wall_s": round(wall, 2),
        "served": tally.served,
        "refused_429": tally.refused,
        "failed": tally.failed,
        "tokens": tally.tokens,
        "idle_rss_mib": round(idle_kib / 1024, 1),
        "peak_rss_mib": round(sampler.peak_kib / 1024, 1),
        "hwm_rss_mib": round(hwm_kib / 1024, 1),
        # The kernel's high-water mark over the whole life, start included.
        "rss_after_mib": round(after_kib / 1024, 1),
        "rss_samples": sampler.samples,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--admitted", type=int, default=8, help="--max-concurrent-requests")
    ap.add_argument("--overload", type=int, default=10, help="clients per admitted slot")
    ap.add_argument("--duration-s", type=float, default=20.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--output-file", type=Path)
    args = ap.parse_args(argv)
    from engine.tiny import ensure_tiny_model

    now = datetime.now(UTC)
    commit = git_commit()
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    log_path = RESULTS_DIR.parent / f".gateway-overload-{now:%H%M%S}.log"
    try:
        result = asyncio.run(measure(args, ensure_tiny_model(), log_path))
    finally:
        if log_path.exists():
            log_path.unlink()
    print(json.dumps(result, indent=2))
    record = {
        "benchmark": "gateway_overload_memory",
        "date": now.isoformat(timespec="seconds"),
        "command": " ".join(
            [Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]
        ),
        "git_commit": commit,
        "machine": host_info(),
        "result": result,
    }
    out = (
        args.output_file
        or RESULTS_DIR / f"gateway-overload-memory-{commit}-{now:%Y%m%d-%H%M%S}.json"
    )
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
