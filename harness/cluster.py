"""Worker and gateway processes of a local cluster: ``python -m prefill_server``
/ ``decode_server`` workers with their command line built from
``WorkerConfig`` (on the CPU unless told otherwise), ``python -m gateway``, and
what a test or benchmark asks of them (``/server_info``, the admin API).
Faults (SIGKILL, SIGSTOP/SIGCONT, restart on the same port) are ``Proc``'s.
Torch-free."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from harness.procs import START_TIMEOUT_S, Proc, ProcError, free_port
from worker.config import WorkerConfig


def worker_cmd(
    module: str,
    port: int,
    *,
    role: str = "both",
    model: str | None = None,
    flags: Sequence[str] = (),
    **settings: Any,
) -> list[str]:
    """``python -m module`` serving ``model`` on 127.0.0.1:``port``:
    ``WorkerConfig.to_argv`` of these and of ``settings`` (worker or engine
    settings, e.g. ``num_pages=64``; the device is the CPU unless they name
    one), then ``flags`` verbatim."""
    settings = {"device": "cpu", **settings}
    config = WorkerConfig.from_settings(
        role=role, model=model, host="127.0.0.1", port=port, **settings
    )
    return [sys.executable, "-m", module, *config.to_argv(), *flags]


def gateway_cmd(port: int, *args: str) -> list[str]:
    """``python -m gateway`` on 127.0.0.1:``port`` with ``args``."""
    return [sys.executable, "-m", "gateway", "--host", "127.0.0.1", "--port", str(port), *args]


@dataclass(eq=False)
class Worker(Proc):
    """A worker process, and its ``/server_info`` as it was once healthy."""

    start_info: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def make(
        cls,
        name: str,
        role: str,
        log_dir: Path,
        *,
        model: str | None = None,
        env: dict[str, str] | None = None,
        flags: Sequence[str] = (),
        new_session: bool = True,
        **settings: Any,
    ) -> Worker:
        """A worker of ``role`` on a free port (not started), its log
        ``log_dir/name.log``; see ``worker_cmd`` for the rest."""
        port = free_port()
        module = "prefill_server" if role == "prefill" else "decode_server"
        cmd = worker_cmd(module, port, role=role, model=model, flags=flags, **settings)
        return cls(name, cmd, log_dir / f"{name}.log", env or {}, port, new_session)

    @property
    def endpoint(self) -> str:
        """Request-plane (ZMQ) endpoint."""
        return self.start_info["request_endpoint"]

    @property
    def bootstrap(self) -> str | None:
        """KV-plane bootstrap endpoint (prefill/decode roles)."""
        return self.start_info.get("bootstrap_endpoint")

    @property
    def start_stats(self) -> dict[str, Any]:
        """Its stats once it became healthy (its pool at rest)."""
        return self.start_info["stats"]

    def wait_healthy(self, timeout_s: float = START_TIMEOUT_S) -> Worker:
        """Until ``/health`` answers 200; then record ``/server_info``."""
        self.wait_http("/health", timeout_s)
        self.start_info = self.info()
        return self

    def info(self, timeout_s: float = 10.0) -> dict[str, Any]:
        resp = httpx.get(f"{self.url}/server_info", timeout=timeout_s)
        if resp.status_code != 200:
            raise ProcError(f"/server_info answered {resp.status_code}: {resp.text}", self)
        return resp.json()

    def stats(self, timeout_s: float = 10.0) -> dict[str, Any]:
        return self.info(timeout_s)["stats"]

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


@dataclass(eq=False)
class Gateway(Proc):
    """A ``python -m gateway`` process, and its admin key (if it has one)."""

    admin_key: str | None = None

    @classmethod
    def make(
        cls,
        log_path: Path,
        args: Sequence[str] = (),
        *,
        env: dict[str, str] | None = None,
        admin_key: str | None = None,
        new_session: bool = True,
        name: str = "gateway",
    ) -> Gateway:
        """A gateway on a free port with ``args`` (not started)."""
        port = free_port()
        key = ["--admin-key", admin_key] if admin_key else []
        cmd = gateway_cmd(port, *args, *key)
        return cls(name, cmd, log_path, env or {}, port, new_session, admin_key=admin_key)

    def admin(self, method: str, path: str, **kw: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.admin_key}"}
        return httpx.request(method, f"{self.url}{path}", headers=headers, timeout=10, **kw)

    def workers(self) -> dict[str, dict[str, Any]]:
        """The gateway's view of its workers, by URL."""
        resp = self.admin("GET", "/admin/workers")
        resp.raise_for_status()
        return {w["url"]: w for w in resp.json()["workers"]}
