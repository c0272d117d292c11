"""The embedded default: with no backends given, the gateway starts one local
prefill and one local decode worker and stops them when it stops."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass

from worker.config import WorkerConfig
from worker.processes import free_port, stop_processes, wait_http_ok

STOP_TIMEOUT_S = 30.0
"""How long a worker may take to exit after SIGTERM before it is killed."""


@dataclass(frozen=True)
class EmbeddedConfig:
    model: str | None = None
    """Checkpoint dir; None: the built-in tiny model."""
    device: str = "auto"
    prefill_device: str | None = None
    decode_device: str | None = None
    transfer_backend: str = "tcp"
    page_size: int = 16
    kv_cache_memory_gb: float = 0.25
    start_timeout_s: float = 300.0
    extra_args: tuple[str, ...] = ()


class EmbeddedWorkers:
    """Owns the two worker processes; always use as a context manager."""

    def __init__(self, config: EmbeddedConfig, cluster_token: str | None = None) -> None:
        self.config = config
        self.procs: list[subprocess.Popen[bytes]] = []
        self.prefill_url = ""
        self.decode_url = ""
        self.cluster_token = cluster_token or secrets.token_hex(16)
        """Given, or a fresh one: the embedded workers are never open."""

    def _cmd(self, module: str, role: str, port: int, device: str) -> list[str]:
        c = self.config
        # With no model the worker serves the built-in tiny model under its name.
        worker = WorkerConfig.from_settings(
            role=role,
            host="127.0.0.1",
            port=port,
            model=c.model,
            device=device,
            page_size=c.page_size,
            kv_cache_memory_gb=c.kv_cache_memory_gb,
            transfer_backend=c.transfer_backend,
        )
        return [sys.executable, "-m", module, *worker.to_argv(), *c.extra_args]

    def __enter__(self) -> EmbeddedWorkers:
        c = self.config
        env = {**os.environ, "DISAGG_CLUSTER_TOKEN": self.cluster_token}
        ports = (free_port(), free_port())
        specs = (
            ("prefill_server", "prefill", ports[0], c.prefill_device or c.device),
            ("decode_server", "decode", ports[1], c.decode_device or c.device),
        )
        try:
            for module, role, port, device in specs:
                # Own process group: Ctrl-C in the terminal reaches the gateway,
                # which then stops the workers in order.
                self.procs.append(
                    subprocess.Popen(
                        self._cmd(module, role, port, device), env=env, start_new_session=True
                    )
                )
            self.prefill_url = f"http://127.0.0.1:{ports[0]}"
            self.decode_url = f"http://127.0.0.1:{ports[1]}"
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.config.start_timeout_s
        for proc, url in zip(self.procs, (self.prefill_url, self.decode_url)):
            left = max(0.0, deadline - time.monotonic())
            wait_http_ok(proc, f"{url}/health", left, f"embedded worker {url}")

    def stop(self) -> None:
        stop_processes(self.procs, STOP_TIMEOUT_S)
        self.procs = []

    def __exit__(self, *exc: object) -> None:
        self.stop()
