"""The decode-side KV wait of disaggregated requests on real workers.

Starts one prefill and one decode worker (``python -m prefill_server`` /
``decode_server``, same device, any transfer backend), plays the gateway over
the request plane (``Generate`` to decode and ``Prefill`` to prefill at once,
one room each) for ``requests`` prompts of random token ids at a fixed
concurrency, and reads every request's stage stamps off the final deltas of
both workers (``protocol.stages``). Per request:

- ``kv_wait``: prefill's last forward finished (its first token sampled) until
  the first decode step with the request launched: the KV transfer's tail,
  the Done message and the decode scheduler's pick-up. The two stamps come
  from two processes whose stage offsets start when each received the
  request; both requests leave this process in the same loop tick, so the two
  starts differ by the request plane's delivery skew (tens of µs when the
  workers are idle: at concurrency 1 the figure is exact to about that);
- ``done_to_first_step``: the decode worker's part of it, Done received until
  the first decode step launched (decode clock alone);
- ``transfer_tail``: the rest, ``kv_wait - done_to_first_step``;
- ``first_gap``: the requester's view, prefill's first token to the decode
  worker's first token (one decode step more, and prefill's own send).

Used by ``bench_kvtransfer.py --pd-requests N``.
"""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.cluster import WorkerProcess, log_tail
from protocol.auth import keys_for
from protocol.client import WorkerClient, WorkerError
from protocol.sampling import SamplingParams
from protocol.stages import DONE_RECEIVED, FIRST_TOKEN, FORWARD_STARTED
from protocol.to_gateway import TokenDelta
from protocol.to_worker import Generate, Prefill
from worker.config import CLUSTER_TOKEN_ENV

CLIENT_TIMEOUT_S = 120.0
METRICS = ("kv_wait", "done_to_first_step", "transfer_tail", "first_gap")


def percentile(xs: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation; NaN when empty."""
    if not xs:
        return float("nan")
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=1000, method="inclusive")[max(0, round(q * 1000) - 1)]


def request_waits(
    prefill: list[TokenDelta], decode: list[TokenDelta], first_gap_s: float | None
) -> dict[str, float] | None:
    """The waits of one request from both workers' final deltas and the
    requester's first-token gap (None when a side failed or lacks a stamp)."""
    if not prefill or not decode or first_gap_s is None:
        return None
    if prefill[-1].finish_reason == "error" or decode[-1].finish_reason == "error":
        return None
    p, d = prefill[-1].stages or {}, decode[-1].stages or {}
    if FIRST_TOKEN not in p or DONE_RECEIVED not in d or FORWARD_STARTED not in d:
        return None
    kv_wait = max(0.0, d[FORWARD_STARTED] - p[FIRST_TOKEN])
    on_decode = max(0.0, d[FORWARD_STARTED] - d[DONE_RECEIVED])
    return {
        "kv_wait": kv_wait,
        "done_to_first_step": on_decode,
        "transfer_tail": max(0.0, kv_wait - on_decode),
        "first_gap": first_gap_s,
    }


async def _one(
    pc: WorkerClient,
    dc: WorkerClient,
    prefill_bootstrap: str,
    decode_bootstrap: str,
    rid: str,
    prompt: list[int],
    sampling: SamplingParams,
) -> dict[str, float] | None:
    room = secrets.token_hex(8)
    arrivals: dict[str, float] = {}

    async def collect(client: WorkerClient, msg: Generate | Prefill, side: str) -> list[TokenDelta]:
        out = []
        try:
            async for delta in client.generate(msg):
                if delta.token_ids and side not in arrivals:
                    arrivals[side] = time.perf_counter()
                out.append(delta)
        except WorkerError:
            return []
        return out

    gen = Generate(rid, prompt, sampling, room=room, prefill_bootstrap=prefill_bootstrap)
    pre = Prefill(rid, prompt, sampling, room=room, decode_bootstrap=decode_bootstrap)
    decode, prefill = await asyncio.gather(collect(dc, gen, "decode"), collect(pc, pre, "prefill"))
    gap = None
    if "decode" in arrivals and "prefill" in arrivals:
        gap = arrivals["decode"] - arrivals["prefill"]
    return request_waits(prefill, decode, gap)


async def _drive(
    p_info: dict[str, Any],
    d_info: dict[str, Any],
    token: str,
    requests: int,
    concurrency: int,
    prompt_len: int,
    output_len: int,
    vocab: int,
    seed: int,
) -> tuple[list[dict[str, float]], int]:
    rng = random.Random(seed)
    # Ids away from 0 and the top of the vocabulary (special tokens live there).
    prompts = [[rng.randrange(10, vocab - 10) for _ in range(prompt_len)] for _ in range(requests)]
    sampling = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    keys = keys_for(token)
    pc = WorkerClient(p_info["request_endpoint"], timeout_s=CLIENT_TIMEOUT_S, auth=keys)
    dc = WorkerClient(d_info["request_endpoint"], timeout_s=CLIENT_TIMEOUT_S, auth=keys)
    waits: list[dict[str, float]] = []
    failed = 0
    queue = list(enumerate(prompts))

    async def lane() -> None:
        nonlocal failed
        while queue:
            i, prompt = queue.pop(0)
            w = await _one(
                pc,
                dc,
                p_info["bootstrap_endpoint"],
                d_info["bootstrap_endpoint"],
                f"kvw-{i}",
                prompt,
                sampling,
            )
            if w is None:
                failed += 1
            else:
                waits.append(w)

    async with pc, dc:
        # One request first: connections, KV handshake and warm-up stay out of
        # the figures.
        await _one(
            pc,
            dc,
            p_info["bootstrap_endpoint"],
            d_info["bootstrap_endpoint"],
            "kvw-warm",
            prompts[0],
            sampling,
        )
        await asyncio.gather(*(lane() for _ in range(concurrency)))
    return waits, failed


def model_vocab(model: str | None) -> int:
    """The vocabulary size of a model directory (None: the built-in model)."""
    if model is None:
        from engine.tiny import VOCAB_SIZE

        return VOCAB_SIZE
    return int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])


