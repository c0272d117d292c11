"""Worker and gateway processes for the tests, on harness's launcher
(``harness.procs``, ``harness.cluster``): command lines, start-up (wait on
/health, never a fixed sleep; a start that fails fails the test with the log's
tail), log dumps past pytest's capture, and shutdown. Workers start in the
test's process group unless asked for their own (``new_session``).

Imported by test modules as ``workers`` (pytest puts ``tests/`` on sys.path).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest

from harness import cluster, procs
from harness.cluster import Gateway, Worker
from harness.procs import REPO as REPO  # re-exported for the tests
from harness.procs import ProcError, stop_popens
from harness.procs import free_port as free_port
from harness.procs import log_tail as log_tail
from harness.procs import procs_mentioning as procs_mentioning
from worker import processes

START_TIMEOUT_S = 60.0
"""How long a worker may take to answer /health with 200."""

T = TypeVar("T")


def started(wait: Callable[..., T], *args: Any) -> T:
    """``wait(*args)``, failing the test (with the process's log tail) when the
    process exits first or does not get there in time."""
    try:
        return wait(*args)
    except ProcError as e:
        pytest.fail(str(e))


def dump_log(config: pytest.Config, path: Path, lines: int = 200) -> None:
    """Print the tail of a worker log to the terminal, past pytest's capture."""
    text = f"----- log ({path}) -----\n{log_tail(path, lines)}\n----- end of log -----"
    capman = config.pluginmanager.get_plugin("capturemanager")
    with capman.global_and_fixture_disabled() if capman else contextlib.nullcontext():
        print(f"\n{text}", file=sys.stderr, flush=True)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, wait, then SIGKILL if it lingers."""
    stop_popens([proc])


def stop_all(popens: Sequence[subprocess.Popen[bytes]]) -> None:
    """Stop several processes at once (SIGTERM to all first, then wait)."""
    stop_popens(popens)


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
    return cluster.worker_cmd(module, port, role=role, model=model_dir, flags=flags, **settings)


def start_worker(
    cmd: list[str],
    log_path: Path,
    env: dict[str, str] | None = None,
    new_session: bool = False,
) -> subprocess.Popen[bytes]:
    """Spawn a process with its output in ``log_path``; ``new_session`` gives it
    its own process group (so ``Worker.kill`` can SIGKILL front and engine)."""
    return procs.spawn(cmd, log_path, env, new_session)


def wait_healthy(proc: subprocess.Popen[bytes], port: int, log_path: Path) -> Worker:
    """Poll /health until 200 (failing the test if the worker exits or takes
    longer than ``START_TIMEOUT_S``), then read /server_info."""
    worker = Worker(log_path.stem, list(map(str, proc.args)), log_path, port=port, proc=proc)
    return started(worker.wait_healthy, START_TIMEOUT_S)


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
    with Gateway.make(log_path, args, env=env, new_session=False).start() as gw:
        started(gw.wait_http, "/health", timeout)
        assert gw.proc is not None
        yield gw.url, gw.proc


@contextlib.contextmanager
def launch_worker(
    cmd: list[str],
    port: int,
    log_path: Path,
    env: dict[str, str] | None = None,
    new_session: bool = False,
) -> Iterator[Worker]:
    """Start a worker, wait until /health answers 200, always stop it."""
    with launch_workers([(cmd, port, log_path, env)], new_session) as (worker,):
        yield worker


@contextlib.contextmanager
def launch_workers(
    specs: Sequence[tuple[list[str], int, Path, dict[str, str] | None]],
    new_session: bool = False,
) -> Iterator[list[Worker]]:
    """Start several workers at once (they load in parallel), wait until each is
    healthy, always stop all of them. ``specs``: (cmd, port, log_path, env)."""
    workers = [
        Worker(log_path.stem, cmd, log_path, env or {}, port, new_session)
        for cmd, port, log_path, env in specs
    ]
    with procs.running(workers):
        for w in workers:
            w.start()
        yield [started(w.wait_healthy, START_TIMEOUT_S) for w in workers]
