"""``python -m benchmarks.bench_serving`` and its load generator
(``harness.loadgen``, ``harness.http_stream``), ``python -m
benchmarks.compare_pd`` and ``engine.dummy_model``.

Metric arithmetic is checked against a fake OpenAI server
(``harness.fake_openai_server``, a process of its own) whose timing is known:
a fixed time to first token, fixed gaps between one-token chunks, and prompt
markers that slow a request down, fail it or drop its usage chunk; the tool
itself runs against it too, and its JSON record is checked. The same server
at a real deployment's pace checks that the client adds no latency of its
own, at concurrency 1 and 64. The raw HTTP client's framing, keep-alive and
timeouts are checked piece by piece. A goodput sweep's verdicts are checked
on requests of known timing, and the tool sweeps a fake server whose latency
grows with the streams in flight. Then the tool runs against the real
gateway (embedded tiny workers, CPU), and compare_pd runs both deployments on
a tiny dummy model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import random
import signal
import statistics
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from workers import REPO, launch_gateway, log_tail, procs_mentioning

from engine.dummy_model import write_dummy_model
from engine.model_config import ModelConfig
from engine.tiny import MODEL_CONFIG
from gateway.text import Tokenizer
from harness import http_stream
from harness import loadgen as bench
from harness.fake_openai_server import (
    Connection,
    ServerStats,
    Timing,
    listening_socket,
    serve_in_process,
)

TTFT_S = 0.8
GAP_S = 0.1
FAST_TTFT_S = 0.06
FAST_GAP_S = 0.012
N_TOKENS = 8
REL = 0.05
GATEWAY_START_TIMEOUT_S = 120.0
COMPARE_TIMEOUT_S = 180.0
BENCH_TIMEOUT_S = 120.0
CPU_ENV = {"OMP_NUM_THREADS": "1"}  # several processes share a few cores

REQUIRED_KEYS = [
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_e2el_ms",
    "request_throughput",
    "output_throughput",
    "input_throughput",
    "completed",
    "failed",
    "total_output_tokens",
    "workload",
    "command",
    "date",
    "git_commit",
    "machine",
]


# -- fake OpenAI server ------------------------------------------------------------


def run_tool(
    output: Path, *argv: str
) -> tuple[dict[str, Any] | None, subprocess.CompletedProcess[str]]:
    """``python -m benchmarks.bench_serving ARGV``, appending to ``output``: the
    JSON record it appended (None if none) and the finished process."""
    cmd = [sys.executable, "-m", "benchmarks.bench_serving", *argv]
    cmd += ["--output-file", str(output), "--disable-progress"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    lines = output.read_text().splitlines() if output.exists() else []
    assert len(lines) <= 1, lines
    return (json.loads(lines[0]) if lines else None), proc


def tool_record(output: Path, *argv: str) -> dict[str, Any]:
    """The record of a run of the tool that must succeed."""
    record, proc = run_tool(output, *argv)
    assert proc.returncode == 0 and record is not None, f"{proc.stdout}\n{proc.stderr}"
    return record


@pytest.fixture(scope="module")
def fake_server() -> Iterator[str]:
    """Slow, round timings: metric arithmetic is checked with a wide margin."""
    with serve_in_process(Timing(TTFT_S, GAP_S)) as url:
        yield url


@pytest.fixture(scope="module")
def fast_server() -> Iterator[str]:
    """Timings like a real deployment's: the client's own latency shows."""
    with serve_in_process(Timing(FAST_TTFT_S, FAST_GAP_S)) as url:
        yield url


def run_specs(
    url: str, specs: list[bench.RequestSpec]
) -> tuple[bench.BenchmarkResult, dict[str, Any]]:
    # Warm-up: the first request of a process pays for lazy imports. At most 4
    # at a time: the client's own per-request work (a few ms each on a loaded
    # machine) would otherwise pile up in the TTFT of every request of a burst.
    cfg = bench.BenchConfig(
        base_url=url, model="fake-model", requests=specs, warmup_requests=4, max_concurrency=4
    )
    result = asyncio.run(bench.run_benchmark(cfg))
    return result, bench.compute_metrics(result.outcomes, result.duration)


# -- metrics against known timing --------------------------------------------------


@pytest.mark.parametrize(
    "backend, client",
    [("openai-completions", "raw"), ("openai-chat", "raw"), ("openai-chat", "httpx")],
)
def test_metrics_match_known_timing(
    fake_server: str, backend: str, client: str, tmp_path: Path
) -> None:
    concurrency, n = 4, 16
    r = tool_record(
        tmp_path / "r.jsonl",
        *["--base-url", fake_server, "--backend", backend, "--num-prompts", str(n)],
        *["--http-client", client],
        *["--max-concurrency", str(concurrency), "--random-input-len", "8"],
        *["--random-output-len", str(N_TOKENS), "--warmup-requests", str(concurrency)],
    )
    assert r["model"] == "fake-model"
    assert r["client"] == {"http_client": client, "processes": 1}
    assert (r["completed"], r["failed"]) == (n, 0)
    assert r["total_output_tokens"] == n * N_TOKENS
    assert r["output_tokens_from_chunks"] is False
    assert r["total_input_tokens"] == n * 8
    for stat in ("mean", "median"):
        assert r[f"{stat}_ttft_ms"] == pytest.approx(TTFT_S * 1e3, rel=REL)
        assert r[f"{stat}_itl_ms"] == pytest.approx(GAP_S * 1e3, rel=REL)
        assert r[f"{stat}_tpot_ms"] == pytest.approx(GAP_S * 1e3, rel=REL)
    per_request = TTFT_S + (N_TOKENS - 1) * GAP_S
    assert r["mean_e2el_ms"] == pytest.approx(per_request * 1e3, rel=REL)
    # All arrive at once and run `concurrency` at a time: n / concurrency
    # back-to-back waves, each lasting one request's time.
    assert r["request_throughput"] == pytest.approx(concurrency / per_request, rel=REL)
    assert r["output_throughput"] == pytest.approx(concurrency * N_TOKENS / per_request, rel=REL)
    assert r["request_goodput"] is None


def test_failed_requests_are_counted_not_averaged(fake_server: str) -> None:
    ok = [bench.RequestSpec("fine prompt", 2, 4)] * 4
    bad = [bench.RequestSpec("@fail500", 1, 4)] * 2 + [bench.RequestSpec("@failchunk", 1, 4)] * 2
    _, m = run_specs(fake_server, ok + bad)
    assert (m["completed"], m["failed"]) == (4, 4)
    assert m["total_output_tokens"] == 4 * 4
    assert m["total_input_tokens"] == 4 * 2
    assert m["mean_ttft_ms"] == pytest.approx(TTFT_S * 1e3, rel=REL)
    assert m["median_ttft_ms"] == pytest.approx(TTFT_S * 1e3, rel=REL)
    assert any("HTTP 500" in e and "injected 500" in e for e in m["errors"])
    assert "injected failure" in m["errors"]


def test_goodput_counts_requests_meeting_every_slo(fake_server: str) -> None:
    specs = [bench.RequestSpec("quick", 1, 4)] * 4 + [bench.RequestSpec("@slow", 1, 4)] * 4
    result, m = run_specs(fake_server, specs)
    assert m["request_goodput"] is None
    between = TTFT_S * 1.5 * 1e3  # fast ones meet it, slow ones (2x TTFT) do not
    g = bench.compute_metrics(result.outcomes, result.duration, {"ttft": between})
    assert g["good_requests"] == 4
    assert g["request_goodput"] == pytest.approx(4 / result.duration)
    assert g["slo_ms"] == {"ttft": between}
    g = bench.compute_metrics(result.outcomes, result.duration, {"ttft": between, "tpot": 1.0})
    assert g["good_requests"] == 0
    g = bench.compute_metrics(result.outcomes, result.duration, {"e2el": 1e6, "tpot": 1e3})
    assert g["good_requests"] == 8


def test_output_tokens_fall_back_to_chunks_without_usage(fake_server: str) -> None:
    _, m = run_specs(fake_server, [bench.RequestSpec("@nousage", 1, 5)] * 2)
    assert m["completed"] == 2
    assert m["output_tokens_from_chunks"] is True
    assert m["total_output_tokens"] == 10


def test_parse_slo() -> None:
    assert bench.parse_slo("ttft=500,tpot=50") == {"ttft": 500.0, "tpot": 50.0}
    assert bench.parse_slo("E2EL=2000") == {"e2el": 2000.0}
    for bad in ("ttft", "itl=5", "ttft=fast"):
        with pytest.raises(Exception, match="SLO"):
            bench.parse_slo(bad)


# -- the client's own latency ------------------------------------------------------

FIDELITY_ATTEMPTS = 3
"""A check passes when one attempt does: other work on a shared machine can
delay any one run, a client that adds latency of its own fails all of them."""


def measure_fidelity(
    url: str, concurrency: int, http_client: str = "raw", processes: int = 1
) -> dict[str, float]:
    """How late the client notices tokens, in ms: its median TTFT against the
    server's first writes of the same requests (the server's own delays, real
    latency that a perfect client sees too, are left out), its median ITL
    against the server's median gap between writes."""
    n = 2 * concurrency if concurrency > 1 else 6
    # The first token tells the server which request it is serving.
    specs = [bench.RequestSpec([10 + i] + [10] * 15, 16, 16) for i in range(n)]
    cfg = bench.BenchConfig(
        base_url=url,
        model="fake-model",
        requests=specs,
        max_concurrency=concurrency,
        warmup_requests=concurrency,  # opens the connections before timing
        http_client=http_client,
        num_client_processes=processes,
    )
    httpx.get(f"{url}/stats", timeout=10)  # resets the server's record
    result = bench.benchmark(cfg)
    server = httpx.get(f"{url}/stats?detail=1", timeout=10).json()
    # Warm-up requests reuse the first prompts; the timed ones came later.
    first_write = dict(server["first_writes"])
    ok = [o for o in result.outcomes if o.success]
    assert len(ok) == n, [o.error for o in result.outcomes]
    lags = [o.start + o.ttft - first_write[s.prompt[0]] for o, s in zip(ok, specs)]
    m = bench.compute_metrics(ok, result.duration)
    return {
        "ttft_lag": statistics.median(lags) * 1e3,
        "client_ttft": m["median_ttft_ms"],
        "server_ttft": server["ttft_ms"]["median"],
        "client_itl": m["median_itl_ms"],
        "server_itl": server["itl_ms"]["median"],
    }


