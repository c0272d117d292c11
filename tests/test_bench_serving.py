"""``benchmarks/bench_serving.py``, ``compare_pd.py`` and ``dummy_model.py``.

Metric arithmetic is checked against a fake OpenAI server (in a thread) whose
timing is known: a fixed time to first token, fixed gaps between one-token
chunks, and prompt markers that slow a request down, fail it or drop its usage
chunk. Then the benchmark runs against the real gateway (embedded tiny
workers, CPU), and compare_pd runs both deployments on a tiny dummy model.
"""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing
import os
import random
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from workers import REPO, launch_gateway, log_tail

from benchmarks import bench_serving as bench
from benchmarks import compare_pd
from benchmarks.dummy_model import write_dummy_model
from engine.model_config import ModelConfig
from engine.tiny import MODEL_CONFIG
from gateway.text import Tokenizer

TTFT_S = 0.8
GAP_S = 0.1
FAIL_TTFT_S = 0.05
"""First chunk of a request that then fails: far from TTFT_S, so a failed
request leaking into the averages moves them well past the tolerance."""
N_TOKENS = 8
REL = 0.05
GATEWAY_START_TIMEOUT_S = 120.0
COMPARE_TIMEOUT_S = 180.0
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


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _fake_stream(body: dict[str, Any], chat: bool, t0: float) -> AsyncIterator[str]:
    """The events of one request; ``t0``: when its first bytes arrived (loop time)."""
    prompt = body["messages"][-1]["content"] if chat else body["prompt"]
    text = prompt if isinstance(prompt, str) else ""
    ttft = FAIL_TTFT_S if "@failchunk" in text else TTFT_S * (2 if "@slow" in text else 1)
    loop = asyncio.get_running_loop()
    if chat:  # an empty role chunk first, as real servers send: not a token
        yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    n = body["max_tokens"]
    for k in range(n):
        # Absolute times: scheduling delays do not add up over the stream.
        await asyncio.sleep(max(0.0, t0 + ttft + k * GAP_S - loop.time()))
        if "@failchunk" in text and k == 1:
            yield _sse({"error": {"message": "injected failure", "type": "server_error"}})
            yield "data: [DONE]\n\n"
            return
        content = f" w{k}"
        choice = {"index": 0, "delta": {"content": content}} if chat else {"text": content}
        yield _sse({"choices": [{**choice, "finish_reason": None}], "usage": None})
    if "@nousage" not in text:
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(text.split())
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n}
        yield _sse({"choices": [], "usage": usage})
    yield "data: [DONE]\n\n"


def _response_head(status: int, content_type: str, length: int | None = None) -> bytes:
    size = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return f"HTTP/1.1 {status} X\r\nContent-Type: {content_type}\r\n{size}\r\n\r\n".encode()


