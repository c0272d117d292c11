"""How far bench_serving.py's TTFT and ITL are from the truth.

Starts the fake OpenAI server (``benchmarks/fake_openai_server.py``, a process
of its own) with a known time to first token and gap between tokens, runs
``bench_serving.py`` against it at each ``--concurrency`` (``--repeats`` times,
each run a fresh client process), and reports three numbers per metric:

- truth: the configured TTFT / gap;
- server: what the server actually produced (its own write times, from
  ``GET /stats``): the truth plus the server's own lateness on a busy machine;
- client: what the benchmark reported (median and mean).

client - server is the benchmark client's own overhead. The runs and a summary
(median over the repeats, with the spread) go to a JSON file in
``benchmarks/results/``. Everything after ``--`` goes to bench_serving.py::

    python benchmarks/client_overhead.py --concurrency 1 4 64 --repeats 3 --label raw
    python benchmarks/client_overhead.py --label httpx -- --http-client httpx
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import git_commit, host_info  # noqa: E402
from benchmarks.fake_openai_server import Timing, serve_in_process  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BENCH = Path(__file__).resolve().parent / "bench_serving.py"
RUN_TIMEOUT_S = 600.0


def bench_command(
    script: Path, url: str, concurrency: int, num_prompts: int, output_len: int, extra: list[str]
) -> list[str]:
    return [
        sys.executable,
        str(script),
        *("--base-url", url, "--model", "fake-model", "--num-prompts", str(num_prompts)),
        *("--max-concurrency", str(concurrency), "--request-rate", "inf"),
        *("--random-input-len", "16", "--random-output-len", str(output_len), "--ignore-eos"),
        # Warm-up opens the connections, so no timed request pays for a connect.
        *("--warmup-requests", str(concurrency), "--disable-progress"),
        *extra,
    ]


def server_stats(url: str) -> dict[str, Any]:
    """The server's own timings since the last call (the call resets them)."""
    return httpx.get(f"{url}/stats", timeout=30).json()


def one_run(url: str, cmd: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.jsonl"
        server_stats(url)  # reset
        proc = subprocess.run(
            [*cmd, "--output-file", str(out)],
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            cwd=REPO,
        )
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"{shlex.join(cmd)} failed:\n{proc.stdout[-3000:]}{proc.stderr}")
        record = json.loads(out.read_text().splitlines()[-1])
    server = server_stats(url)
    return {
        "completed": record["completed"],
        "failed": record["failed"],
        "client": {
            "median_ttft_ms": record["median_ttft_ms"],
            "mean_ttft_ms": record["mean_ttft_ms"],
            "median_itl_ms": record["median_itl_ms"],
            "mean_itl_ms": record["mean_itl_ms"],
            "p99_itl_ms": record["p99_itl_ms"],
        },
        "server": {
            "median_ttft_ms": server["ttft_ms"]["median"],
            "mean_ttft_ms": server["ttft_ms"]["mean"],
            "median_itl_ms": server["itl_ms"]["median"],
            "mean_itl_ms": server["itl_ms"]["mean"],
            "median_lateness_ms": server["lateness_ms"]["median"],
        },
        "client_processes": (record.get("client") or {}).get("processes"),
    }


def summarize(runs: list[dict[str, Any]], timing: Timing) -> dict[str, Any]:
    """Median over the repeats (and min, max) of each error, in ms."""
    truth = {"ttft": timing.ttft_s * 1e3, "itl": timing.gap_s * 1e3}
    out: dict[str, Any] = {}
    for metric in ("ttft", "itl"):
        for stat in ("median", "mean"):
            key = f"{stat}_{metric}_ms"
            client = [r["client"][key] for r in runs]
            server = [r["server"][key] for r in runs]
            vs_truth = [c - truth[metric] for c in client]
            vs_server = [c - s for c, s in zip(client, server)]
            out[key] = {
                "client": statistics.median(client),
                "server": statistics.median(server),
                "client_minus_truth": statistics.median(vs_truth),
                "client_minus_truth_range": [min(vs_truth), max(vs_truth)],
                "client_minus_server": statistics.median(vs_server),
                "client_minus_server_range": [min(vs_server), max(vs_server)],
            }
    p99 = [r["client"]["p99_itl_ms"] for r in runs]
    out["p99_itl_ms"] = {"client": statistics.median(p99), "client_range": [min(p99), max(p99)]}
    return out


def format_summary(summary: dict[int, dict[str, Any]], timing: Timing) -> str:
    head = (
        f"truth: TTFT {timing.ttft_s * 1e3:g} ms, ITL {timing.gap_s * 1e3:g} ms; "
        "client - truth (client - server) in ms, median over repeats [min, max]"
    )
    rows = [head, f"{'concurrency':>11}  {'median TTFT':>34}  {'median ITL':>34}"]
    for c, s in summary.items():
        cells = []
        for key in ("median_ttft_ms", "median_itl_ms"):
            e = s[key]
            lo, hi = e["client_minus_truth_range"]
            cells.append(
                f"{e['client_minus_truth']:+7.2f} ({e['client_minus_server']:+6.2f}) "
                f"[{lo:+.2f}, {hi:+.2f}]"
            )
        rows.append(f"{c:>11}  {cells[0]:>34}  {cells[1]:>34}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    ours, extra = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 64])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ttft-ms", type=float, default=60.0)
    ap.add_argument("--gap-ms", type=float, default=12.0)
    ap.add_argument("--output-len", type=int, default=32, help="tokens per request")
    ap.add_argument(
        "--requests-per-slot",
        type=int,
        default=4,
        help="num-prompts = this x concurrency (at least 8) (default: %(default)s)",
    )
    ap.add_argument(
        "--bench-script",
        type=Path,
        default=BENCH,
        help="the benchmark to measure, e.g. an older copy (default: %(default)s)",
    )
    ap.add_argument("--label", default="", help="stored in the record and the file name")
    ap.add_argument(
        "--output-file",
        type=Path,
        default=None,
        help="default: results/client-overhead-LABEL-DATE.json",
    )
    args = ap.parse_args(ours)
    timing = Timing(args.ttft_ms / 1e3, args.gap_ms / 1e3)
    runs: dict[int, list[dict[str, Any]]] = {}
    with serve_in_process(timing) as url:
        time.sleep(0.5)  # let the server process import and start before the first run
        for rep in range(args.repeats):
            for c in args.concurrency:
                n = max(8, args.requests_per_slot * c)
                cmd = bench_command(args.bench_script, url, c, n, args.output_len, extra)
                run = one_run(url, cmd)
                print(f"repeat {rep} concurrency {c}: {json.dumps(run)}", file=sys.stderr)
                runs.setdefault(c, []).append(run)
    summary = {c: summarize(r, timing) for c, r in runs.items()}
    record = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "label": args.label,
        "truth_ms": {"ttft": args.ttft_ms, "itl": args.gap_ms},
        "output_len": args.output_len,
        "bench_command": shlex.join(
            bench_command(args.bench_script, "URL", 0, 0, args.output_len, extra)
        ),
        "summary": {str(c): s for c, s in summary.items()},
        "runs": {str(c): r for c, r in runs.items()},
        "command": shlex.join(["client_overhead.py", *argv]),
        "git_commit": git_commit(),
        "machine": host_info(),
    }
    print(format_summary(summary, timing))
    day = datetime.now(UTC).strftime("%Y%m%d")
    path = args.output_file or RESULTS / f"client-overhead-{args.label or 'run'}-{day}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return record


if __name__ == "__main__":
    main()