def fidelity_errors(r: dict[str, float], tol_ms: dict[str, float], whole: bool) -> list[str]:
    """What is out of tolerance. ``whole``: also the client's TTFT and ITL
    against the configured timing, which takes in the sending of requests and
    the server's delays (at concurrency 1, all small); otherwise only how late
    the client noticed the chunks that the server wrote."""
    errors = []
    if not 0 <= r["ttft_lag"] <= tol_ms["ttft"]:
        errors.append(f"first tokens noticed {r['ttft_lag']:.2f} ms late (tol {tol_ms['ttft']})")
    if abs(r["client_itl"] - r["server_itl"]) > tol_ms["itl"]:
        errors.append(
            f"ITL: client {r['client_itl']:.3f} ms, server {r['server_itl']:.3f} ms "
            f"(tol {tol_ms['itl']})"
        )
    for name, truth in (("ttft", FAST_TTFT_S * 1e3), ("itl", FAST_GAP_S * 1e3)):
        if whole and abs(r[f"client_{name}"] - truth) > tol_ms[name]:
            errors.append(f"{name}: client {r[f'client_{name}']:.2f} ms, configured {truth}")
    return errors


FIDELITY_CASES = {
    # concurrency: tolerances (ms) of TTFT and ITL, whether to check the whole TTFT
    1: ({"ttft": 2.0, "itl": 2.0}, True),
    64: ({"ttft": 0.05 * FAST_TTFT_S * 1e3, "itl": 0.05 * FAST_GAP_S * 1e3}, False),
}


@pytest.mark.parametrize("concurrency", sorted(FIDELITY_CASES))
def test_client_adds_no_latency(fast_server: str, concurrency: int) -> None:
    """Median TTFT and ITL within 2 ms of the truth at concurrency 1, within
    5% at 64 (the httpx client before this one was 5 ms and over 100 ms off)."""
    tol_ms, whole = FIDELITY_CASES[concurrency]
    attempts = []
    for _ in range(FIDELITY_ATTEMPTS):
        r = measure_fidelity(fast_server, concurrency)
        errors = fidelity_errors(r, tol_ms, whole)
        if not errors:
            return
        attempts.append(errors)
    pytest.fail(f"every attempt out of tolerance: {attempts}")


