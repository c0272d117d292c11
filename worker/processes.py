"""Starting and stopping local server processes: free ports, waiting on
``/health``, and a stop that never leaves a process behind. Used by the
gateway's embedded workers, the benchmarks and the tests. Torch-free."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 10000
"""``free_port`` picks from here up to the ephemeral range."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now, below the system's ephemeral
    range where it can tell. A port from that range (what binding port 0
    gives) may be handed to any outgoing connection, a health poll's for
    one, before the server it was picked for binds it; below it, only a
    server binding that very port can take it."""
    low = _ephemeral_low()
    if low is not None and low > LOWEST_PORT + 1000:
        for _ in range(100):
            port = random.randrange(LOWEST_PORT, low)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int | None:
    """The first port of the ephemeral range (Linux), None where unknown."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


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
