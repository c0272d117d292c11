"""A local cluster of real processes for benchmarks: prefill and decode
workers (``python -m prefill_server`` / ``decode_server``) and a gateway
(``python -m gateway``), each with its log in a file, and the faults a
process can be dealt (SIGKILL, SIGSTOP/SIGCONT, restart on the same port).

Every worker runs in its own process group, so a signal reaches its front and
its engine process together. Waits poll ``/health``; nothing sleeps a fixed
time. Torch-free."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from worker.config import WorkerConfig
from worker.processes import free_port, stop_processes, wait_http_ok

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 20.0


def log_tail(path: Path, lines: int = 60) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"(no log: {e})"
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class WorkerProcess:
    """One worker: its command line (fixed, so a restart serves the same HTTP
    port), its process while it runs, and its pool as it was at start."""

    name: str
    role: str
    port: int
    cmd: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    start_stats: dict[str, Any] = field(default_factory=dict)
    """/server_info stats once it became healthy (its pool at rest)."""
    paused: bool = False

    @classmethod
    def make(
        cls,
        name: str,
        role: str,
        model: str | None,
        log_dir: Path,
        env: dict[str, str],
        **settings: Any,
    ) -> WorkerProcess:
        port = free_port()
        module = "prefill_server" if role == "prefill" else "decode_server"
        # The CPU unless ``settings`` name a device.
        settings = {"device": "cpu", **settings}
        config = WorkerConfig.from_settings(
            role=role, model=model, host="127.0.0.1", port=port, **settings
        )
        cmd = [sys.executable, "-m", module, *config.to_argv()]
        return cls(name, role, port, cmd, env, log_dir / f"{name}.log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        """Spawn it (appending to its log: a restart keeps the history)."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                env={**os.environ, **self.env},
                start_new_session=True,
            )
        self.paused = False

    def wait_healthy(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until /health answers 200; then record the pool at rest."""
        assert self.proc is not None
        try:
            wait_http_ok(self.proc, f"{self.url}/health", timeout_s, self.name, poll_s=0.05)
        except RuntimeError as e:
            raise RuntimeError(f"{e}\n{log_tail(self.log_path)}") from None
        self.start_stats = self.stats()

    def info(self, timeout_s: float = 5.0) -> dict[str, Any]:
        resp = httpx.get(f"{self.url}/server_info", timeout=timeout_s)
        resp.raise_for_status()
        return resp.json()

    def stats(self, timeout_s: float = 5.0) -> dict[str, Any]:
        return self.info(timeout_s)["stats"]

    def _signal_group(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL front and engine at once (no goodbye on any plane)."""
        self._signal_group(signal.SIGKILL)
        assert self.proc is not None
        self.proc.wait(10)
        self.paused = False

    def pause(self) -> None:
        self._signal_group(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        self._signal_group(signal.SIGCONT)
        self.paused = False

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.paused:
            self.resume()
        stop_processes([self.proc], STOP_TIMEOUT_S)


@dataclass
class GatewayProcess:
    port: int
    cmd: list[str]
    env: dict[str, str]
    log_path: Path
    admin_key: str
    proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def make(
        cls,
        prefill: list[str],
        decode: list[str],
        admin_key: str,
        log_path: Path,
        env: dict[str, str],
        args: list[str],
    ) -> GatewayProcess:
        port = free_port()
        cmd = [sys.executable, "-m", "gateway", "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--prefill", *prefill, "--decode", *decode, "--admin-key", admin_key, *args]
        return cls(port, cmd, env, log_path, admin_key)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                env={**os.environ, **self.env},
            )
        try:
            wait_http_ok(self.proc, f"{self.url}/health", timeout_s, "gateway", poll_s=0.05)
        except RuntimeError as e:
            raise RuntimeError(f"{e}\n{log_tail(self.log_path)}") from None

    def admin(self, method: str, path: str, **kw: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.admin_key}"}
        return httpx.request(method, f"{self.url}{path}", headers=headers, timeout=10, **kw)

    def workers(self) -> dict[str, dict[str, Any]]:
        """The gateway's view of its workers, by URL."""
        resp = self.admin("GET", "/admin/workers")
        resp.raise_for_status()
        return {w["url"]: w for w in resp.json()["workers"]}

    def stop(self) -> None:
        if self.proc is not None:
            stop_processes([self.proc], STOP_TIMEOUT_S)


def wait_until(pred: Any, timeout_s: float, poll_s: float = 0.05) -> bool:
    """Poll ``pred()`` until it is true (True) or ``timeout_s`` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if pred():
                return True
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