# -- the raw HTTP client -----------------------------------------------------------


class _FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.closed = False

    def write(self, data: bytes) -> None:  # type: ignore[override]
        self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def _feed_in_pieces(response: bytes, cut: list[int]) -> tuple[http_stream._Connection, Any]:
    """A connection fed ``response`` split at the offsets in ``cut``, one
    ``data_received`` per piece."""
    loop = asyncio.new_event_loop()
    try:
        conn = http_stream._Connection(loop)
        conn.connection_made(_FakeTransport())
        done = conn.send(b"POST / HTTP/1.1\r\n\r\n")
        for a, b in zip([0, *cut], [*cut, len(response)]):
            conn.data_received(response[a:b])
        return conn, done
    finally:
        loop.close()


SSE_BODY = b'data: {"choices": [{"text": "a"}]}\n\ndata: {"choices": [{"text": "b"}]}\n\n'


def _chunked(body: bytes, sizes: list[int]) -> bytes:
    out, pos = b"", 0
    for size in sizes:
        out += b"%x;ext=1\r\n%b\r\n" % (size, body[pos : pos + size])
        pos += size
    return out + b"0\r\nX-Trailer: yes\r\n\r\n"


@pytest.mark.parametrize("framing", ["chunked", "content-length"])
def test_raw_client_decodes_a_response_split_anywhere(framing: str) -> None:
    if framing == "chunked":
        head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        wire = head + _chunked(SSE_BODY, [10, 1, len(SSE_BODY) - 11])
    else:
        wire = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%b" % (len(SSE_BODY), SSE_BODY)
    cuts = [[], *([i] for i in range(1, len(wire))), list(range(1, len(wire)))]
    for cut in cuts:
        conn, done = _feed_in_pieces(wire, cut)
        assert done.done() and not done.exception(), cut
        resp = done.result()
        assert (resp.status, resp.body) == (200, SSE_BODY), cut
        assert len(resp.times) == len(resp.pieces)
        assert conn.reusable and conn.state == http_stream._DONE


def test_raw_client_stamps_each_line_with_its_arrival() -> None:
    resp = http_stream.Response(
        status=200,
        times=[1.0, 2.0, 3.0],
        pieces=[b"data: x\r\n\r\nda", b"ta: y", b"\r\n\r\ndata: z"],
        end=4.0,
    )
    lines = [(t, line) for t, line in http_stream.sse_lines(resp) if line]
    assert lines == [(1.0, b"data: x"), (3.0, b"data: y"), (3.0, b"data: z")]


def test_raw_client_reads_until_close_and_rejects_garbage() -> None:
    conn, done = _feed_in_pieces(b"HTTP/1.0 500 Oops\r\n\r\nbody", [20])
    assert not done.done()
    conn.connection_lost(None)
    assert done.result().status == 500 and done.result().body == b"body"
    assert not conn.reusable
    conn, done = _feed_in_pieces(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", [])
    with pytest.raises(http_stream.StreamError, match="bad HTTP response"):
        done.result()
    conn, done = _feed_in_pieces(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nshort", [])
    conn.connection_lost(None)
    with pytest.raises(http_stream.StreamError, match="mid-response"):
        done.result()


async def _scripted_server(
    answers: list[bytes | None],
) -> tuple[asyncio.AbstractServer, int, list[int]]:
    """Answers the n-th request with answers[n]; None: close the connection
    unanswered. Returns the server, its port, and the connection of each request."""
    seen: list[int] = []
    connections = iter(range(1000))

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        me = next(connections)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                seen.append(me)
                answer = answers[len(seen) - 1]
                if answer is None:
                    break
                writer.write(answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], seen


OK_ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


def test_raw_client_keeps_connections_alive_and_retries_a_stale_one() -> None:
    async def run() -> list[int]:
        # Request 2 finds its kept-alive connection closed unanswered: it is
        # retried once on a new connection.
        server, port, seen = await _scripted_server([OK_ANSWER, OK_ANSWER, None, OK_ANSWER])
        client = http_stream.StreamClient(f"http://127.0.0.1:{port}", 5.0, {"X-Key": "k"})
        request = client.request_bytes("/v1/completions", b"{}")
        assert b"X-Key: k\r\n" in request and request.endswith(b"\r\n\r\n{}")
        for _ in range(3):
            resp = await client.post(request)
            assert (resp.status, resp.body) == (200, b"ok")
        await client.aclose()
        server.close()
        return seen

    assert asyncio.run(run()) == [0, 0, 0, 1]


def test_raw_client_times_out_a_silent_server() -> None:
    async def run() -> None:
        server, port, _ = await _scripted_server([b"HTTP/1.1 200 OK\r\n"])  # no end of head
        client = http_stream.StreamClient(f"http://127.0.0.1:{port}", 0.3, {})
        with pytest.raises(http_stream.StreamError, match="no data for 0.3 s"):
            await client.post(client.request_bytes("/", b""))
        await client.aclose()
        server.close()

    asyncio.run(run())


def test_raw_client_refuses_https() -> None:
    with pytest.raises(ValueError, match="plain http://"):
        http_stream.StreamClient("https://example.com", 1.0)


def test_https_falls_back_to_httpx(tmp_path: Path) -> None:
    # Nothing listens on port 1: every request fails at once, through httpx.
    r, proc = run_tool(
        tmp_path / "r.jsonl",
        *["--base-url", "https://127.0.0.1:1", "--model", "m", "--num-prompts", "2"],
        *["--random-input-len", "4", "--random-output-len", "2", "--request-timeout-s", "5"],
    )
    assert "using httpx" in proc.stderr
    assert proc.returncode == 1 and r is not None, proc.stderr  # nothing completed
    assert r["client"] == {"http_client": "httpx", "processes": 1}
    assert (r["completed"], r["failed"]) == (0, 2)


# -- client processes ---------------------------------------------------------------


def test_requests_are_dealt_out_to_client_processes() -> None:
    specs = [bench.RequestSpec("p", 1, 1)] * 7
    cfg = bench.BenchConfig(
        base_url="http://x",
        model="m",
        requests=specs,
        request_rate=10.0,
        max_concurrency=5,
        warmup_requests=3,
    )
    offsets = bench.send_offsets(cfg)
    assert offsets[0] == 0.0 and offsets == sorted(offsets) and len(offsets) == 7
    shares = bench.split_shares(cfg, 2)
    assert [s.indices for s in shares] == [(0, 2, 4, 6), (1, 3, 5)]
    assert [s.max_concurrency for s in shares] == [3, 2]
    assert [s.warmup for s in shares] == [(0, 2), (1,)]
    assert shares[1].offsets == tuple(offsets[i] for i in (1, 3, 5))
    # Never more processes than concurrency slots or requests.
    assert len(bench.split_shares(cfg, 8)) == 5
    unlimited = bench.BenchConfig(base_url="http://x", model="m", requests=specs[:3])
    assert [s.max_concurrency for s in bench.split_shares(unlimited, 8)] == [None] * 3


def test_default_client_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    def default(concurrency: int | None, n: int = 1000) -> int:
        specs = [bench.RequestSpec("p", 1, 1)] * n
        cfg = bench.BenchConfig("http://x", "m", specs, max_concurrency=concurrency)
        return bench.default_client_processes(cfg)

    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    per = bench.CONCURRENCY_PER_PROCESS
    assert default(1) == default(per) == 1
    assert default(per + 1) == 2
    assert default(100 * per) == 8  # half the cores
    assert default(None, n=10) == 1  # no limit: the request count bounds concurrency
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert default(4 * per) == 1


@pytest.mark.e2e
def test_client_processes_merge_their_outcomes(fake_server: str, tmp_path: Path) -> None:
    """Two client processes: the same metrics as one (known timing), every
    request once, in order."""
    concurrency, n = 4, 8
    r = tool_record(
        tmp_path / "r.jsonl",
        *["--base-url", fake_server, "--num-prompts", str(n), "--num-client-processes", "2"],
        *["--max-concurrency", str(concurrency), "--random-input-len", "8"],
        *["--random-output-len", str(N_TOKENS), "--warmup-requests", str(concurrency)],
    )
    assert r["client"] == {"http_client": "raw", "processes": 2}
    assert (r["completed"], r["failed"]) == (n, 0)
    assert r["total_output_tokens"] == n * N_TOKENS
    assert r["median_ttft_ms"] == pytest.approx(TTFT_S * 1e3, rel=REL)
    assert r["median_itl_ms"] == pytest.approx(GAP_S * 1e3, rel=REL)
    per_request = TTFT_S + (N_TOKENS - 1) * GAP_S
    assert r["request_throughput"] == pytest.approx(concurrency / per_request, rel=REL)


# -- arrivals ----------------------------------------------------------------------


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 3.0])
def test_arrival_gaps_have_mean_one_over_rate(burstiness: float) -> None:
    rate = 8.0
    gaps = bench.arrival_gaps(1000, rate, burstiness, random.Random(1))
    assert len(gaps) == 1000
    assert all(g >= 0 for g in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / rate, rel=0.10)


