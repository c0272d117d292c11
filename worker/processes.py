"""Starting and stopping local server processes: free ports, waiting on
``/health``, and a stop that never leaves a process behind. Used by the
gateway's embedded workers, the benchmarks and the tests. Torch-free."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_http_ok(
    proc: subprocess.Popen[bytes], url: str, timeout_s: float, name: str, poll_s: float = 0.1
) -> None:
    """Poll ``url`` until it answers 200. Raises ``RuntimeError`` when ``proc``
    exits first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode} during start-up")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} not healthy after {timeout_s:g}s")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(poll_s)


def stop_processes(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float) -> None:
    """SIGTERM every process (in order), wait up to ``timeout_s`` for each, then
    SIGKILL what is left: the whole process group of a process that leads its
    own (a worker's engine process goes with its front)."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                if os.getpgid(proc.pid) == proc.pid:
                    os.killpg(proc.pid, signal.SIGKILL)
                else:
                    proc.kill()
            proc.wait(10)
