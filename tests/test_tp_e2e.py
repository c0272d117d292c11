"""Tensor-parallel workers end to end (CPU, gloo; tcp and nccl KV transfer): prefill
and decode at different TP sizes behind the real gateway give the colocated
one-device engine's greedy tokens; a decode engine whose handshake cannot map
onto a prefill group is refused with a message naming the fields; a killed
rank ends its worker's requests with errors and leaves no process behind.

The four workers (prefill TP 1 and 2, decode TP 1 and 2) and one gateway per
pairing start once for the module. After every test every worker is idle with
its whole KV pool available again; logs are printed when a test fails."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from workers import (
    Worker,
    dump_log,
    free_port,
    launch_gateway,
    launch_worker,
    launch_workers,
    worker_cmd,
)

from engine.llm import LLM
from engine.tiny import TINY_MODEL_NAME
from kvtransfer import make_backend, to_prefill
from kvtransfer.decode_side import DecodeKVPlane, PeerFailed
from protocol.auth import keys_for
from protocol.client import WorkerClient, WorkerError
from protocol.sampling import SamplingParams
from protocol.to_worker import Generate
from worker.cli import CLUSTER_TOKEN_ENV

pytestmark = pytest.mark.e2e

TOKEN = "tp-e2e-secret"
ENGINE: dict[str, Any] = dict(
    page_size=4,
    num_pages=128,
    context_length=128,
    chunk_size=8,
    max_num_batched_tokens=32,
    transfer_backend="tcp",
    transfer_timeout_s=20,
)
ENV = {CLUSTER_TOKEN_ENV: TOKEN, "OMP_NUM_THREADS": "1"}
PAIRS = {"p1-d2": ("p1", "d2"), "p2-d1": ("p2", "d1"), "p2-d2": ("p2", "d2")}
DRAIN_TIMEOUT_S = 20.0
PROMPTS = [[(7 * i + 3 * j) % 500 + 3 for j in range(n)] for i, n in enumerate((5, 13, 22, 37))]

LOGS: list[Path] = []


class Served:
    def __init__(self, backend: str, workers: dict[str, Worker], gateways: dict[str, str]) -> None:
        self.backend = backend
        self.workers = workers
        self.gateways = gateways


@pytest.fixture(scope="module", params=["tcp", "nccl"])
def served(
    request: pytest.FixtureRequest, model_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    """The four workers and the gateways, once per KV transfer backend (tcp,
    and nccl through its gloo twin)."""
    backend = request.param
    log_dir = tmp_path_factory.mktemp(f"tp-e2e-{backend}")
    specs, names = [], []
    for name, module, role, tp in (
        ("p1", "prefill_server", "prefill", 1),
        ("p2", "prefill_server", "prefill", 2),
        ("d1", "decode_server", "decode", 1),
        ("d2", "decode_server", "decode", 2),
    ):
        port = free_port()
        flags = ("--served-model-name", TINY_MODEL_NAME)
        engine = {**ENGINE, "transfer_backend": backend}
        cmd = worker_cmd(module, model_dir, port, role=role, flags=flags, tp_size=tp, **engine)
        specs.append((cmd, port, log_dir / f"{name}.log", ENV))
        names.append(name)
    with launch_workers(specs) as started, contextlib.ExitStack() as stack:
        workers = dict(zip(names, started))
        LOGS.extend(w.log_path for w in started)
        gateways = {}
        for pair, (p, d) in PAIRS.items():
            args = ["--prefill", workers[p].url, "--decode", workers[d].url]
            gw_log = log_dir / f"gateway-{pair}.log"
            url, _ = stack.enter_context(
                launch_gateway([*args, "--log-level", "warning"], gw_log, 60, ENV)
            )
            LOGS.append(gw_log)
            gateways[pair] = url
        yield Served(backend, workers, gateways)
    LOGS.clear()


def _drained(w: Worker) -> dict[str, Any] | None:
    s = w.stats()
    start = w.start_info["stats"]
    idle = (
        s["running"] == s["waiting"] == s["in_flight"] == s.get("rooms", 0) == 0
        and s.get("transferring", 0) == s.get("prealloc", 0) == 0
        and s["available_pages"] == s["total_pages"] == start["available_pages"]
    )
    return None if idle else s


@pytest.fixture(autouse=True)
def _drain_check(request: pytest.FixtureRequest) -> Iterator[None]:
    failed_before = request.session.testsfailed
    try:
        yield
        if "served" in request.fixturenames:
            served: Served = request.getfixturevalue("served")
            deadline = time.monotonic() + DRAIN_TIMEOUT_S
            for w in served.workers.values():
                while (last := _drained(w)) is not None:
                    assert time.monotonic() < deadline, f"{w.name} did not drain: {last}"
                    time.sleep(0.05)
    finally:
        if request.session.testsfailed > failed_before:
            for path in LOGS:
                dump_log(request.config, path, 120)


@pytest.fixture(scope="module")
def reference(model_dir: str) -> list[list[int]]:
    """Greedy tokens of the colocated one-device engine."""
    llm = LLM(model_dir, device="cpu", page_size=4, num_pages=128, context_length=128)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, params)]


def test_workers_report_their_groups(served: Served) -> None:
    for name, w in served.workers.items():
        info = w.info()
        tp = int(name[1])
        assert info["tp_size"] == tp
        assert len(info["rank_pids"]) == tp - 1


@pytest.mark.parametrize("pair", list(PAIRS))
def test_greedy_tokens_equal_colocated_one_device(
    served: Served, reference: list[list[int]], pair: str
) -> None:
    url = served.gateways[pair]

    def complete(prompt: list[int]) -> list[int]:
        body = {
            "model": TINY_MODEL_NAME,
            "prompt": prompt,
            "max_tokens": 10,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        resp = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["token_ids"]

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(complete, PROMPTS))
    assert got == reference
    p, d = PAIRS[pair]
    assert served.workers[p].stats()["transfers_ok"] >= len(PROMPTS)


def test_unmappable_decode_group_is_refused_at_the_handshake(served: Served) -> None:
    """A decode engine that claims two ranks but names the agent of one: no
    prefill rank could write the heads of the other."""
    p2 = served.workers["p2"]
    assert p2.bootstrap is not None
    kv = torch.zeros(64, dtype=torch.uint8)
    backend = make_backend(served.backend, "rogue-decode", host="127.0.0.1", cluster_token=TOKEN)
    backend.register(kv)
    compat = _two_rank_compat(served.backend)
    plane = DecodeKVPlane("127.0.0.1", 0, backend, compat, TOKEN, 10.0)
    try:
        plane.send(p2.bootstrap, to_prefill.AbortRoom("no-such-room"))
        deadline = time.monotonic() + 10
        events: list[Any] = []
        while not events:
            assert time.monotonic() < deadline, "no handshake answer"
            events = plane.poll()
            time.sleep(0.01)
        (_, event), *_ = events
        assert isinstance(event, PeerFailed), event
        assert "incompatible" in event.reason
        assert "tp_size" in event.reason and "rank agent" in event.reason, event.reason
    finally:
        plane.close()


def _two_rank_compat(backend: str) -> dict[str, str]:
    """The compat record of a decode engine of the tiny model at TP 2."""
    from worker.kv_setup import engine_compat

    llm = LLM(None, device="cpu", page_size=4, num_pages=8, context_length=128)
    compat = engine_compat(llm.engine, backend)
    compat["tp_size"] = "2"
    compat["kv_head_ranges"] = "0-1,1-2"
    compat["page_bytes"] = str(int(compat["page_bytes"]) // 2)
    return compat


def test_killed_rank_fails_the_worker_cleanly(
    model_dir: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    port = free_port()
    log = tmp_path / "both-tp2.log"
    engine = {k: v for k, v in ENGINE.items() if not k.startswith("transfer")}
    cmd = worker_cmd("decode_server", model_dir, port, role="both", tp_size=2, **engine)
    failed_before = request.session.testsfailed
    with launch_worker(cmd, port, log, ENV, new_session=True) as w:
        try:
            (rank_pid,) = w.info()["rank_pids"]

            async def run() -> tuple[Any, float]:
                client = WorkerClient(w.endpoint, timeout_s=30, auth=keys_for(TOKEN))
                try:
                    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
                    gen = client.generate(Generate("killed-rank", PROMPTS[1], params))
                    first = await gen.__anext__()
                    assert first.finish_reason is None
                    os.kill(rank_pid, 9)
                    t0 = time.monotonic()
                    try:
                        async for d in gen:
                            if d.finish_reason is not None:
                                return d, time.monotonic() - t0
                    except WorkerError as e:
                        return e, time.monotonic() - t0
                    raise AssertionError("the stream ended without a final delta")
                finally:
                    await client.close()

            end, took = asyncio.run(run())
            assert took < 10, took
            if not isinstance(end, WorkerError):
                assert end.finish_reason == "error", end
            w.proc.wait(30)
            assert w.proc.returncode not in (None, 0)
            for pid in (rank_pid, w.proc.pid):
                assert not _alive(pid), f"process {pid} outlived the worker"
            assert "tensor-parallel rank 1" in log.read_text()
        finally:
            if request.session.testsfailed > failed_before:
                dump_log(request.config, log, 120)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for every purpose but its exit status.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False
