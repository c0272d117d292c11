"""Serving benchmark of any OpenAI-compatible endpoint (this gateway, vLLM, SGLang):
TTFT, ITL, TPOT, end-to-end latency, throughput and goodput.

    python -m benchmarks.bench_serving --base-url http://127.0.0.1:8000 \\
        --dataset-name random --random-input-len 1024 --random-output-len 128 \\
        --num-prompts 200 --request-rate 8 --max-concurrency 64 --ignore-eos

Flags and metric definitions follow vLLM's ``benchmark_serving`` / ``vllm bench
serve`` and SGLang's ``bench_serving``, so numbers are comparable:

- TTFT: from sending a request to its first chunk with non-empty text.
- ITL: the gaps between consecutive non-empty chunks, pooled over all requests.
- TPOT: (E2E latency - TTFT) / (output tokens - 1), per request with > 1 token.
- E2EL: from sending a request to the end of its stream.
- Throughputs divide by the duration from the first send to the last finish.
- Goodput (``--slo``): requests per second that meet every given SLO.

Token counts come from the server's final usage chunk (``stream_options:
{"include_usage": true}``). Failed requests (non-200 status, an ``error``
chunk, a broken stream, no text at all) are counted in ``failed`` and left out
of every other metric. One JSON line per run is appended to ``--output-file``.

A goodput sweep (``--sweep-request-rates 2 4 8 16`` or ``--sweep-max-concurrency
1 8 32 64``, with ``--slo``) runs the workload once per value, in increasing
order, each run as a plain one would (the same warm-up; from the second point
on, prompts of the same lengths drawn anew, so none is a prefix-cache hit). A
point holds when no request failed and the p99 of every metric in ``--slo`` is
within its objective; the sweep stops after the first point that does not
(``--sweep-all`` runs them all). ``--sweep-refine N`` then bisects up to N
times between the highest value that held and the first that broke, so a
coarse grid ends in a close bracket. It prints a row per point, the highest value
that held (its output tok/s and goodput) and the first that broke (and why);
the JSON line holds every point's metrics under ``"sweep"``.

The client must not add latency of its own: a chunk's time is when its bytes
arrived, read in the socket's callback by a lean HTTP/1.1 client
(``harness/http_stream.py``; ``--http-client httpx`` for the general one);
SSE and JSON are parsed after the run; request bodies are encoded before it;
``--num-client-processes`` spreads very many streams over several event loops.
The load generator is ``harness/loadgen.py``; ``tests/test_bench_serving.py``
checks what the client adds against a fake server of known timing
(``harness/fake_openai_server.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from benchmarks.common import RESULTS_DIR, command
from harness.host import git_commit, host_info
from harness.loadgen import (
    CONCURRENCY_PER_PROCESS,
    ENDPOINTS,
    HTTP_CLIENTS,
    SWEEP_NAMES,
    BenchConfig,
    RequestOutcome,
    RequestSpec,
    add_workload_args,
    json_rate,
    measure,
    parse_slo,
    prompt_kind,
    run_sweep,
    sample_requests,
)

DEFAULT_OUTPUT = RESULTS_DIR / "serving.jsonl"
BACKEND_ALIASES = {"openai": "openai-completions"}
SWEEP_FLAGS = {
    "request_rate": "--sweep-request-rates",
    "max_concurrency": "--sweep-max-concurrency",
}


def workload_info(args: argparse.Namespace, requests: Sequence[RequestSpec]) -> dict[str, Any]:
    """The dataset and its parameters, for the JSON record."""
    info: dict[str, Any] = {"dataset_name": args.dataset_name}
    if args.dataset_name == "sharegpt":
        info |= {"dataset_path": args.dataset_path, "sharegpt_output_len": args.sharegpt_output_len}
    else:
        kind = prompt_kind(args, args.backend == "openai-chat")
        info["prompt_kind"] = kind
        if kind == "token-ids":
            info["vocab_size"] = args.vocab_size
        prefix = "random_" if args.dataset_name == "random" else "gsp_"
        info |= {
            k: v
            for k, v in vars(args).items()
            if k.startswith(prefix) and k != "random_prompt_kind"
        }
    info |= {
        "seed": args.seed,
        "num_prompts": len(requests),
        "ignore_eos": args.ignore_eos,
        "warmup_requests": args.warmup_requests,
    }
    return info


# -- report ---------------------------------------------------------------------

TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


def format_value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def format_table(r: dict[str, Any]) -> str:
    rows: list[str] = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]

    def row(label: str, value: Any) -> None:
        rows.append(f"{label:<40}{format_value(value):>10}")

    row("Successful requests:", r["completed"])
    row("Failed requests:", r["failed"])
    row("Maximum request concurrency:", r["max_concurrency"])
    row("Request rate (req/s):", r["request_rate"])
    row("Benchmark duration (s):", r["duration"])
    row("Total input tokens:", r["total_input_tokens"])
    row("Total generated tokens:", r["total_output_tokens"])
    row("Request throughput (req/s):", r["request_throughput"])
    if r["request_goodput"] is not None:
        row("Request goodput (req/s):", r["request_goodput"])
    row("Input token throughput (tok/s):", r["input_throughput"])
    row("Output token throughput (tok/s):", r["output_throughput"])
    row("Total token throughput (tok/s):", r["total_token_throughput"])
    for name, title in TITLES.items():
        rows.append("{s:{c}^50}".format(s=title, c="-"))
        upper = name.upper()
        for stat in ("mean", "median", "std", "p90", "p95", "p99"):
            label = stat.capitalize() if stat in ("mean", "median") else stat.upper()
            row(f"{label} {upper} (ms):", r[f"{stat}_{name}_ms"])
    rows.append("=" * 50)
    return "\n".join(rows)


def format_sweep(sweep: dict[str, Any]) -> str:
    """One row per point, then the highest point that held and the first that broke."""
    over, slo, summary = sweep["over"], sweep["slo_ms"], sweep["summary"]
    name = SWEEP_NAMES[over]
    objectives = ", ".join(f"{k} <= {v:g}" for k, v in slo.items())
    cols = ["ok", "failed", "req/s", "out tok/s", "goodput", *(f"p99 {k}" for k in slo)]
    head = f"{name:>16}" + "".join(f"{c:>10}" for c in cols) + "  verdict"
    width = len(head) + 10  # room for the verdicts
    rows = [
        "{s:{c}^{w}}".format(s=" Goodput Sweep ", c="=", w=width),
        f"Objectives (p99, ms): {objectives}",
        head,
    ]
    for p in sweep["points"]:
        keys = ["completed", "failed", "request_throughput", "output_throughput"]
        keys += ["request_goodput", *(f"p99_{k}_ms" for k in slo)]
        verdict = "holds" if p["holds"] else f"breaks: {', '.join(p['broken'])}"
        cells = "".join(f"{format_value(p[k]):>10}" for k in keys)
        rows.append(f"{format_value(p[over]):>16}{cells}  {verdict}")
    rows.append("-" * width)
    if best := summary["highest_holding"]:
        rows.append(
            f"Highest {name} that held: {format_value(best['value'])} (output "
            f"{best['output_throughput']:.2f} tok/s, goodput {best['request_goodput']:.2f} req/s)"
        )
    else:
        rows.append(f"Highest {name} that held: none")
    first = summary["first_broken"]
    broke = f"{format_value(first['value'])} ({first['reason']})" if first else "none"
    rows.append(f"First {name} that broke: {broke}")
    rows.append("=" * width)
    return "\n".join(rows)


def machine_info() -> dict[str, Any]:
    info = host_info()
    # nvidia-smi rather than torch: the benchmark client must stay light.
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        lines = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.splitlines()
        info["gpus"] = [ln.split(" (UUID")[0].split(": ", 1)[-1] for ln in lines if ln.strip()]
    return info


def require_matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plot(outcomes: Sequence[RequestOutcome], path: str | Path, title: str) -> None:
    """Two histograms: TTFT and ITL of the successful requests, in ms."""
    plt = require_matplotlib()
    ok = [o for o in outcomes if o.success]
    data = {
        "TTFT (ms)": [o.ttft * 1e3 for o in ok],
        "ITL (ms)": [g * 1e3 for o in ok for g in o.itl],
    }
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (label, values) in zip(axes, data.items()):
        ax.hist(values, bins=50)
        ax.set_xlabel(label)
        ax.set_ylabel("count")
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- command line ---------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_serving",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ep = ap.add_argument_group("endpoint")
    ep.add_argument(
        "--base-url",
        default=None,
        help="server root, e.g. http://127.0.0.1:8000 (default: http://HOST:PORT)",
    )
    ep.add_argument(
        "--host", default="127.0.0.1", help="server host without --base-url (default: %(default)s)"
    )
    ep.add_argument(
        "--port",
        type=int,
        default=8000,
        help="server port without --base-url (default: %(default)s)",
    )
    ep.add_argument(
        "--backend",
        choices=[*ENDPOINTS, *BACKEND_ALIASES],
        default="openai-completions",
        help="API to call: openai-completions (/v1/completions; 'openai' is an alias) or "
        "openai-chat (/v1/chat/completions) (default: %(default)s)",
    )
    ep.add_argument("--endpoint", default=None, help="API path override (default: the backend's)")
    ep.add_argument(
        "--model", default=None, help="model name sent (default: the first id of GET /v1/models)"
    )
    ep.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="bearer token (default: $OPENAI_API_KEY, else none)",
    )
    ep.add_argument(
        "--http-client",
        choices=HTTP_CLIENTS,
        default="raw",
        help="raw: a lean HTTP/1.1 client on asyncio (harness/http_stream.py) that notes "
        "each chunk's arrival before any parsing, http:// only (https:// falls back to httpx); "
        "httpx: the general client (default: %(default)s)",
    )
    ep.add_argument(
        "--num-client-processes",
        type=int,
        default=None,
        help="client processes that split the requests (each sends every N-th request at its "
        "time, under 1/N of --max-concurrency), so that one event loop's work does not delay "
        f"the chunks it times (default: 1 up to {CONCURRENCY_PER_PROCESS} concurrent requests, "
        f"one more per {CONCURRENCY_PER_PROCESS} above, at most half the cores)",
    )
    ep.add_argument(
        "--request-timeout-s",
        type=float,
        default=3600.0,
        help="fail a request when connecting or any read of its stream takes longer (default: %(default)s)",
    )

    add_workload_args(ap.add_argument_group("workload"))

    ld = ap.add_argument_group("load")
    ld.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second, Poisson arrivals (exponential gaps of mean 1/RATE); inf "
        "sends all at once (default: %(default)s)",
    )
    ld.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma-distributed gaps of shape BURSTINESS and mean 1/RATE: 1.0 is Poisson, "
        "< 1 burstier, > 1 more uniform (default: %(default)s)",
    )
    ld.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="at most this many requests in flight; later arrivals wait (default: no limit)",
    )
    ld.add_argument(
        "--warmup-requests",
        type=int,
        default=0,
        help="requests sent (and awaited) before timing starts, not counted (default: %(default)s)",
    )
    ld.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos: true (an extension of vLLM, SGLang and this gateway) so every "
        "request generates max_tokens tokens",
    )
    ld.add_argument(
        "--slo",
        type=parse_slo,
        default=None,
        metavar="NAME=MS,...",
        help="service-level objectives for goodput, e.g. ttft=500,tpot=50 (also e2el=MS): "
        "request_goodput counts requests per second meeting all of them",
    )

    sw = ap.add_argument_group(
        "goodput sweep",
        "one run per value, in increasing order, each as a plain run (later points: prompts "
        "of the same lengths drawn anew); a point holds when no request failed and the p99 of "
        "every metric in --slo is within its objective",
    )
    swept = sw.add_mutually_exclusive_group()
    swept.add_argument(
        "--sweep-request-rates",
        type=float,
        nargs="+",
        default=None,
        metavar="RATE",
        help="one run per request rate, in place of --request-rate; needs --slo",
    )
    swept.add_argument(
        "--sweep-max-concurrency",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="one run per concurrency limit, in place of --max-concurrency; needs --slo",
    )
    sw.add_argument(
        "--sweep-all",
        action="store_true",
        help="run every point (default: stop after the first that does not hold)",
    )
    sw.add_argument(
        "--sweep-refine",
        type=int,
        default=0,
        metavar="N",
        help="then up to N more points, each halfway between the highest value that held "
        "and the first that broke (default: %(default)s)",
    )

    out = ap.add_argument_group("output")
    out.add_argument(
        "--output-file",
        default=str(DEFAULT_OUTPUT),
        help="append one JSON line here (default: %(default)s)",
    )
    out.add_argument("--no-output", action="store_true", help="do not write the JSON line")
    out.add_argument("--label", default=None, help="free text stored in the JSON record")
    out.add_argument(
        "--metadata",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="facts about the deployment under test (e.g. tp=1 device=cuda:0), stored under "
        '"metadata" in the JSON record',
    )
    out.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="write TTFT and ITL histograms (needs matplotlib)",
    )
    out.add_argument(
        "--disable-progress", action="store_true", help="no progress counter on stderr"
    )
    return ap


def command_line(argv: Sequence[str]) -> str:
    """The command that runs this benchmark with ``argv``, the --api-key value masked."""
    words = list(argv)
    for i, word in enumerate(words):
        if word == "--api-key" and i + 1 < len(words):
            words[i + 1] = "REDACTED"
        elif word.startswith("--api-key="):
            words[i] = "--api-key=REDACTED"
    return command("benchmarks.bench_serving", words)


def fetch_model(base_url: str, api_key: str | None) -> tuple[str, int | None]:
    """The first served model's id and max_model_len (GET /v1/models)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    resp = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30)
    resp.raise_for_status()
    models = resp.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model")
    return models[0]["id"], models[0].get("max_model_len")


