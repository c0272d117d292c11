"""Reliability against a real worker process: a requester that dies (SIGKILL,
no abort sent) leaves no request running on the worker, and its KV pages come
back."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from workers import REPO, Worker, dump_log, free_port, launch_worker, worker_cmd

from worker.config import CLUSTER_TOKEN_ENV

pytestmark = pytest.mark.e2e

TOKEN = "reliability-e2e-secret"
CONTEXT = 1 << 16
"""The worker's context (and KV pool, in one-token pages), all of it the
request's: one engine step a token, 65536 steps take minutes on a CPU, and
still several requester timeouts at a tenth of a millisecond a step (steps
grow slower with the context, too)."""
REQUESTER_TIMEOUT_S = 2.0

_REQUESTER = textwrap.dedent(
    """
    import asyncio, sys
    from protocol.auth import keys_for
    from protocol.client import WorkerClient
    from protocol.sampling import SamplingParams
    from protocol.to_worker import Generate

    async def main() -> None:
        spec = SamplingParams(max_tokens=int(sys.argv[3]), temperature=0.0, ignore_eos=True)
        async with WorkerClient(sys.argv[1], auth=keys_for(sys.argv[2])) as client:
            async for delta in client.generate(Generate("orphan", [1, 2, 3, 4], spec)):
                if delta.token_ids:
                    print("streaming", flush=True)
                    await asyncio.sleep(3600)
                print(delta, flush=True)

    asyncio.run(main())
    """
)


@pytest.fixture(scope="module")
def worker(
    model_dir: str, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Worker]:
    tmp = tmp_path_factory.mktemp("reliability")
    log_path = tmp / "worker.log"
    # The tiny model with a longer context (its positions' table is computed
    # from it; the weights do not depend on it).
    long_model = tmp / "tiny-long"
    shutil.copytree(model_dir, long_model)
    config = json.loads((long_model / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT
    (long_model / "config.json").write_text(json.dumps(config))
    port = free_port()
    cmd = worker_cmd(
        "decode_server",
        str(long_model),
        port,
        page_size=1,
        num_pages=CONTEXT + 1,  # page 0 is reserved
        requester_timeout_s=REQUESTER_TIMEOUT_S,
    )
    failed = request.session.testsfailed
    try:
        with launch_worker(cmd, port, log_path, {CLUSTER_TOKEN_ENV: TOKEN}) as w:
            yield w
    finally:
        if request.session.testsfailed > failed:
            dump_log(request.config, log_path)


def test_killed_requester_leaves_no_request_running(worker: Worker, tmp_path: Path) -> None:
    assert worker.start_info["max_model_len"] == CONTEXT
    free = worker.stats()["available_pages"]
    # The whole context: the request cannot end on its own before the
    # requester timeout, only by the orphan abort.
    max_tokens = CONTEXT
    proc = subprocess.Popen(
        [sys.executable, "-c", _REQUESTER, worker.endpoint, TOKEN, str(max_tokens)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line == "streaming", proc.stderr.read() if proc.stderr else ""
        assert worker.stats()["in_flight"] == 1
        proc.kill()  # no Abort is ever sent
        proc.wait(10)
        t0 = time.monotonic()
        stats = worker.wait_stats(
            lambda s: s["in_flight"] == 0 and s["running"] == 0, "orphan aborted", timeout=10
        )
        assert time.monotonic() - t0 < 10
        assert stats["orphans_aborted_total"] == 1
        # Its pages are free again (or held by the prefix cache, evictable).
        worker.wait_stats(lambda s: s["available_pages"] == free, "pages back", timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