def summarize(waits: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """p50/p99/mean in ms of every metric over the requests that have it."""
    out = {}
    for name in METRICS:
        xs = [w[name] * 1e3 for w in waits if name in w]
        out[name] = {
            "p50_ms": round(percentile(xs, 0.5), 3),
            "p99_ms": round(percentile(xs, 0.99), 3),
            "mean_ms": round(statistics.fmean(xs), 3) if xs else float("nan"),
            "n": len(xs),
        }
    return out


def run_kv_wait(
    *,
    model: str | None,
    device: str,
    backend: str,
    requests: int,
    concurrency: int,
    prompt_len: int,
    output_len: int,
    settings: dict[str, Any] | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Start the two workers, run the requests, stop the workers; the summary
    (and the settings it ran with). ``model``: a model directory (None: the
    built-in tiny model)."""
    token = secrets.token_hex(16)
    env = {CLUSTER_TOKEN_ENV: token}
    common = {"transfer_backend": backend, "device": device, **(settings or {})}
    with tempfile.TemporaryDirectory(prefix="kv-wait-") as tmp:
        logs = Path(tmp)
        workers = [
            WorkerProcess.make("prefill", "prefill", model, logs, env, **common),
            WorkerProcess.make("decode", "decode", model, logs, env, **common),
        ]
        try:
            for w in workers:
                w.start()
            for w in workers:
                w.wait_healthy()
            p_info, d_info = (w.info() for w in workers)
            vocab = model_vocab(model)
            waits, failed = asyncio.run(
                _drive(
                    p_info,
                    d_info,
                    token,
                    requests,
                    concurrency,
                    prompt_len,
                    output_len,
                    vocab,
                    seed,
                )
            )
        except BaseException:
            for w in workers:
                print(f"----- {w.name} log -----\n{log_tail(w.log_path)}")
            raise
        finally:
            for w in workers:
                w.stop()
    return {
        "backend": backend,
        "device": device,
        "requests": requests,
        "concurrency": concurrency,
        "prompt_len": prompt_len,
        "output_len": output_len,
        "failed": failed,
        "waits": summarize(waits),
    }


def print_summary(summary: dict[str, Any]) -> None:
    print(
        f"decode-side KV wait, {summary['backend']} on {summary['device']}: "
        f"{summary['requests']} requests of {summary['prompt_len']} prompt tokens at "
        f"concurrency {summary['concurrency']} ({summary['failed']} failed)"
    )
    print(f"{'per request':<22}{'p50 ms':>10}{'p99 ms':>10}{'mean ms':>10}{'n':>6}")
    for name, s in summary["waits"].items():
        print(f"{name:<22}{s['p50_ms']:>10.3f}{s['p99_ms']:>10.3f}{s['mean_ms']:>10.3f}{s['n']:>6}")
