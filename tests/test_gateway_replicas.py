"""Gateway replicas: ``--replicas 2`` serves one port from two processes,
a worker registered with one replica is routed to by both, requests through
the shared port are served by both; and ``--register`` reaches every address
a gateway name resolves to."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from harness.cluster import Gateway, Worker
from harness.procs import running, start_all
from protocol.settings import CLUSTER_TOKEN_ENV
from worker.front import register_targets

pytestmark = pytest.mark.e2e

TOKEN = "replicas-secret"
ENV = {CLUSTER_TOKEN_ENV: TOKEN, "OMP_NUM_THREADS": "1"}
ENGINE: dict[str, Any] = dict(
    page_size=4, num_pages=256, context_length=256, transfer_backend="tcp"
)


class Fleet:
    def __init__(self, gateway: Gateway, prefill: Worker, decode: Worker) -> None:
        self.gateway, self.prefill, self.decode = gateway, prefill, decode


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    logs = tmp_path_factory.mktemp("replicas")
    prefill = Worker.make("prefill", "prefill", logs, env=ENV, **ENGINE)
    decode = Worker.make("decode", "decode", logs, env=ENV, **ENGINE)
    gw = Gateway.make(
        logs / "gateway.log",
        ["--replicas", "2", "--wait-for-workers", "--log-level", "warning"],
        env=ENV,
        admin_key=TOKEN,
    )
    with running([prefill, decode, gw]) as procs:
        try:
            gw.start()
            start_all([prefill, decode])
            for w in (prefill, decode):
                w.wait_healthy()
            _wait_answering(gw)
            yield Fleet(gw, prefill, decode)
        except BaseException:
            for p in procs:
                print(f"--- {p.name} log ---\n{p.log_tail()}")
            raise


def _wait_answering(gw: Gateway, timeout_s: float = 60.0) -> None:
    """Until the gateway answers /health at all (503 while it has no worker)."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert gw.alive, f"the gateway exited:\n{gw.log_tail()}"
        try:
            httpx.get(f"{gw.url}/health", timeout=2)
            return
        except httpx.HTTPError:
            assert time.monotonic() < deadline, "the gateway never answered"
            time.sleep(0.1)


def _health(url: str) -> dict[str, Any]:
    # A new connection each time: the kernel picks the replica per connection.
    with httpx.Client(timeout=10) as client:
        return client.get(f"{url}/health").json()


def _replica_views(url: str, want: int = 2, tries: int = 400) -> dict[str, dict[str, Any]]:
    """/health of each replica answering on ``url`` (by replica id)."""
    seen: dict[str, dict[str, Any]] = {}
    for _ in range(tries):
        body = _health(url)
        seen[body["replica"]] = body
        if len(seen) >= want:
            break
    return seen


def test_two_processes_serve_the_port(fleet: Fleet) -> None:
    views = _replica_views(fleet.gateway.url)
    assert len(views) == 2, f"one replica answered {400} connections: {list(views)}"


def test_a_registration_with_one_replica_reaches_both(fleet: Fleet) -> None:
    for w in (fleet.prefill, fleet.decode):
        resp = fleet.gateway.admin("POST", "/admin/workers", json={"url": w.url, "role": None})
        assert resp.status_code == 200, resp.text
    want = {fleet.prefill.url, fleet.decode.url}
    deadline = time.monotonic() + 20
    while True:
        views = _replica_views(fleet.gateway.url)
        healthy = {
            rid: {w["url"] for w in v["workers"] if w["healthy"]} for rid, v in views.items()
        }
        if len(views) == 2 and all(h == want for h in healthy.values()):
            break
        assert time.monotonic() < deadline, f"the replicas never all took both workers: {healthy}"
        time.sleep(0.1)
    # Requests through the shared port are served, whichever replica takes them.
    body = {
        "model": "tiny-llama",
        "prompt": [5, 6, 7, 8, 9],
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    outs = set()
    for _ in range(8):
        with httpx.Client(timeout=60) as client:
            resp = client.post(f"{fleet.gateway.url}/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        outs.add(tuple(resp.json()["choices"][0]["token_ids"]))
    assert len(outs) == 1, f"greedy outputs differ between replicas: {outs}"


def test_register_targets_every_address_of_a_name(monkeypatch: pytest.MonkeyPatch) -> None:
    assert register_targets("http://10.1.2.3:8000/") == ["http://10.1.2.3:8000"]

    def two(host: str, port: int, *args: Any, **kw: Any) -> list[Any]:
        assert host == "gateway-peers"
        return [
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port))
            for ip in ("10.0.0.7", "10.0.0.5", "10.0.0.7")
        ]

    monkeypatch.setattr(socket, "getaddrinfo", two)
    assert register_targets("http://gateway-peers:8000") == [
        "http://10.0.0.5:8000",
        "http://10.0.0.7:8000",
    ]

    def fail(*args: Any, **kw: Any) -> list[Any]:
        raise OSError("no such name")

    monkeypatch.setattr(socket, "getaddrinfo", fail)
    assert register_targets("http://gateway:8000") == ["http://gateway:8000"]