async def _fake_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A minimal HTTP/1.1 keep-alive server: a web framework's own latency (and
    its jitter on a loaded machine) would land in the timings under test."""
    loop = asyncio.get_running_loop()
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            t0 = loop.time()
            request_line, *header_lines = head.decode().split("\r\n")
            path = request_line.split(" ")[1]
            headers = dict(h.lower().split(":", 1) for h in header_lines if h)
            raw = await reader.readexactly(int(headers.get("content-length", 0)))
            if path == "/v1/models":
                models = {"object": "list", "data": [{"id": "fake-model", "max_model_len": 4096}]}
                payload = json.dumps(models).encode()
                writer.write(_response_head(200, "application/json", len(payload)) + payload)
                continue
            body, chat = json.loads(raw), path == "/v1/chat/completions"
            last = body["messages"][-1]["content"] if chat else body["prompt"]
            if isinstance(last, str) and "@fail500" in last:
                payload = b'{"error": {"message": "injected 500"}}'
                writer.write(_response_head(500, "application/json", len(payload)) + payload)
                continue
            writer.write(_response_head(200, "text/event-stream"))
            async for event in _fake_stream(body, chat, t0):
                data = event.encode()
                writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                await writer.drain()
            writer.write(b"0\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


def _serve(sock: socket.socket) -> None:
    async def serve() -> None:
        server = await asyncio.start_server(_fake_connection, sock=sock)
        await server.serve_forever()

    asyncio.run(serve())


@pytest.fixture(scope="module")
def fake_server() -> Iterator[str]:
    # A process of its own: in a thread of this one, the server and the
    # benchmark client would take turns on the GIL (5 ms switch interval),
    # blurring the timing under test. The socket listens before the fork, so
    # clients can connect at once (queued in the backlog): no start-up wait.
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(256)
    server = multiprocessing.get_context("fork").Process(target=_serve, args=(sock,), daemon=True)
    server.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()
        server.terminate()
        server.join(10)
        if server.is_alive():
            server.kill()
            server.join(10)


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


@pytest.mark.parametrize("backend", ["openai-completions", "openai-chat"])
def test_metrics_match_known_timing(fake_server: str, backend: str) -> None:
    concurrency, n = 4, 16
    r = bench.main(
        ["--base-url", fake_server, "--backend", backend, "--num-prompts", str(n)]
        + ["--max-concurrency", str(concurrency), "--random-input-len", "8"]
        + ["--random-output-len", str(N_TOKENS), "--no-output", "--disable-progress"]
        + ["--warmup-requests", str(concurrency)]
    )
    assert r["model"] == "fake-model"
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
    return bench.build_parser().parse_args(list(argv))


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
    text = bench.sample_requests(parse("--random-input-len", "9", "--backend", "openai-chat"))
    assert all(isinstance(s.prompt, str) and len(s.prompt.split()) == 9 for s in text)
    with pytest.raises(ValueError, match="token-id"):
        bench.sample_requests(
            parse("--backend", "openai-chat", "--random-prompt-kind", "token-ids")
        )


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


def test_sharegpt_missing_file_errors_clearly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(FileNotFoundError, match="ShareGPT file not found"):
        bench.sample_requests(parse("--dataset-name", "sharegpt", "--dataset-path", str(missing)))
    with pytest.raises(SystemExit) as exc:
        bench.main(["--dataset-name", "sharegpt", "--dataset-path", str(missing), "--no-output"])
    assert exc.value.code == 2
    assert f"ShareGPT file not found: {missing}" in capsys.readouterr().err


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
    out, plot = tmp_path / "x.jsonl", tmp_path / "x.png"
    argv = ["--base-url", url, "--backend", backend, "--num-prompts", "8"]
    argv += ["--random-input-len", "32", "--random-output-len", "8", "--ignore-eos"]
    argv += ["--request-rate", "inf", "--max-concurrency", "4", "--warmup-requests", "2"]
    argv += ["--output-file", str(out), "--plot", str(plot), "--label", "ci"]
    argv += ["--metadata", "deployment=embedded", "note=a=b"]
    try:
        returned = bench.main(argv)
        lines = out.read_text().splitlines()
        assert len(lines) == 1
        r = json.loads(lines[0])
        assert r == json.loads(json.dumps(returned))
        assert not [k for k in REQUIRED_KEYS if k not in r]
        assert (r["completed"], r["failed"]) == (8, 0), r["errors"]
        assert r["total_output_tokens"] == 8 * 8
        assert r["output_tokens_from_chunks"] is False
        assert r["label"] == "ci" and r["backend"] == backend and r["model"]
        assert r["metadata"] == {"deployment": "embedded", "note": "a=b"}
        assert r["workload"]["dataset_name"] == "random"
        assert r["workload"]["num_prompts"] == 8
        assert r["command"].startswith("bench_serving.py --base-url")
        assert r["machine"]["python"]
        for key in REQUIRED_KEYS:
            if key.endswith("_ms") or key.endswith("throughput"):
                assert r[key] > 0, key
        assert plot.read_bytes().startswith(b"\x89PNG")
    except BaseException:
        print(f"----- gateway log -----\n{log_tail(log_path)}")
        raise


# -- compare_pd ------------------------------------------------------------------------


def test_comparison_table_lists_both_deployments() -> None:
    rec = {key: 1.5 for _, key in compare_pd.ROWS} | {"request_goodput": None}
    table = compare_pd.comparison_table({"pd": rec, "colocated": {**rec, "completed": 4}})
    header, rule, *rows = table.splitlines()
    assert header.split() == ["disaggregated", "colocated"]
    assert len(rows) == len(compare_pd.ROWS)
    assert any(
        row.startswith("Mean TTFT (ms)") and row.split()[-2:] == ["1.50", "1.50"] for row in rows
    )
    assert any(row.startswith("Successful requests") and row.split()[-1] == "4" for row in rows)


def _procs_mentioning(marker: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker in cmdline.read_bytes().decode(errors="replace"):
                found.append(cmdline.parent.name)
        except OSError:
            continue
    return found


@pytest.mark.e2e
def test_compare_pd_smoke(tmp_path: Path) -> None:
    """Both deployments on a tiny-shaped dummy model (config.json + synthetic
    tokenizer only): the workers accept the directory, the gateway serves its
    tokenizer, and every process is gone afterwards."""
    marker = f"bench-dummy-{uuid.uuid4().hex[:8]}"
    cfg_path = tmp_path / f"{marker}.json"
    cfg_path.write_text(json.dumps({**MODEL_CONFIG, "vocab_size": 1000}))
    out = tmp_path / "pd.jsonl"
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "compare_pd.py"),
        "--dummy-preset",
        str(cfg_path),
    ]
    cmd += ["--prefill-device", "cpu", "--decode-device", "cpu", "--colocated-device", "cpu"]
    cmd += ["--transfer-backend", "tcp", "--output-file", str(out), "--"]
    cmd += ["--num-prompts", "4", "--random-input-len", "16", "--random-output-len", "4"]
    cmd += ["--ignore-eos", "--disable-progress"]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
        env={**os.environ, **CPU_ENV},
        text=True,
    )
    try:
        output, _ = proc.communicate(timeout=COMPARE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # compare_pd stops its processes on SIGTERM
        output, _ = proc.communicate(timeout=60)
        pytest.fail(f"compare_pd did not finish in {COMPARE_TIMEOUT_S}s:\n{output[-6000:]}")
    assert not _procs_mentioning(marker), "compare_pd left processes running"
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
    assert len(rows["Mean TTFT (ms)"]) == len(rows["Output token throughput (tok/s)"]) == 2
