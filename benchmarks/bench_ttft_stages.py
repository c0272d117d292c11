"""Where the time to first token goes, stage by stage, at concurrency 1.

    python -m gateway &      # or any gateway in front of workers
    python -m benchmarks.bench_ttft_stages --base-url http://127.0.0.1:8000 \
        --lengths 16 1024 4096 --cached-prefix 4096 --cached-new 128 --requests 8

or, starting the deployments itself (one after the other, each stopped before
the next starts; here a colocated ``--role both`` worker, then a prefill and a
decode worker sharing one GPU over NIXL, each behind its own gateway)::

    python -m benchmarks.bench_ttft_stages --deploy colocated disagg \
        --dummy-preset llama-3.1-8b --device cuda:0 --transfer-backend nixl \
        --kv-cache-memory-gb 16 --lengths 16 1024 4096 --cached-prefix 4096 \
        --cached-new 128 --requests 8

For each case (a prompt of N random token ids; a cached prefix of P tokens
followed by M new ones) the script sends ``--requests`` streamed completions
one after another and reports the client's TTFT (request written to the first
chunk with text, read by a lean client that timestamps bytes as they arrive)
next to the mean of every stage the gateway measured for those requests
(``gateway_stage_seconds``) and of every stage the workers reported
(``gateway_worker_stage_seconds``), read as differences of the gateway's
``/metrics`` before and after the case. Cases longer than the model's context
are skipped. Writes one JSON record (every deployment's rows) to
``--output-file``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

import httpx

from benchmarks import compare_pd
from benchmarks.bench_serving import fetch_model
from benchmarks.common import RESULTS_DIR, command
from harness.host import git_commit, host_info
from harness.http_stream import StreamClient, sse_lines
from harness.stages import stage_means_ms, stage_totals


class Case(NamedTuple):
    name: str
    prefix_len: int
    """Tokens shared by every request of the case (sent once first, to be cached)."""
    new_len: int
    """Tokens of each request after the prefix (fresh every request)."""


def random_ids(n: int, rng: random.Random, low: int, high: int) -> list[int]:
    return [rng.randrange(low, high) for _ in range(n)]


async def timed_request(client: StreamClient, body: dict[str, Any]) -> float:
    """Seconds from writing the request to the first chunk that carries text."""
    request = client.request_bytes("/v1/completions", json.dumps(body).encode())
    t0 = time.perf_counter()
    resp = await client.post(request)
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.body[:300]!r}")
    for t, line in sse_lines(resp):
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise RuntimeError(f"stream error: {chunk['error']}")
        if any(c.get("text") for c in chunk.get("choices", [])):
            return t - t0
    raise RuntimeError("the stream carried no text")


async def run_case(
    args: argparse.Namespace, base_url: str, model: str, case: Case, rng: random.Random
) -> dict[str, Any]:
    client = StreamClient(base_url, timeout_s=args.timeout_s)
    prefix = random_ids(case.prefix_len, rng, args.min_token_id, args.max_token_id)

    def body(ids: list[int]) -> dict[str, Any]:
        return {
            "model": model,
            "prompt": ids,
            "max_tokens": args.max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
        }

    # Warm-up (and, with a prefix, what puts the prefix into the cache).
    fresh = random_ids(case.new_len, rng, args.min_token_id, args.max_token_id)
    await timed_request(client, body(prefix + fresh))
    async with httpx.AsyncClient(timeout=30) as http:
        before = stage_totals((await http.get(f"{base_url}/metrics")).text)
        ttfts = []
        for _ in range(args.requests):
            fresh = random_ids(case.new_len, rng, args.min_token_id, args.max_token_id)
            ttfts.append(await timed_request(client, body(prefix + fresh)) * 1e3)
            await asyncio.sleep(args.gap_s)
        after = stage_totals((await http.get(f"{base_url}/metrics")).text)
    await client.aclose()
    return {
        "case": case.name,
        "prefix_len": case.prefix_len,
        "new_len": case.new_len,
        "requests": args.requests,
        "ttft_ms_median": statistics.median(ttfts),
        "ttft_ms_min": min(ttfts),
        "ttft_ms_max": max(ttfts),
        "stage_ms_mean": stage_means_ms(before, after),
    }


def cases(args: argparse.Namespace, max_len: int | None) -> list[Case]:
    out = [Case(f"{n} tokens", 0, n) for n in args.lengths]
    if args.cached_prefix:
        out.append(
            Case(
                f"{args.cached_prefix} cached + {args.cached_new}",
                args.cached_prefix,
                args.cached_new,
            )
        )
    limit = None if max_len is None else max_len - args.max_tokens
    kept = [c for c in out if limit is None or c.prefix_len + c.new_len <= limit]
    for c in out:
        if c not in kept:
            print(f"skipping {c.name}: longer than the context ({max_len})", file=sys.stderr)
    return kept


STAGE_COLUMNS = (
    "gateway:tokenize",
    "gateway:route",
    "gateway:dispatch_to_first_token",
    "gateway:first_token_to_first_byte",
    "gateway:time_to_first_byte",
)


def print_table(rows: list[dict[str, Any]]) -> None:
    worker_keys = sorted(
        {k for r in rows for k in r["stage_ms_mean"] if not k.startswith("gateway:")}
    )
    worker_keys = [k for k in worker_keys if not k.endswith((":total",))]
    cols = [*STAGE_COLUMNS, *worker_keys]
    print(
        f"{'case':>20} {'TTFT p50':>9} " + " ".join(f"{c.split(':', 1)[1][:14]:>14}" for c in cols)
    )
    print(f"{'':>20} {'(client)':>9} " + " ".join(f"{c.split(':', 1)[0][:14]:>14}" for c in cols))
    for r in rows:
        vals = " ".join(f"{r['stage_ms_mean'].get(c, float('nan')):>14.2f}" for c in cols)
        print(f"{r['case']:>20} {r['ttft_ms_median']:>9.2f} {vals}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_ttft_stages",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--base-url", default="http://127.0.0.1:8000", help="gateway (default: %(default)s)"
    )
    ap.add_argument(
        "--lengths",
        type=int,
        nargs="*",
        default=[16, 1024, 4096],
        help="prompt lengths in tokens (default: 16 1024 4096)",
    )
    ap.add_argument(
        "--cached-prefix",
        type=int,
        default=4096,
        help="cached prefix of the last case; 0 skips it (default: %(default)s)",
    )
    ap.add_argument(
        "--cached-new",
        type=int,
        default=128,
        help="new tokens after the cached prefix (default: %(default)s)",
    )
    ap.add_argument(
        "--requests", type=int, default=8, help="timed requests per case (default: %(default)s)"
    )
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=2,
        help="tokens generated per request (default: %(default)s)",
    )
    ap.add_argument(
        "--gap-s", type=float, default=0.05, help="pause between requests (default: %(default)s)"
    )
    ap.add_argument(
        "--min-token-id",
        type=int,
        default=3,
        help="smallest random prompt token id (default: %(default)s)",
    )
    ap.add_argument(
        "--max-token-id",
        type=int,
        default=500,
        help="one past the largest (default: %(default)s; within every model's vocabulary here)",
    )
    ap.add_argument(
        "--seed", type=int, default=0, help="seed of the random prompts (default: %(default)s)"
    )
    ap.add_argument(
        "--timeout-s", type=float, default=120.0, help="per request (default: %(default)s)"
    )
    ap.add_argument("--label", default="", help="free text stored in the record")
    ap.add_argument(
        "--output-file",
        default=None,
        help="JSON record (default: benchmarks/results/ttft-stages-<date>.json)",
    )
    d = ap.add_argument_group(
        "deployments started by the script (with --deploy; --base-url is then ignored)"
    )
    d.add_argument(
        "--deploy",
        nargs="+",
        choices=DEPLOYMENTS,
        default=[],
        help="start these deployments one after the other and measure each: colocated (one "
        "--role both worker) and/or disagg (a prefill and a decode worker, both on --device) "
        "(default: none, measure the gateway at --base-url)",
    )
    compare_pd.add_deployment_flags(d, "each gateway")
    d.add_argument(
        "--device",
        default="auto",
        help="device of every worker, e.g. cuda:0 or cpu (default: %(default)s)",
    )
    return ap


async def amain(args: argparse.Namespace, base_url: str) -> list[dict[str, Any]]:
    model, max_len = fetch_model(base_url, None)
    rng = random.Random(args.seed)
    rows = []
    for case in cases(args, max_len):
        rows.append(await run_case(args, base_url, model, case, rng))
    return rows


DEPLOYMENTS = ("colocated", "disagg")
_COMPARE_LABELS = {"colocated": "colocated", "disagg": "pd"}
"""Our deployment names -> benchmarks.compare_pd's labels."""