def test_arrival_gaps_inf_and_seed() -> None:
    assert bench.arrival_gaps(5, math.inf, 1.0, random.Random(0)) == [0.0] * 5
    a = bench.arrival_gaps(50, 2.0, 1.0, random.Random(7))
    assert a == bench.arrival_gaps(50, 2.0, 1.0, random.Random(7))
    assert a != bench.arrival_gaps(50, 2.0, 1.0, random.Random(8))
    with pytest.raises(ValueError):
        bench.arrival_gaps(5, 0.0, 1.0, random.Random(0))


# -- workloads ---------------------------------------------------------------------


def parse(*argv: str) -> Any:
    """The workload flags (those of ``python -m benchmarks.bench_serving``)."""
    ap = argparse.ArgumentParser()
    bench.add_workload_args(ap)
    return ap.parse_args(list(argv))


def test_random_workload_bounds_and_seed() -> None:
    argv = ["--random-input-len", "100", "--random-output-len", "20"]
    argv += ["--random-range-ratio", "0.5", "--num-prompts", "300", "--vocab-size", "600"]
    specs = bench.sample_requests(parse(*argv))
    assert len(specs) == 300
    ins, outs = [s.prompt_len for s in specs], [s.output_len for s in specs]
    assert 50 <= min(ins) < max(ins) <= 100
    assert 10 <= min(outs) < max(outs) <= 20
    for s in specs:
        assert isinstance(s.prompt, list) and len(s.prompt) == s.prompt_len
        assert all(bench.FIRST_TOKEN_ID <= t < 600 for t in s.prompt)
    assert specs == bench.sample_requests(parse(*argv))
    assert specs != bench.sample_requests(parse(*argv, "--seed", "1"))

    fixed = bench.sample_requests(parse("--random-input-len", "7", "--num-prompts", "20"))
    assert {s.prompt_len for s in fixed} == {7}
    text = bench.sample_requests(parse("--random-input-len", "9"), chat=True)
    assert all(isinstance(s.prompt, str) and len(s.prompt.split()) == 9 for s in text)
    with pytest.raises(ValueError, match="token-id"):
        bench.sample_requests(parse("--random-prompt-kind", "token-ids"), chat=True)


@pytest.mark.parametrize("kind", ["token-ids", "text"])
def test_shared_prefix_prompts_share_the_group_prefix(kind: str) -> None:
    argv = ["--dataset-name", "shared-prefix", "--random-prompt-kind", kind]
    argv += ["--gsp-num-groups", "3", "--gsp-prompts-per-group", "4"]
    argv += ["--gsp-system-prompt-len", "20", "--gsp-question-len", "5", "--gsp-output-len", "7"]
    specs = bench.sample_requests(parse(*argv))
    assert len(specs) == 12
    groups: dict[tuple, list[tuple]] = {}
    for s in specs:
        tokens = s.prompt if isinstance(s.prompt, list) else s.prompt.split()
        assert len(tokens) == s.prompt_len == 25 and s.output_len == 7
        groups.setdefault(tuple(tokens[:20]), []).append(tuple(tokens[20:]))
    assert len(groups) == 3
    assert all(len(questions) == 4 for questions in groups.values())


