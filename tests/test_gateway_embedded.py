"""``python -m gateway`` with no workers given: it starts a prefill and a decode
worker on the built-in tiny model, serves, and stops everything on a signal."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
from workers import launch_gateway, log_tail

from worker.config import CLUSTER_TOKEN_ENV

pytestmark = pytest.mark.e2e

START_TIMEOUT_S = 120.0
"""The gateway plus two workers loading the model on a small CPU machine."""
EXIT_TIMEOUT_S = 30.0
TOKEN = "embedded-test-token"


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a parent that never reaps counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_embedded_default_serves_and_stops_cleanly(sig: signal.Signals, tmp_path: Path) -> None:
    log_path = tmp_path / "gateway.log"
    env = {"OMP_NUM_THREADS": "1", CLUSTER_TOKEN_ENV: TOKEN}
    with launch_gateway([], log_path, START_TIMEOUT_S, env) as (url, proc):
        # The embedded workers take the given cluster token, which is also the
        # admin key (the admin API is never open).
        headers = {"Authorization": f"Bearer {TOKEN}"}
        assert httpx.get(f"{url}/admin/workers", timeout=10).status_code == 401
        workers = httpx.get(f"{url}/admin/workers", headers=headers, timeout=10).json()["workers"]
        assert sorted(w["role"] for w in workers) == ["decode", "prefill"]
        pids = []
        for w in workers:
            info = httpx.get(f"{w['url']}/server_info", timeout=10).json()
            pids += [info["front_pid"], info["engine_pid"]]
        assert all(_alive(p) for p in pids)

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        (model,) = [m.id for m in client.models.list().data]
        resp = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert resp.usage.completion_tokens == 8 and resp.choices[0].message.content

        proc.send_signal(sig)
        assert proc.wait(timeout=EXIT_TIMEOUT_S) == 0, log_tail(log_path)
        # The workers went down with it: no process of theirs is left.
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids):
            assert time.monotonic() < deadline, f"workers outlived the gateway: {pids}"
            time.sleep(0.1)
