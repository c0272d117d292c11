"""The embedded default: with no backends given, the gateway starts one local
prefill and one local decode worker and stops them when it stops."""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any

from protocol import settings
from protocol.settings import CLUSTER_TOKEN_ENV, Flag, setting
from worker.config import WorkerConfig, require_torch
from worker.processes import free_port, stop_processes, wait_http_ok

log = logging.getLogger("gateway")

STOP_TIMEOUT_S = 30.0
"""How long a worker may take to exit after SIGTERM before it is killed."""
EMBEDDED_SETTINGS = (
    "model",
    "load_format",
    "dtype",
    "device",
    "tp_size",
    "context_length",
    "attention_backend",
    "cuda_graph_max_bs",
    "cuda_graph_max_tokens",
    "page_size",
    "num_pages",
    "kv_cache_memory_gb",
    "gpu_memory_utilization",
    "max_num_batched_tokens",
    "chunk_size",
    "max_running_requests",
    "enable_prefix_cache",
    "transfer_backend",
)
"""The worker settings the gateway's command line offers for its embedded
workers: their own flags, from their one definition (``worker.config``)."""
EMBEDDED_GROUP = (
    "embedded workers (used when no --prefill/--decode is given): the workers' own flags"
)


@dataclass(frozen=True)
class EmbeddedConfig:
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    """The settings both workers share (role, host and port are each one's own);
    the gateway's command line offers ``EMBEDDED_SETTINGS`` of them."""
    prefill_device: str | None = setting(
        None,
        help="device of the prefill worker (default: see --decode-device)",
        group=EMBEDDED_GROUP,
    )
    decode_device: str | None = setting(
        None,
        help="device of the decode worker (default: with --device auto or cuda and two or "
        "more GPUs, prefill and decode each on their own; else both on --device, each "
        "taking half of --gpu-memory-utilization)",
        group=EMBEDDED_GROUP,
    )
    embedded_start_timeout_s: float = setting(
        600.0,
        help="the embedded workers load the model, profile it and capture their graphs "
        "within this many seconds, or the gateway stops (default: %(default)s)",
        group=EMBEDDED_GROUP,
    )
    extra_args: tuple[str, ...] = setting(
        (),
        help="arguments added to both workers' command lines (no flag: the gateway's "
        "command line offers the workers' own flags)",
        flag=False,
    )

    @classmethod
    def from_settings(cls, **values: Any) -> EmbeddedConfig:
        """A config from one keyword per setting, named as on the command line:
        ``EMBEDDED_SETTINGS`` (and any other of the workers' settings) go to
        ``worker``."""
        return settings.build(cls, values)

    def to_argv(self) -> list[str]:
        """The gateway command line's arguments for this config: the settings
        of ``flags`` that differ from their defaults (the workers' other
        settings have no gateway flag)."""
        return settings.to_argv(self, flags())

    def placement(self, cuda_devices: int) -> tuple[str, str, float]:
        """The prefill and decode workers' devices and each one's
        ``gpu_memory_utilization``, with ``cuda_devices`` GPUs visible.

        "auto" and "cuda" mean the GPUs from cuda:0: with enough for both
        workers' ranks, prefill on the first ``tp_size`` and decode on the
        next; else both on the same ones. Two workers on one GPU split the
        share of its memory (``gpu_memory_utilization``) between them."""
        engine = self.worker.engine
        base = engine.device
        if base in ("auto", "cuda") and cuda_devices:
            base = "cuda:0"
        elif base == "auto":
            base = "cpu"
        prefill, decode = base, base
        if base == "cuda:0" and cuda_devices >= 2 * engine.tp_size:
            decode = f"cuda:{engine.tp_size}"
        prefill, decode = self.prefill_device or prefill, self.decode_device or decode
        share = engine.gpu_memory_utilization
        if prefill == decode and prefill.startswith("cuda"):
            share /= 2
        return prefill, decode, share


def flags() -> tuple[Flag, ...]:
    """The embedded workers' flags on the gateway's command line: this
    config's own and the workers' ``EMBEDDED_SETTINGS``, as the workers
    define them."""
    return tuple(
        flag
        for flag in settings.flags(EmbeddedConfig)
        if flag.path[:1] != ("worker",) or flag.name in EMBEDDED_SETTINGS
    )


def cuda_device_count() -> int:
    """GPUs the workers will see, asked of torch in a child process (the
    gateway itself never loads torch); 0 without an NVIDIA driver."""
    if not os.path.exists("/proc/driver/nvidia") and not os.path.exists("/dev/nvidia0"):
        return 0
    probe = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    try:
        out = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
        )
        return int(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError, OSError):
        return 0


class EmbeddedWorkers:
    """Owns the two worker processes; always use as a context manager."""

    def __init__(self, config: EmbeddedConfig, cluster_token: str | None = None) -> None:
        self.config = config
        self.procs: list[subprocess.Popen[bytes]] = []
        self.prefill_url = ""
        self.decode_url = ""
        self.cluster_token = cluster_token or secrets.token_hex(16)
        """Given, or a fresh one: the embedded workers are never open."""

    def _cmd(self, module: str, role: str, port: int, device: str, share: float) -> list[str]:
        c = self.config
        # With no model the worker serves the built-in tiny model under its name.
        engine = replace(c.worker.engine, device=device, gpu_memory_utilization=share)
        worker = replace(c.worker, role=role, host="127.0.0.1", port=port, engine=engine)
        return [sys.executable, "-m", module, *worker.to_argv(), *c.extra_args]

    def __enter__(self) -> EmbeddedWorkers:
        require_torch(
            "with no --prefill/--decode (or --wait-for-workers) the gateway starts its "
            "own prefill and decode workers, which run on torch"
        )
        env = {**os.environ, CLUSTER_TOKEN_ENV: self.cluster_token}
        ports = (free_port(), free_port())
        prefill, decode, share = self.config.placement(cuda_device_count())
        log.info(
            "embedded workers: prefill on %s, decode on %s%s",
            prefill,
            decode,
            f" (each takes {share:g} of its memory)"
            if share != self.config.worker.engine.gpu_memory_utilization
            else "",
        )
        specs = (
            ("prefill_server", "prefill", ports[0], prefill),
            ("decode_server", "decode", ports[1], decode),
        )
        try:
            for module, role, port, device in specs:
                # Own process group: Ctrl-C in the terminal reaches the gateway,
                # which then stops the workers in order.
                self.procs.append(
                    subprocess.Popen(
                        self._cmd(module, role, port, device, share),
                        env=env,
                        start_new_session=True,
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
        deadline = time.monotonic() + self.config.embedded_start_timeout_s
        for proc, role, url in zip(
            self.procs, ("prefill", "decode"), (self.prefill_url, self.decode_url)
        ):
            left = max(0.0, deadline - time.monotonic())
            wait_http_ok(proc, f"{url}/health", left, f"the embedded {role} worker")

    def stop(self) -> None:
        stop_processes(self.procs, STOP_TIMEOUT_S)
        self.procs = []

    def __exit__(self, *exc: object) -> None:
        self.stop()