def test_sharegpt_workload(tmp_path: Path) -> None:
    data = [
        {"conversations": [{"from": "human", "value": "only one turn"}]},
        {
            "conversations": [
                {"from": "human", "value": "what is a cache"},
                {"from": "gpt", "value": "a small fast memory near the processor"},
            ]
        },
        {
            "conversations": [
                {"from": "gpt", "value": "hello there"},
                {"from": "human", "value": "say two words"},
                {"from": "gpt", "value": "two words"},
            ]
        },
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    argv = ["--dataset-name", "sharegpt", "--dataset-path", str(path), "--num-prompts", "10"]
    specs = bench.sample_requests(parse(*argv))
    got = sorted((s.prompt, s.prompt_len, s.output_len) for s in specs)
    assert got == [("say two words", 3, 2), ("what is a cache", 4, 7)]
    specs = bench.sample_requests(parse(*argv, "--sharegpt-output-len", "16"))
    assert {s.output_len for s in specs} == {16}
    assert len(bench.sample_requests(parse(*argv[:-1], "1"))) == 1


def test_sharegpt_missing_file_errors_clearly(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(FileNotFoundError, match="ShareGPT file not found"):
        bench.sample_requests(parse("--dataset-name", "sharegpt", "--dataset-path", str(missing)))
    out = tmp_path / "r.jsonl"
    r, proc = run_tool(out, "--dataset-name", "sharegpt", "--dataset-path", str(missing))
    assert (proc.returncode, r) == (2, None)
    assert f"ShareGPT file not found: {missing}" in proc.stderr


# -- goodput sweep -------------------------------------------------------------------


def done(ttft_s: float, gap_s: float, tokens: int = 3) -> bench.RequestOutcome:
    """A successful request of known timing: TPOT is ``gap_s``."""
    return bench.RequestOutcome(
        prompt_len=4,
        success=True,
        ttft=ttft_s,
        latency=ttft_s + (tokens - 1) * gap_s,
        itl=[gap_s] * (tokens - 1),
        chunks=tokens,
        prompt_tokens=4,
        completion_tokens=tokens,
    )


FAILED = bench.RequestOutcome(prompt_len=4, error="HTTP 500: injected")


def test_a_sweep_point_holds_when_every_p99_is_within_and_nothing_failed() -> None:
    slo = {"ttft": 500.0, "tpot": 30.0}

    def verdict(outcomes: list[bench.RequestOutcome]) -> bench.Verdict:
        return bench.slo_verdict(bench.compute_metrics(outcomes, 1.0, slo), slo)

    quick = [done(0.2, 0.02)] * 98
    assert verdict(quick) == bench.Verdict(()) and verdict(quick).holds
    # One request in a hundred over an objective leaves the p99 within it
    # (the mean too); two take the p99 over it, while the mean stays within.
    assert verdict([*quick, done(0.2, 0.02), done(0.9, 0.02)]).holds
    assert verdict([*quick, done(0.9, 0.02), done(0.9, 0.02)]).broken == ("ttft",)
    assert verdict([*quick, done(0.2, 0.05), done(0.2, 0.05)]).broken == ("tpot",)
    assert verdict([*quick, done(0.9, 0.05), done(0.9, 0.05)]).broken == ("ttft", "tpot")
    # A failed request breaks a point whose latencies all hold.
    assert verdict([*quick, FAILED]).broken == ("failed",)
    assert verdict([*quick, done(0.9, 0.02), done(0.9, 0.02), FAILED]).broken == (
        "ttft",
        "failed",
    )
    # At the objective holds; a metric without samples (TPOT of one-token
    # outputs) misses nothing; metrics without an objective are not read.
    at_limit = {"failed": 0, "p99_ttft_ms": 500.0, "p99_tpot_ms": None, "p99_e2el_ms": 1e9}
    assert bench.slo_verdict(at_limit, slo).holds
    assert bench.slo_verdict(at_limit | {"p99_ttft_ms": 500.01}, slo).broken == ("ttft",)


def test_a_sweep_stops_after_the_first_point_that_breaks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in for the benchmark, TTFT 50 ms per request/s, one failed
    request at 4 req/s: 1 and 2 hold, 4 breaks on the failure alone and ends
    the sweep; with run_all, 8 runs and breaks on TTFT, and the summary still
    names 2 and 4."""
    ran: list[tuple[float, int | None]] = []

    def fake_benchmark(config: bench.BenchConfig) -> bench.BenchmarkResult:
        ran.append((config.request_rate, config.max_concurrency))
        outcomes = [done(0.05 * config.request_rate, 0.01) for _ in config.requests]
        if config.request_rate == 4:
            outcomes[0] = FAILED
        return bench.BenchmarkResult(outcomes, duration=2.0)

    monkeypatch.setattr(bench, "benchmark", fake_benchmark)
    cfg = bench.BenchConfig("http://x", "m", [bench.RequestSpec("p", 4, 3)] * 10, max_concurrency=3)
    slo = {"ttft": 300.0}
    rates = [1.0, 2.0, 4.0, 8.0]
    sweep = bench.run_sweep(cfg, "request_rate", rates, slo)
    assert ran == [(1.0, 3), (2.0, 3), (4.0, 3)]
    points = sweep["points"]
    assert [(p["request_rate"], p["holds"], p["broken"]) for p in points] == [
        (1.0, True, []),
        (2.0, True, []),
        (4.0, False, ["failed"]),
    ]
    # Each point carries a plain run's metrics.
    plain = bench.compute_metrics([done(0.05, 0.01)] * 10, 2.0, slo)
    assert {k: points[0][k] for k in plain} == plain
    assert points[1]["output_throughput"] == 10 * 3 / 2.0
    best = {k: points[1][k] for k in ("output_throughput", "request_goodput")}
    assert sweep["summary"] == {
        "highest_holding": {"value": 2.0, **best},
        "first_broken": {"value": 4.0, "broken": ["failed"], "reason": "1 failed"},
    }
    assert (sweep["over"], sweep["values"], sweep["slo_ms"]) == ("request_rate", rates, slo)

    ran.clear()
    sweep = bench.run_sweep(cfg, "request_rate", rates, slo, run_all=True)
    assert [rate for rate, _ in ran] == rates
    assert [p["broken"] for p in sweep["points"]] == [[], [], ["failed"], ["ttft"]]
    assert bench.why_broken(sweep["points"][3], slo) == "ttft p99 400.00 ms > 300 ms"
    assert sweep["summary"]["highest_holding"]["value"] == 2.0
    assert sweep["summary"]["first_broken"]["value"] == 4.0


def test_later_sweep_points_send_fresh_prompts_of_the_same_shape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prompt an earlier point sent would be a prefix-cache hit."""
    seen: list[list[bench.RequestSpec]] = []

    def fake_benchmark(config: bench.BenchConfig) -> bench.BenchmarkResult:
        seen.append(list(config.requests))
        return bench.BenchmarkResult([done(0.01, 0.01) for _ in config.requests], duration=1.0)

    monkeypatch.setattr(bench, "benchmark", fake_benchmark)
    reqs = [bench.RequestSpec(list(range(10 + i, 40 + i)), 30, 5) for i in range(6)]
    cfg = bench.BenchConfig("http://x", "m", reqs)
    bench.run_sweep(cfg, "max_concurrency", [4, 1, 2], {"ttft": 1000.0})
    assert len(seen) == 3 and seen[0] == reqs  # the first point: the dataset's own
    prompts = {tuple(r.prompt) for point in seen for r in point}
    assert len(prompts) == 18, "a prompt was sent at two points"
    for point in seen[1:]:
        assert [(len(r.prompt), r.prompt_len, r.output_len) for r in point] == [(30, 30, 5)] * 6


def test_a_refined_sweep_bisects_between_the_last_hold_and_the_first_break(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TTFT 50 ms per request/s against 310 ms holds up to 6 req/s: from a
    grid of 2 and 10, four more points at 6, 8, 7 and 6.5 close the bracket
    to 6 and 6.5. A concurrency (TTFT 100 ms each, against 450) stops once
    held and broken are 1 apart: 8, 4, 6, 5, then nothing left to halve."""
    ran: list[float] = []

    def fake_benchmark(config: bench.BenchConfig) -> bench.BenchmarkResult:
        value = config.request_rate if math.isfinite(config.request_rate) else 0.0
        load = value * 0.05 or 0.1 * (config.max_concurrency or 0)
        ran.append(value or float(config.max_concurrency or 0))
        return bench.BenchmarkResult([done(load, 0.01) for _ in config.requests], duration=1.0)

    monkeypatch.setattr(bench, "benchmark", fake_benchmark)
    reqs = [bench.RequestSpec(list(range(10 + i, 40 + i)), 30, 5) for i in range(4)]
    cfg = bench.BenchConfig("http://x", "m", reqs)
    sweep = bench.run_sweep(cfg, "request_rate", [10.0, 2.0], {"ttft": 310.0}, refine=4)
    assert ran == [2.0, 10.0, 6.0, 8.0, 7.0, 6.5]
    assert [(p["request_rate"], p["holds"]) for p in sweep["points"]] == [
        (2.0, True),
        (6.0, True),
        (6.5, False),
        (7.0, False),
        (8.0, False),
        (10.0, False),
    ]
    assert sweep["summary"]["highest_holding"]["value"] == 6.0
    assert sweep["summary"]["first_broken"]["value"] == 6.5
    assert (sweep["values"], sweep["refine"]) == ([2.0, 10.0], 4)

    ran.clear()
    sweep = bench.run_sweep(cfg, "max_concurrency", [1, 16], {"ttft": 450.0}, refine=9)
    assert ran == [1, 16, 8, 4, 6, 5]
    assert sweep["summary"]["highest_holding"]["value"] == 4
    assert sweep["summary"]["first_broken"]["value"] == 5
    # Nothing to bisect: every point held, or the first already broke.
    for rates, slo in (([1.0, 2.0], 1000.0), ([8.0, 9.0], 300.0)):
        ran.clear()
        bench.run_sweep(cfg, "request_rate", rates, {"ttft": slo}, refine=3)
        assert ran == rates[: 1 if slo == 300.0 else 2]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--sweep-request-rates", "1", "2"], "--sweep-request-rates needs --slo"),
        (["--sweep-max-concurrency", "1", "2"], "--sweep-max-concurrency needs --slo"),
        (
            ["--slo", "ttft=500", "--sweep-request-rates", "1", "--sweep-max-concurrency", "2"],
            "not allowed with argument",
        ),
        (["--slo", "ttft=500", "--sweep-max-concurrency", "4", "0"], "values must be > 0"),
        (["--slo", "ttft=500", "--sweep-all"], "--sweep-all needs"),
        (["--slo", "ttft=500", "--sweep-refine", "2"], "--sweep-refine needs"),
        (
            ["--slo", "ttft=500", "--sweep-request-rates", "1", "--sweep-refine", "-1"],
            "--sweep-refine must be >= 0",
        ),
    ],
)
def test_sweep_flags_need_slo_and_exclude_each_other(
    argv: list[str], message: str, tmp_path: Path
) -> None:
    # Nothing listens on port 1: a run that got past the flags would fail otherwise.
    base = ["--base-url", "http://127.0.0.1:1", "--model", "m", "--num-prompts", "2"]
    r, proc = run_tool(tmp_path / "r.jsonl", *base, *argv)
    assert (proc.returncode, r) == (2, None), proc.stderr
    assert message in proc.stderr


SWEEP_UNIT = Timing(0.04, 0.01)
"""The load-dependent fake server's TTFT and gap per stream in flight."""


class LoadedConnection(Connection):
    """A fake server's connection whose streams' TTFT and token gaps are
    ``SWEEP_UNIT`` times the streams in flight when each arrives (itself
    included): at concurrency C, at most C times the unit's."""

    in_flight = 0
    """Streams of this server process (one event loop)."""

    def completion(self, raw: bytes, chat: bool) -> None:
        LoadedConnection.in_flight += 1
        k = LoadedConnection.in_flight
        self.timing = Timing(SWEEP_UNIT.ttft_s * k, SWEEP_UNIT.gap_s * k)
        super().completion(raw, chat)

    def stream_done(self) -> None:
        LoadedConnection.in_flight -= 1
        super().stream_done()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.stream is not None:
            LoadedConnection.in_flight -= 1
        super().connection_lost(exc)


def _serve_loaded(sock: Any) -> None:
    async def serve() -> None:
        stats = ServerStats()
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: LoadedConnection(SWEEP_UNIT, stats), sock=sock)
        await server.serve_forever()

    asyncio.run(serve())


@pytest.fixture(scope="module")
def loaded_server() -> Iterator[str]:
    """Listening before the fork, as ``serve_in_process``: no start-up wait."""
    sock = listening_socket()
    proc = multiprocessing.get_context("fork").Process(
        target=_serve_loaded, args=(sock,), daemon=True
    )
    proc.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()
        proc.kill()
        proc.join(10)


@pytest.mark.parametrize(
    "slo, objective, sweep_all",
    [("ttft=320", "ttft", False), ("ttft=5000,tpot=80", "tpot", True)],
)
def test_the_tool_sweeps_concurrency_up_to_the_first_broken_objective(
    loaded_server: str, slo: str, objective: str, sweep_all: bool, tmp_path: Path
) -> None:
    """16 requests at once against the load-dependent server. Concurrency 1
    and 4: TTFT <= 160 ms and TPOT <= 40 ms, both half their objective; 16:
    all in flight, the slowest request's TTFT is about 640 ms and TPOT 160 ms,
    twice their objective. The sweep stops there, unless --sweep-all runs 64;
    then one bisection point, 10 (TTFT about 400 ms, TPOT 100 ms), breaks too."""
    argv = ["--base-url", loaded_server, "--num-prompts", "16", "--random-input-len", "4"]
    argv += ["--random-output-len", "4", "--sweep-max-concurrency", "16", "64", "1", "4"]
    argv += ["--slo", slo, "--label", "sweep", *(["--sweep-all"] if sweep_all else [])]
    argv += ["--sweep-refine", "1"]
    r, proc = run_tool(tmp_path / "r.jsonl", *argv)
    assert proc.returncode == 0 and r is not None, f"{proc.stdout}\n{proc.stderr}"
    sweep = r["sweep"]
    points = sweep["points"]
    ran = [1, 4, 10, 16, 64] if sweep_all else [1, 4, 10, 16]
    assert [p["max_concurrency"] for p in points] == ran
    assert [p["broken"] for p in points] == [[], []] + [[objective]] * (len(ran) - 2)
    assert all((p["completed"], p["failed"], p["request_rate"]) == (16, 0, "inf") for p in points)
    held = points[1]
    assert held["request_goodput"] == pytest.approx(held["request_throughput"])
    assert sweep["summary"] == {
        "highest_holding": {
            "value": 4,
            "output_throughput": held["output_throughput"],
            "request_goodput": held["request_goodput"],
        },
        "first_broken": {
            "value": 10,
            "broken": [objective],
            "reason": bench.why_broken(points[2], bench.parse_slo(slo)),
        },
    }
    # The record keeps a plain run's fields; the concurrencies asked for, in order.
    assert r["max_concurrency"] == sweep["values"] == [1, 4, 16, 64]
    assert sweep["refine"] == 1
    assert r["label"] == "sweep" and r["workload"]["num_prompts"] == 16
    assert r["date"] and r["git_commit"] and r["machine"]["python"]
    assert (
        "--sweep-max-concurrency 16 64 1 4" in r["command"] and "--sweep-refine 1" in r["command"]
    )
    assert "Goodput Sweep" in proc.stdout
    assert "Highest max concurrency that held: 4 (output " in proc.stdout
    assert f"First max concurrency that broke: 10 ({objective} p99 " in proc.stdout


# -- dummy model ---------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["llama-3.1-8b", "qwen3-0.6b"])
def test_dummy_model_tokenizer_covers_the_vocab(preset: str, tmp_path: Path) -> None:
    d = write_dummy_model(preset, tmp_path / preset)
    mc = ModelConfig.load(d)
    assert mc == ModelConfig.load(preset)
    tok = Tokenizer.from_dir(d)
    v = mc.vocab_size
    specials = {*mc.eos_token_ids, mc.bos_token_id}
    for i in [0, 1, 2, 100, v // 2, v - 2, v - 1, *specials]:
        assert tok.decode([i]), i
        if i not in specials:
            assert tok.decode([i], skip_special_tokens=True)
    for i in specials:
        assert tok.decode([i], skip_special_tokens=True) == ""
    assert tok.encode("t5 t77", add_special_tokens=False) == [5, 77]
    assert tok.decode([5, 77]) == "t5 t77"
    # Printable ASCII has a token each, so constrained decoding can spell JSON.
    text = '{"ok": [true, 1.5e-3]}'
    vocab = json.loads((d / "tokenizer.json").read_text())["model"]["vocab"]
    ids = [vocab[c] for c in text]
    assert len(set(ids)) == len(set(text)) and tok.decode(ids) == text
    assert len(tok.encode("some words nobody knows", add_special_tokens=False)) == 4
    assert tok.apply_chat_template([{"role": "user", "content": "t5"}], add_generation_prompt=True)


# -- the real gateway ----------------------------------------------------------------


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """``python -m gateway`` with its embedded tiny prefill and decode workers."""
    log_path = tmp_path_factory.mktemp("gateway") / "gateway.log"
    with launch_gateway([], log_path, GATEWAY_START_TIMEOUT_S, CPU_ENV) as (url, _):
        yield url, log_path


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["openai-completions", "openai-chat"])
def test_against_the_gateway(gateway: tuple[str, Path], backend: str, tmp_path: Path) -> None:
    url, log_path = gateway
    plot = tmp_path / "x.png"
    argv = ["--base-url", url, "--backend", backend, "--num-prompts", "8"]
    argv += ["--random-input-len", "32", "--random-output-len", "8", "--ignore-eos"]
    argv += ["--request-rate", "inf", "--max-concurrency", "4", "--warmup-requests", "2"]
    argv += ["--plot", str(plot), "--label", "ci"]
    argv += ["--metadata", "deployment=embedded", "note=a=b"]
    try:
        r, proc = run_tool(tmp_path / "x.jsonl", *argv)
        assert proc.returncode == 0 and r is not None, f"{proc.stdout}\n{proc.stderr}"
        assert "Serving Benchmark Result" in proc.stdout
        assert not [k for k in REQUIRED_KEYS if k not in r]
        assert (r["completed"], r["failed"]) == (8, 0), r["errors"]
        assert r["total_output_tokens"] == 8 * 8
        assert r["output_tokens_from_chunks"] is False
        assert r["label"] == "ci" and r["backend"] == backend and r["model"]
        assert r["metadata"] == {"deployment": "embedded", "note": "a=b"}
        assert r["workload"]["dataset_name"] == "random"
        assert r["workload"]["num_prompts"] == 8
        assert r["command"].startswith("python -m benchmarks.bench_serving --base-url")
        assert r["machine"]["python"]
        for key in REQUIRED_KEYS:
            if key.endswith("_ms") or key.endswith("throughput"):
                assert r[key] > 0, key
        assert plot.read_bytes().startswith(b"\x89PNG")
    except BaseException:
        print(f"----- gateway log -----\n{log_tail(log_path)}")
        raise


# -- compare_pd ------------------------------------------------------------------------


def _compare_pd_on_cpu(tmp_path: Path) -> tuple[str, Path, list[str]]:
    """(a marker in every process's command line, the JSON lines file, the
    command up to its benchmark options): compare_pd on the CPU with a
    tiny-shaped dummy model, 4 prompts of 16 tokens in, 4 out."""
    marker = f"bench-dummy-{uuid.uuid4().hex[:8]}"
    cfg_path = tmp_path / f"{marker}.json"
    cfg_path.write_text(json.dumps({**MODEL_CONFIG, "vocab_size": 1000}))
    out = tmp_path / "pd.jsonl"
    cmd = [sys.executable, "-m", "benchmarks.compare_pd", "--dummy-preset", str(cfg_path)]
    cmd += ["--prefill-device", "cpu", "--decode-device", "cpu", "--colocated-device", "cpu"]
    cmd += ["--transfer-backend", "tcp", "--output-file", str(out), "--"]
    cmd += ["--num-prompts", "4", "--random-input-len", "16", "--random-output-len", "4"]
    return marker, out, cmd


@pytest.mark.e2e
def test_compare_pd_smoke(tmp_path: Path) -> None:
    """Both deployments on a tiny-shaped dummy model (config.json + synthetic
    tokenizer only): the workers accept the directory, the gateway serves its
    tokenizer, and every process is gone afterwards."""
    marker, out, cmd = _compare_pd_on_cpu(tmp_path)
    cmd += ["--ignore-eos", "--disable-progress"]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env={**os.environ, **CPU_ENV},
        text=True,
    )
    try:
        output, _ = proc.communicate(timeout=COMPARE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # compare_pd stops its processes on SIGTERM
        output, _ = proc.communicate(timeout=60)
        pytest.fail(f"compare_pd did not finish in {COMPARE_TIMEOUT_S}s:\n{output[-6000:]}")
    assert not procs_mentioning(marker), "compare_pd left processes running"
    records = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    assert [r["label"] for r in records][:1] == ["pd"], output[-6000:]
    assert records[0]["completed"] == 4 and records[0]["failed"] == 0
    assert records[0]["total_output_tokens"] == 16
    assert records[0]["model"] == marker
    assert records[0]["metadata"]["prefill_device"] == "cpu"
    assert records[0]["metadata"]["load_format"] == "dummy"
    assert proc.returncode == 0, output[-6000:]
    assert [r["label"] for r in records] == ["pd", "colocated"]
    assert records[1]["completed"] == 4 and records[1]["failed"] == 0
    lines = output.splitlines()
    header = [i for i, line in enumerate(lines) if line.split() == ["disaggregated", "colocated"]]
    assert header, output[-3000:]
    rows = {line[:34].strip(): line[34:].split() for line in lines[header[-1] + 2 :]}
    assert rows["Successful requests"] == ["4", "4"]
    assert rows["Failed requests"] == ["0", "0"]
    assert len(rows["Mean TTFT (ms)"]) == len(rows["Output token throughput (tok/s)"]) == 2


def test_warmup_requests_are_shaped_like_the_measured_ones_but_share_no_prefix() -> None:
    """Warm-ups must not put measured prompts into the server's prefix cache
    (their TTFT would then be a cache hit's): same lengths and kind, other
    tokens; deterministic for one seed."""
    rng = random.Random(1)
    measured = [
        bench.RequestSpec([rng.randrange(10, 32000) for _ in range(n)], n, 7) for n in (64, 200)
    ] + [bench.RequestSpec("the cat sat on the mat " * 5, 30, 9)]
    cfg = bench.BenchConfig(base_url="http://x", model="m", requests=measured, warmup_requests=5)
    warm = cfg.warmup
    assert len(warm) == 5 and warm == bench.warmup_specs(measured, 5, cfg.seed)
    for w, src in zip(warm, measured * 2):
        assert (w.prompt_len, w.output_len, type(w.prompt)) == (
            src.prompt_len,
            src.output_len,
            type(src.prompt),
        )
        if isinstance(w.prompt, list):
            assert len(w.prompt) == len(src.prompt) and max(w.prompt) <= max(src.prompt)
            assert all(w.prompt[:16] != m.prompt[:16] for m in measured)
        else:
            assert len(w.prompt.split()) == len(src.prompt.split())
            assert all(w.prompt.split()[:16] != str(m.prompt).split()[:16] for m in measured)


def test_compare_pd_refuses_a_bad_sweep_before_starting_anything() -> None:
    sweep = ["--slo", "ttft=500", "--sweep-all"]  # --sweep-all with nothing to sweep
    cmd = [sys.executable, "-m", "benchmarks.compare_pd", "--dummy-preset", "llama-3.1-8b", "--"]
    proc = subprocess.run([*cmd, *sweep], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "--sweep-all needs" in proc.stderr


@pytest.mark.e2e
def test_compare_pd_sweeps_goodput_on_both_deployments(tmp_path: Path) -> None:
    """With a goodput sweep, each deployment runs it whole and the table
    gives each one's highest point that held, side by side."""
    marker, out, cmd = _compare_pd_on_cpu(tmp_path)
    cmd += ["--ignore-eos", "--disable-progress", "--slo", "ttft=60000,e2el=1"]
    cmd += ["--sweep-max-concurrency", "1", "2", "--sweep-all"]
    proc = subprocess.run(
        cmd, cwd=REPO, env={**os.environ, **CPU_ENV}, capture_output=True, text=True,
        timeout=COMPARE_TIMEOUT_S,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert not procs_mentioning(marker), "compare_pd left processes running"
    assert proc.returncode == 0, output[-6000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["label"] for r in records] == ["pd", "colocated"]
    for r in records:
        points = r["sweep"]["points"]
        assert [p["max_concurrency"] for p in points] == [1, 2]
        assert all(p["completed"] == 4 and not p["holds"] for p in points)  # e2el <= 1 ms: never
    lines = proc.stdout.splitlines()
    title = [i for i, line in enumerate(lines) if line.startswith("Goodput over max concurrency")]
    assert title, output[-3000:]
    assert "p99 ttft <= 60000 ms, p99 e2el <= 1 ms" in lines[title[-1]]
    assert lines[title[-1] + 1].split() == ["disaggregated", "colocated"]
    rows = {line[:34].strip(): line[34:].split() for line in lines[title[-1] + 3 :]}
    assert rows["Highest max concurrency that held"] == ["-", "-"]
    assert rows["First max concurrency that broke"] == ["1", "1"]
    assert rows["broken by"] == ["e2el", "e2el"]
