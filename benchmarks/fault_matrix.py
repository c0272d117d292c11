"""Fault matrix: a real cluster under steady streaming load, dealt one fault
after another, with every greedy output checked against the offline engine.

    python -m benchmarks.fault_matrix                    # 2 prefill + 2 decode, tcp
    python -m benchmarks.fault_matrix --transfer-backend nixl   (or nccl)
    python -m benchmarks.fault_matrix --short            # the test suite's few scenarios

It starts N prefill and M decode workers (the built-in tiny model on the CPU,
or ``--model``) and a gateway, computes the greedy completions of a fixed set
of token-id prompts with ``engine.llm.LLM``, and runs ``--clients`` streaming
clients (``/v1/completions``, ``return_token_ids``) through each scenario
(``harness/fault_matrix.py`` has the list, the cluster and the checks).

Per scenario it prints: requests; ok (output equal to the offline engine's);
wrong (any token that differs, even in a stream that then failed); failed
(ended with an error that says why: an error event or a 4xx/429); 429; hung
(no end within 30 s); leaked (KV pages short of each worker's starting pool,
plus requests left in a worker or the gateway, after the load stops); 5xx (an
HTTP status >= 500, or a stream ended by an internal error, on a valid
request); failover_s (from the fault to the first token of the first request
sent after it that completed: served by another worker); recovery_s (from the
restarted, resumed or re-added worker answering /health to its first
transferred request); share_after (that worker's share of its role's transfers
in the after-phase that follows: about 1/N for N workers of the role). A "!"
marks a time over its bound. It exits non-zero on any wrong, hung, leaked or
5xx (and on a malformed request that got no 4xx, a 429 without Retry-After, or
a scenario where nothing completed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.common import command
from harness.fault_matrix import (
    ALL_SCENARIOS,
    LIMITS,
    SHORT_SCENARIOS,
    MatrixConfig,
    Result,
    run_matrix,
    short_config,
)
from harness.host import git_commit, host_info
from kvtransfer import TRANSFER_BACKENDS

COLUMNS = (
    ("scenario", 14),
    ("requests", 8),
    ("ok", 5),
    ("wrong", 5),
    ("failed", 6),
    ("429", 5),
    ("hung", 4),
    ("leaked", 6),
    ("5xx", 4),
    ("failover_s", 10),
    ("recovery_s", 10),
    ("share_after", 11),
)


def _cell(r: Result, name: str) -> str:
    value: Any = {
        "failed": r.failed,
        "429": r.rejected,
        "leaked": r.leaked_pages + r.stuck,
        "5xx": r.server_errors,
    }.get(name, getattr(r, name, None))
    if name == "share_after":
        return "-" if value is None else f"{value:.2f}"
    if name in ("failover_s", "recovery_s"):
        if value is None:
            return "-"
        kind = r.scenario.split("-")[0]
        limit = LIMITS["recovery"] if name == "recovery_s" else LIMITS.get(kind)
        return f"{value:.2f}" + ("!" if limit is not None and value > limit else "")
    return str(value)


def table(results: list[Result]) -> str:
    head = " ".join(n.rjust(w) if i else n.ljust(w) for i, (n, w) in enumerate(COLUMNS))
    lines = [head, "-" * len(head)]
    for r in results:
        if "tcp only" in r.notes:
            lines.append(f"{r.scenario.ljust(COLUMNS[0][1])} (skipped: the hook is tcp only)")
            continue
        cells = [_cell(r, n) for n, _ in COLUMNS]
        lines.append(
            " ".join(
                c.rjust(w) if i else c.ljust(w) for i, (c, (_, w)) in enumerate(zip(cells, COLUMNS))
            )
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> tuple[MatrixConfig, argparse.Namespace]:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.fault_matrix",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--prefill", type=int, default=None, help="prefill workers (default 2; short: 1)"
    )
    ap.add_argument("--decode", type=int, default=2, help="decode workers (default %(default)s)")
    ap.add_argument(
        "--gateways",
        type=int,
        default=1,
        help="gateway replicas, the clients spread over them; kill-gateway needs 2 "
        "(default %(default)s)",
    )
    ap.add_argument("--transfer-backend", default="tcp", choices=sorted(TRANSFER_BACKENDS))
    ap.add_argument(
        "--model", default=None, help="checkpoint dir (default: the built-in tiny model)"
    )
    ap.add_argument(
        "--clients", type=int, default=None, help="streaming clients (default 6; short: 4)"
    )
    ap.add_argument(
        "--scenarios", default=None, help=f"comma-separated, from: {', '.join(ALL_SCENARIOS)}"
    )
    ap.add_argument(
        "--short", action="store_true", help=f"{', '.join(SHORT_SCENARIOS)}, shorter phases"
    )
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per engine process")
    ap.add_argument(
        "--log-dir", type=Path, default=None, help="worker and gateway logs (default: a temp dir)"
    )
    ap.add_argument(
        "--json", type=Path, default=None, help="write the results (and the run's facts) here"
    )
    ns = ap.parse_args(argv)
    scenarios = SHORT_SCENARIOS if ns.short else ALL_SCENARIOS
    if ns.scenarios:
        scenarios = tuple(s.strip() for s in ns.scenarios.split(",") if s.strip())
        unknown = [s for s in scenarios if s not in ALL_SCENARIOS]
        if unknown:
            ap.error(f"unknown scenarios: {', '.join(unknown)}")
    given = {"prefill": ns.prefill, "clients": ns.clients}
    cfg = replace(
        short_config() if ns.short else MatrixConfig(),
        **{k: v for k, v in given.items() if v is not None},
        decode=ns.decode,
        gateways=ns.gateways,
        backend=ns.transfer_backend,
        model=ns.model,
        scenarios=scenarios,
        threads=ns.threads,
        log_dir=ns.log_dir,
    )
    if any(s.endswith("-prefill") for s in scenarios) and cfg.prefill < 2:
        ap.error("the prefill scenarios need --prefill 2 or more (a worker to fail over to)")
    if any(s.endswith("-decode") or s == "admin-readd" for s in scenarios) and cfg.decode < 2:
        ap.error("the decode scenarios need --decode 2 or more (a worker to fail over to)")
    return cfg, ns


def main(argv: list[str] | None = None) -> int:
    cfg, ns = parse_args(argv)
    t0 = time.monotonic()
    print(
        f"fault matrix: {cfg.prefill} prefill + {cfg.decode} decode workers, {cfg.backend}, "
        f"{cfg.clients} clients; scenarios: {', '.join(cfg.scenarios)}",
        flush=True,
    )

    def show(r: Result) -> None:
        print(table([r]).splitlines()[-1], flush=True)
        for note in r.notes:
            print(f"    note: {note}", flush=True)
        for ex in r.examples:
            print(f"    {ex}", flush=True)

    print(table([]), flush=True)
    results = asyncio.run(run_matrix(cfg, show))
    print()
    print(table(results))
    bad = [r.scenario for r in results if r.bad]
    elapsed = time.monotonic() - t0
    print(
        f"\n{len(results)} scenarios in {elapsed:.0f}s; "
        + (f"FAILED: {', '.join(bad)}" if bad else "all clean")
    )
    if ns.json is not None:
        record = {
            "benchmark": "fault_matrix",
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "git_commit": git_commit(),
            "command": command("benchmarks.fault_matrix", argv),
            "host": host_info(),
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
            "seconds": round(elapsed, 1),
            "results": [asdict(r) for r in results],
            "table": table(results),
        }
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        ns.json.write_text(json.dumps(record, indent=2) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
