"""Helpers for tests that run real worker processes (``python -m prefill_server``
/ ``python -m decode_server``): command lines, start-up (wait on /health, never
a fixed sleep), stats polling, log dumps and shutdown.

Imported by test modules as ``workers`` (pytest puts ``tests/`` on sys.path).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from worker import processes
from worker.config import WorkerConfig
from worker.processes import free_port as free_port  # re-exported for the tests
from worker.processes import stop_processes

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 60.0
"""How long a worker may take to answer /health with 200."""
STOP_TIMEOUT_S = 30.0
"""How long a worker may take to exit after SIGTERM before it is killed."""


@dataclass
class Worker:
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    start_info: dict[str, Any]
    """/server_info as it was once the worker became healthy."""

    @property
    def endpoint(self) -> str:
        """Request-plane (ZMQ) endpoint."""
        return self.start_info["request_endpoint"]

    @property
    def bootstrap(self) -> str | None:
        """KV-plane bootstrap endpoint (prefill/decode roles)."""
        return self.start_info.get("bootstrap_endpoint")

    @property
    def name(self) -> str:
        return self.log_path.stem

    def info(self) -> dict[str, Any]:
        resp = httpx.get(f"{self.url}/server_info", timeout=10)
        assert resp.status_code == 200, resp.text
        return resp.json()

    def stats(self) -> dict[str, Any]:
        return self.info()["stats"]

    def wait_stats(
        self, pred: Callable[[dict[str, Any]], bool], what: str, timeout: float = 10.0
    ) -> dict[str, Any]:
        """Poll the stats until ``pred`` holds; fail after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if pred(stats):
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} never reached: {what}; last stats {stats}")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL the whole worker (front and engine process) at once. Needs a
        worker started with ``new_session=True`` (its own process group)."""
        assert os.getpgid(self.proc.pid) == self.proc.pid, "worker has no process group"
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


def log_tail(path: Path, lines: int = 200) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"(no worker log: {e})"
    return "\n".join(text.splitlines()[-lines:])


def dump_log(config: pytest.Config, path: Path, lines: int = 200) -> None:
    """Print the tail of a worker log to the terminal, past pytest's capture."""
    text = (
        f"----- worker log ({path}) -----\n{log_tail(path, lines)}\n----- end of worker log -----"
    )
    capman = config.pluginmanager.get_plugin("capturemanager")
    with capman.global_and_fixture_disabled() if capman else contextlib.nullcontext():
        print(f"\n{text}", file=sys.stderr, flush=True)


def procs_mentioning(marker: str) -> list[str]:
    """Pids of the processes whose command line holds ``marker`` (a benchmark's
    processes, to check that it stopped them all)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker in cmdline.read_bytes().decode(errors="replace"):
                found.append(cmdline.parent.name)
        except OSError:
            continue
    return found


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, wait, then SIGKILL if it lingers."""
    stop_processes([proc], STOP_TIMEOUT_S)


def stop_all(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """Stop several workers at once (SIGTERM to all first, then wait)."""
    stop_processes(procs, STOP_TIMEOUT_S)


def worker_cmd(
    module: str,
    model_dir: str,
    port: int,
    *,
    role: str = "both",
    flags: Sequence[str] = (),
    **settings: Any,
) -> list[str]:
    """``python -m module`` serving ``model_dir`` on 127.0.0.1:``port`` on the CPU:
    ``WorkerConfig.to_argv`` of these and of ``settings`` (worker or engine
    settings, e.g. ``num_pages=64``), then ``flags`` verbatim."""
    config = WorkerConfig.from_settings(
        role=role, model=model_dir, host="127.0.0.1", port=port, device="cpu", **settings
    )
    return [sys.executable, "-m", module, *config.to_argv(), *flags]


def start_worker(
    cmd: list[str],
    log_path: Path,
    env: dict[str, str] | None = None,
    new_session: bool = False,
) -> subprocess.Popen[bytes]:
    """Spawn a worker with its output in ``log_path``; ``new_session`` gives it
    its own process group (so ``Worker.kill`` can SIGKILL front and engine)."""
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, **(env or {})},
            start_new_session=new_session,
        )


def wait_healthy(proc: subprocess.Popen[bytes], port: int, log_path: Path) -> Worker:
    """Poll /health until 200 (failing the test if the worker exits or takes
    longer than ``START_TIMEOUT_S``), then read /server_info."""
    url = f"http://127.0.0.1:{port}"
    wait_http_ok(proc, f"{url}/health", log_path, START_TIMEOUT_S, "worker")
    info = httpx.get(f"{url}/server_info", timeout=10).json()
    return Worker(url, proc, log_path, info)


def wait_http_ok(
    proc: subprocess.Popen[bytes], url: str, log_path: Path, timeout: float, what: str
) -> None:
    """Poll ``url`` until it answers 200; fail the test (with the log's tail)
    if ``proc`` exits first or ``timeout`` passes."""
    try:
        processes.wait_http_ok(proc, url, timeout, what)
    except RuntimeError as e:
        pytest.fail(f"{e}:\n{log_tail(log_path)}")


@contextlib.contextmanager
def launch_gateway(
    args: Sequence[str], log_path: Path, timeout: float, env: dict[str, str] | None = None
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``python -m gateway ARGS`` on a free port (embedded workers unless ARGS
    name some); yields its URL and process once /health answers 200, always
    stops it."""
    port = free_port()
    cmd = [sys.executable, "-m", "gateway", "--host", "127.0.0.1", "--port", str(port), *args]
    proc = start_worker(cmd, log_path, env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http_ok(proc, f"{url}/health", log_path, timeout, "gateway")
        yield url, proc
    finally:
        stop(proc)


@contextlib.contextmanager
def launch_worker(
    cmd: list[str],
    port: int,
    log_path: Path,
    env: dict[str, str] | None = None,
    new_session: bool = False,
) -> Iterator[Worker]:
    """Start a worker, wait until /health answers 200, always stop it."""
    proc = start_worker(cmd, log_path, env, new_session)
    try:
        yield wait_healthy(proc, port, log_path)
    finally:
        stop(proc)


@contextlib.contextmanager
def launch_workers(
    specs: Sequence[tuple[list[str], int, Path, dict[str, str] | None]],
    new_session: bool = False,
) -> Iterator[list[Worker]]:
    """Start several workers at once (they load in parallel), wait until each is
    healthy, always stop all of them. ``specs``: (cmd, port, log_path, env)."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for cmd, _, log_path, env in specs:
            procs.append(start_worker(cmd, log_path, env, new_session))
        yield [
            wait_healthy(proc, port, log_path) for proc, (_, port, log_path, _) in zip(procs, specs)
        ]
    finally:
        stop_all(procs)
