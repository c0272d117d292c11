"""A local fleet on the CPU: prefill and decode workers of the built-in tiny
model behind one or more gateway replicas, driven by a shared-prefix workload
spread over the replicas (as a load balancer in front of them would), with
the prefix-cache hit rate read from the prefill workers' own counters.

``run_fleet`` starts a fresh fleet per call (cold caches), so that two
routings or replica counts are compared on equal terms; ``restart_reflected``
measures how long after a prefill worker restarts (cold cache) every replica's
routing view of it is its new, empty cache. Used by
``python -m benchmarks.bench_fleet`` and ``tests/test_fleet.py``. Torch-free.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from harness.cluster import Gateway, Worker
from harness.procs import running, start_all
from protocol.settings import CLUSTER_TOKEN_ENV

TOKEN = "fleet-cluster-token"


@dataclass(frozen=True)
class FleetConfig:
    gateways: int = 2
    kv_events: bool = True
    """Route by the workers' KV events (else: by each gateway's own tree)."""
    prefill: int = 2
    decode: int = 2
    groups: int = 32
    per_group: int = 8
    system_len: int = 192
    question_len: int = 16
    output_len: int = 4
    concurrency: int = 8
    page_size: int = 4
    num_pages: int = 8192
    seed: int = 0


@dataclass(frozen=True)
class FleetResult:
    config: dict[str, Any]
    requests: int
    failed: int
    hit_rate: float
    """Prefix-cache hit tokens / query tokens, summed over the prefill workers."""
    ttft_mean_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    per_worker_hit_rate: dict[str, float]
    restart_reflected_s: float | None = None


def workload(cfg: FleetConfig, vocab: int) -> list[list[int]]:
    """``groups`` system prompts, each followed by ``per_group`` questions;
    the groups interleaved at random, as traffic would be."""
    rng = random.Random(cfg.seed)
    prompts = []
    for _ in range(cfg.groups):
        system = [rng.randrange(3, vocab) for _ in range(cfg.system_len)]
        for _ in range(cfg.per_group):
            prompts.append(system + [rng.randrange(3, vocab) for _ in range(cfg.question_len)])
    rng.shuffle(prompts)
    return prompts


async def _drive(
    urls: list[str], model: str, prompts: list[list[int]], cfg: FleetConfig
) -> tuple[list[float], int]:
    """Send every prompt (request ``i`` to replica ``i % len(urls)``) at
    ``concurrency``; TTFTs of the successful ones, and the failure count."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(prompts)):
        queue.put_nowait(i)
    ttfts: list[float] = []
    failed = 0

    async def lane(client: httpx.AsyncClient) -> None:
        nonlocal failed
        while not queue.empty():
            i = queue.get_nowait()
            body = {
                "model": model,
                "prompt": prompts[i],
                "max_tokens": cfg.output_len,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            t0 = time.perf_counter()
            first = None
            try:
                url = f"{urls[i % len(urls)]}/v1/completions"
                async with client.stream("POST", url, json=body) as resp:
                    if resp.status_code != 200:
                        failed += 1
                        await resp.aread()
                        continue
                    async for line in resp.aiter_lines():
                        if first is None and line.startswith("data:") and "[DONE]" not in line:
                            first = time.perf_counter()
            except httpx.HTTPError:
                failed += 1
                continue
            if first is None:
                failed += 1
            else:
                ttfts.append(first - t0)

    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.gather(*(lane(client) for _ in range(cfg.concurrency)))
    return ttfts, failed


def _hits(worker: Worker) -> tuple[int, int]:
    s = worker.stats()
    return s["prefix_cache_hit_tokens"], s["prefix_cache_query_tokens"]


def _view(gw: Gateway, url: str) -> dict[str, Any]:
    return gw.workers()[url].get("prefix_cache", {})


def restart_reflected(worker: Worker, gateways: list[Gateway], timeout_s: float = 30.0) -> float:
    """SIGKILL ``worker``, restart it on its port (cold cache) and return the
    seconds from its ``/health`` answering again until every gateway's view of
    its cache is the new epoch's (empty). A gateway that routes by its own
    tree never sees it: only ``kv_events`` fleets are measured."""
    before = {gw.url: _view(gw, worker.url).get("epoch") for gw in gateways}
    worker.kill()
    worker.start()
    worker.wait_healthy()
    t0 = time.monotonic()
    while True:
        views = [_view(gw, worker.url) for gw in gateways]
        if all(
            v.get("source") == "kv_events"
            and v.get("epoch") not in (None, before[gw.url])
            and v.get("cached_blocks") == 0
            for gw, v in zip(gateways, views)
        ):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"the gateways' views never caught up: {views}")
        time.sleep(0.01)