@contextlib.contextmanager
def started(args: argparse.Namespace) -> Iterator[tuple[str | None, Path]]:
    """The model directory the workers serve (a dummy one with --dummy-preset) and
    the log folder; temporary ones are removed on exit."""
    with tempfile.TemporaryDirectory(prefix="ttft_stages-") as tmp:
        log_dir = Path(args.log_dir or tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        model = args.model
        if args.dummy_preset:
            from engine.dummy_model import write_dummy_model

            name = Path(args.dummy_preset).stem
            model = str(write_dummy_model(args.dummy_preset, Path(tmp) / name))
        yield model, log_dir


@contextlib.contextmanager
def deployment(
    name: str, args: argparse.Namespace, model: str | None, log_dir: Path
) -> Iterator[str]:
    """Start deployment ``name`` (compare_pd's processes: workers, then their gateway),
    yield the gateway URL, always stop them."""
    spec = argparse.Namespace(
        prefill_device=args.device,
        decode_device=args.device,
        colocated_device=[args.device],
        load_format="dummy" if args.dummy_preset else "auto",
        page_size=args.page_size,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        transfer_backend=args.transfer_backend,
        worker_args=args.worker_args,
        gateway_args=args.gateway_args,
        start_timeout_s=args.start_timeout_s,
    )
    with compare_pd.deployment(_COMPARE_LABELS[name], spec, model, log_dir) as url:
        yield url


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every row of every deployment (``row["deployment"]``: its name, or "external")."""
    if not args.deploy:
        rows = asyncio.run(amain(args, args.base_url))
        print_table(rows)
        return [{"deployment": "external", **r} for r in rows]

    old_handler = signal.signal(signal.SIGTERM, compare_pd._interrupt)
    out: list[dict[str, Any]] = []
    try:
        with started(args) as (model, log_dir):
            for name in args.deploy:
                print(f"== {name} ==", file=sys.stderr)
                with deployment(name, args, model, log_dir) as url:
                    rows = asyncio.run(amain(args, url))
                print(f"\n{name}:")
                print_table(rows)
                out += [{"deployment": name, **r} for r in rows]
    finally:
        signal.signal(signal.SIGTERM, old_handler)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    args.base_url = args.base_url.rstrip("/")
    rows = measure(args)
    now = datetime.now(UTC)
    record = {
        "benchmark": "ttft_stages",
        "date": now.isoformat(timespec="seconds"),
        "label": args.label,
        "command": command("benchmarks.bench_ttft_stages", argv),
        "git_commit": git_commit(),
        "machine": host_info(),
        "results": rows,
    }
    out = Path(args.output_file or RESULTS_DIR / f"ttft-stages-{now:%Y%m%d-%H%M%S}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")
    return record


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit("interrupted; every started process was stopped")
