"""The README's split deployment (the block after ``<!-- split-deployment -->``),
run as written: each line in the order given, the workers in the background,
the gateway last. Only the ports change, to free ones, and ``python`` is this
interpreter."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from workers import REPO, dump_log, free_port, start_worker, stop_all, wait_http_ok

MARK = "<!-- split-deployment -->"
START_TIMEOUT_S = 120.0


def split_deployment() -> list[str]:
    text = (REPO / "README.md").read_text()
    assert MARK in text, f"README.md has no {MARK} block"
    block = text.split(MARK, 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def _free_ports(line: str, ports: dict[str, str]) -> list[str]:
    for written, free in ports.items():
        line = line.replace(f":{written}", f":{free}").replace(f" {written}", f" {free}")
    args = shlex.split(line.removesuffix("&").strip())
    assert args[0] == "python", line
    return [sys.executable, *args[1:]]


@pytest.mark.e2e
def test_split_deployment_runs_as_written(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    export, *workers, gateway = split_deployment()
    assert export.startswith("export DISAGG_CLUSTER_TOKEN=")
    token = subprocess.run(
        ["bash", "-c", f'{export} && printf %s "$DISAGG_CLUSTER_TOKEN"'],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"},
    ).stdout
    assert len(token) >= 16
    assert all(w.endswith("&") for w in workers) and not gateway.endswith("&")
    written = [a for w in workers for a in shlex.split(w) if a.isdigit()]
    ports = {p: str(free_port()) for p in written}
    gateway_port = free_port()
    env = {"DISAGG_CLUSTER_TOKEN": token}
    procs, logs = [], []
    try:
        for i, line in enumerate(workers):
            logs.append(tmp_path / f"worker{i}.log")
            procs.append(start_worker(_free_ports(line, ports), logs[-1], env))
        # The gateway starts while the workers load; they join when they answer.
        logs.append(tmp_path / "gateway.log")
        cmd = [*_free_ports(gateway, ports), "--port", str(gateway_port)]
        procs.append(start_worker(cmd, logs[-1], env))
        url = f"http://127.0.0.1:{gateway_port}"
        for proc, log, port in zip(procs, logs, [*ports.values(), None]):
            # The gateway's /health is 200 once its workers are admitted.
            health = f"http://127.0.0.1:{port or gateway_port}/health"
            wait_http_ok(proc, health, log, START_TIMEOUT_S, log.stem)
        with httpx.Client(base_url=url, timeout=60) as http:
            before = [_free_pages(p) for p in ports.values()]
            body = {"prompt": "Hello", "max_tokens": 4, "model": _model(http)}
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] >= 1
            # Both workers took part: prefill pushed the KV, decode generated.
            assert http.get("/health").json()["status"] == "ok"
            assert [_free_pages(p) for p in ports.values()] == before
    except BaseException:
        for log in logs:
            dump_log(request.config, log)
        raise
    finally:
        stop_all(procs[::-1])


def _model(http: httpx.Client) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


def _free_pages(port: str) -> int:
    info = httpx.get(f"http://127.0.0.1:{port}/server_info", timeout=10).json()
    stats = info["stats"]
    return stats["free_pages"] + stats["cached_pages"]