def sweep_of(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[str, list] | None:
    """The swept setting (a ``BenchConfig`` field) and its values; None
    without a sweep flag. Exits through ``parser.error`` on bad use."""
    given = {
        "request_rate": args.sweep_request_rates,
        "max_concurrency": args.sweep_max_concurrency,
    }
    over = next((name for name, values in given.items() if values), None)
    if over is None:
        for flag, given_too in (
            ("--sweep-all", args.sweep_all),
            ("--sweep-refine", args.sweep_refine),
        ):
            if given_too:
                parser.error(f"{flag} needs {' or '.join(SWEEP_FLAGS.values())}")
        return None
    flag, values = SWEEP_FLAGS[over], given[over]
    if min(values) <= 0:
        parser.error(f"{flag} values must be > 0")
    if args.sweep_refine < 0:
        parser.error("--sweep-refine must be >= 0")
    if not args.slo:
        parser.error(
            f"{flag} needs --slo (e.g. --slo ttft=500,tpot=30): its objectives decide "
            "which points hold"
        )
    if args.plot:
        parser.error(f"--plot draws one run's distributions, not {flag}'s")
    return over, values


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run one benchmark, or a goodput sweep; return the JSON record (also
    printed and appended)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    sweep = sweep_of(parser, args)
    args.backend = BACKEND_ALIASES.get(args.backend, args.backend)
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/").removesuffix("/v1")
    if args.plot:
        require_matplotlib()  # fail before the run, not after it
    if any("=" not in item for item in args.metadata):
        parser.error("--metadata takes KEY=VALUE pairs")
    metadata = dict(item.split("=", 1) for item in args.metadata)
    if args.request_rate <= 0 or args.burstiness <= 0:
        parser.error("--request-rate and --burstiness must be > 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error("--max-concurrency must be >= 1")
    if args.num_client_processes is not None and args.num_client_processes < 1:
        parser.error("--num-client-processes must be >= 1")
    if args.http_client == "raw" and base_url.startswith("https://"):
        print("note: the raw HTTP client has no TLS; using httpx for https://", file=sys.stderr)
        args.http_client = "httpx"
    elif urlsplit(base_url).scheme not in ("http", "https"):
        parser.error(f"--base-url must be http:// or https://, got {base_url}")
    try:
        requests = sample_requests(args, chat=args.backend == "openai-chat")
    except (OSError, ValueError) as e:
        parser.error(str(e))
    if not requests:
        parser.error("the workload is empty")
    try:
        model, max_len = fetch_model(base_url, args.api_key)
    except (httpx.HTTPError, ValueError, KeyError) as e:
        if args.model is None:
            parser.error(f"cannot list models at {base_url} (give --model): {e}")
        max_len = None
    model = args.model or model
    longest = max(r.prompt_len + r.output_len for r in requests)
    if max_len and longest > max_len:
        print(
            f"warning: requests of up to {longest} tokens, max_model_len {max_len}", file=sys.stderr
        )

    config = BenchConfig(
        base_url=base_url,
        model=model,
        requests=requests,
        backend=args.backend,
        endpoint=args.endpoint,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        ignore_eos=args.ignore_eos,
        api_key=args.api_key,
        request_timeout_s=args.request_timeout_s,
        warmup_requests=args.warmup_requests,
        seed=args.seed,
        show_progress=not args.disable_progress,
        http_client=args.http_client,
    )
    load = {"request_rate": f"rate {args.request_rate}"}
    load["max_concurrency"] = f"max concurrency {args.max_concurrency}"
    if sweep:
        over, values = sweep
        load[over] = f"{SWEEP_NAMES[over]} swept"
    print(
        f"{len(requests)} requests to {config.url} (model {model}), {', '.join(load.values())}, "
        f"{args.http_client} client",
        file=sys.stderr,
    )
    result = None
    if sweep:
        sweep_record = run_sweep(
            config,
            over,
            values,
            args.slo,
            args.sweep_all,
            args.num_client_processes,
            refine=args.sweep_refine,
        )
        measured = {"sweep": sweep_record}
    else:
        result, measured = measure(config, args.slo, args.num_client_processes)
    record: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "label": args.label,
        "metadata": metadata,
        "backend": args.backend,
        "base_url": base_url,
        "endpoint": config.url.removeprefix(base_url),
        "model": model,
        "request_rate": json_rate(args.request_rate),
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "workload": workload_info(args, requests),
        **measured,
        "command": command_line(sys.argv[1:] if argv is None else argv),
        "git_commit": git_commit(),
        "machine": machine_info(),
    }
    if sweep:
        record[over] = sweep_record["values"]  # those asked for; "sweep" holds those run
        print(format_sweep(sweep_record))
    else:
        print(format_table(record))
        if record["errors"]:
            print(f"errors: {record['errors']}", file=sys.stderr)
    if not args.no_output:
        path = Path(args.output_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"appended to {path}", file=sys.stderr)
    if args.plot and result:
        write_plot(result.outcomes, args.plot, f"{model} {args.label or ''}".strip())
    return record


def completed_any(record: dict[str, Any]) -> bool:
    """Whether any request of the run (of any point of a sweep) completed."""
    runs = record["sweep"]["points"] if "sweep" in record else [record]
    return any(r["completed"] for r in runs)


if __name__ == "__main__":
    sys.exit(0 if completed_any(main()) else 1)