def run_fleet(cfg: FleetConfig, log_dir: Path, measure_restart: bool = False) -> FleetResult:
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {CLUSTER_TOKEN_ENV: TOKEN, "OMP_NUM_THREADS": "1"}
    engine = {"page_size": cfg.page_size, "num_pages": cfg.num_pages, "context_length": 1024}
    prefill = [
        Worker.make(f"prefill{i}", "prefill", log_dir, env=env, transfer_backend="tcp", **engine)
        for i in range(cfg.prefill)
    ]
    decode = [
        Worker.make(f"decode{i}", "decode", log_dir, env=env, transfer_backend="tcp", **engine)
        for i in range(cfg.decode)
    ]
    with running([*prefill, *decode]) as procs:
        start_all(procs)
        for w in procs:
            w.wait_healthy()  # type: ignore[attr-defined]
        args = [
            "--prefill",
            *(w.url for w in prefill),
            "--decode",
            *(w.url for w in decode),
            "--kv-events" if cfg.kv_events else "--no-kv-events",
            "--log-level",
            "warning",
        ]
        gateways = [
            Gateway.make(log_dir / f"gateway{i}.log", args, env=env, admin_key=TOKEN, name=f"gw{i}")
            for i in range(cfg.gateways)
        ]
        procs.extend(gateways)
        start_all(gateways)
        info = prefill[0].start_info
        model = info["served_model_name"]
        vocab = int(info["vocab_size"])
        _wait_routable(gateways, prefill, cfg.kv_events)
        start = {w.name: _hits(w) for w in prefill}
        ttfts, failed = asyncio.run(
            _drive([g.url for g in gateways], model, workload(cfg, vocab), cfg)
        )
        per_worker: dict[str, float] = {}
        hit = query = 0
        for w in prefill:
            h, q = _hits(w)
            dh, dq = h - start[w.name][0], q - start[w.name][1]
            per_worker[w.name] = dh / dq if dq else 0.0
            hit, query = hit + dh, query + dq
        reflected = None
        if measure_restart and cfg.kv_events:
            reflected = restart_reflected(prefill[0], gateways)
    ms = sorted(t * 1e3 for t in ttfts)
    return FleetResult(
        config=asdict(cfg),
        requests=len(ttfts) + failed,
        failed=failed,
        hit_rate=hit / query if query else 0.0,
        ttft_mean_ms=statistics.fmean(ms) if ms else float("nan"),
        ttft_p50_ms=ms[len(ms) // 2] if ms else float("nan"),
        ttft_p99_ms=ms[min(len(ms) - 1, int(len(ms) * 0.99))] if ms else float("nan"),
        per_worker_hit_rate=per_worker,
        restart_reflected_s=reflected,
    )


def _wait_routable(gateways: list[Gateway], prefill: list[Worker], kv_events: bool) -> None:
    """Until every gateway has every worker healthy and, with KV events, a
    view of every prefill worker's cache (its first snapshot)."""
    deadline = time.monotonic() + 60
    while True:
        ok = True
        for gw in gateways:
            listed = gw.workers()
            for w in prefill:
                entry = listed.get(w.url, {})
                ok = ok and bool(entry.get("healthy"))
                if kv_events:
                    ok = ok and entry.get("prefix_cache", {}).get("source") == "kv_events"
        if ok:
            return
        if time.monotonic() > deadline:
            raise AssertionError("the gateways never saw every worker (and its cache)")
        time.sleep(0.05)
