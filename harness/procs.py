"""Local server processes for tests and benchmarks, started one way.

A ``Proc`` starts a command with its output in a log file, waits on an HTTP
URL (bounded, and ending early when the process exits), shows the log's tail
when something fails, and on the way out always stops the process and what is
left of its process group: SIGTERM, then SIGKILL. Started in a session of its
own (the default), a process leads its own group, so a signal reaches a
worker's front and engine process together and a Ctrl-C in the terminal
reaches only the script, which then stops its processes in order.

Built on ``worker.processes`` (free ports, the health wait, the stop); nothing
waits a fixed time. Torch-free.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from worker.processes import free_port as free_port  # re-exported
from worker.processes import stop_processes, wait_http_ok

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 120.0
"""How long a process may take to answer its health URL, unless told otherwise."""
STOP_TIMEOUT_S = 30.0
"""How long a process may take to exit after SIGTERM before it is killed."""
LOG_LINES = 200


def log_tail(path: Path, lines: int = LOG_LINES) -> str:
    """The last ``lines`` lines of a log (or why there is none)."""
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"(no log: {e})"
    return "\n".join(text.splitlines()[-lines:])


class ProcError(RuntimeError):
    """A process did not do what was waited for, or a check of it failed;
    ``proc``: the process whose log explains it (its tail follows ``reason``
    in the message)."""

    def __init__(self, reason: str, proc: Proc | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.proc = proc

    def __str__(self) -> str:
        if self.proc is None:
            return self.reason
        return (
            f"{self.reason}\n----- {self.proc.name}: last lines of {self.proc.log_path} -----\n"
            f"{self.proc.log_tail()}"
        )


def spawn(
    cmd: Sequence[str],
    log_path: Path,
    env: dict[str, str] | None = None,
    new_session: bool = False,
    append: bool = False,
) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in the repository root with stdout and stderr in
    ``log_path`` (``append``: after what is there) and ``env`` over this
    process's environment; ``new_session``: in a process group of its own."""
    with open(log_path, "ab" if append else "wb") as log:
        return subprocess.Popen(
            list(cmd),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, **(env or {})},
            start_new_session=new_session,
        )


def leads_group(proc: subprocess.Popen[bytes]) -> bool:
    """Whether ``proc`` runs and leads its own process group."""
    with contextlib.suppress(ProcessLookupError):
        return proc.poll() is None and os.getpgid(proc.pid) == proc.pid
    return False


def child_groups(pid: int) -> list[int]:
    """The process groups that children of ``pid`` lead (a gateway's embedded
    workers); Linux, elsewhere none."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            ppid, pgid = stat.read_text().rsplit(")", 1)[1].split()[1:3]
            if int(ppid) == pid and pgid == stat.parent.name:
                found.append(int(pgid))
    return found


def stop_popens(
    procs: Sequence[subprocess.Popen[bytes]], timeout_s: float = STOP_TIMEOUT_S
) -> None:
    """SIGTERM every process (in order), wait up to ``timeout_s`` for each,
    SIGKILL what lingers; then SIGKILL whatever is left of the process groups
    they lead and of those their children lead."""
    groups = [p.pid for p in procs if leads_group(p)]
    groups += [g for p in procs if p.poll() is None for g in child_groups(p.pid)]
    stop_processes(procs, timeout_s)
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


def procs_mentioning(marker: str) -> list[str]:
    """Pids of the processes whose command line holds ``marker`` (to check that
    a tool stopped every process it started)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker in cmdline.read_bytes().decode(errors="replace"):
                found.append(cmdline.parent.name)
        except OSError:
            continue
    return found


def wait_until(pred: Callable[[], Any], timeout_s: float, poll_s: float = 0.05) -> bool:
    """Poll ``pred()`` until it is true (True) or ``timeout_s`` passes (False);
    an HTTP error counts as not yet."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if pred():
                return True
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)


@dataclass(eq=False)
class Proc:
    """One server process: its command line (fixed, so that a restart serves the
    same port), its log, and its ``subprocess.Popen`` while it runs."""

    name: str
    cmd: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    """Set over this process's environment."""
    port: int | None = None
    """The HTTP port it serves (for ``url``)."""
    new_session: bool = True
    proc: subprocess.Popen[bytes] | None = None
    paused: bool = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def exited(self) -> bool:
        """It was started and is gone."""
        return self.proc is not None and self.proc.poll() is not None

    def start(self) -> Proc:
        """Start it; a restart appends to the log (which keeps the history)."""
        assert not self.alive, f"{self.name} is running"  # never lose a running process
        self.proc = spawn(self.cmd, self.log_path, self.env, self.new_session, self.exited)
        self.paused = False
        return self

    def wait_http(
        self, path: str = "/health", timeout_s: float = START_TIMEOUT_S, poll_s: float = 0.05
    ) -> float:
        """Poll ``url + path`` until it answers 200; returns the seconds it took.
        Raises ``ProcError`` when the process exits first or ``timeout_s`` passes."""
        assert self.proc is not None, f"{self.name} was never started"
        t0 = time.monotonic()
        try:
            wait_http_ok(self.proc, f"{self.url}{path}", timeout_s, self.name, poll_s)
        except RuntimeError as e:
            raise ProcError(str(e), self) from None
        return time.monotonic() - t0

    def log_tail(self, lines: int = LOG_LINES) -> str:
        return log_tail(self.log_path, lines)

    def signal_group(self, sig: signal.Signals) -> None:
        """Send ``sig`` to its whole process group (it must lead one)."""
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            assert os.getpgid(self.proc.pid) == self.proc.pid, f"{self.name} has no group"
            os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL the whole process group (no goodbye on any plane) and wait
        until none of it is left."""
        assert self.proc is not None
        pgid = self.proc.pid
        self.signal_group(signal.SIGKILL)
        self.proc.wait(10)
        self.paused = False
        deadline = time.monotonic() + 10
        with contextlib.suppress(ProcessLookupError):
            while time.monotonic() < deadline:
                os.killpg(pgid, 0)  # raises once the group is gone
                time.sleep(0.05)

    def pause(self) -> None:
        self.signal_group(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        self.signal_group(signal.SIGCONT)
        self.paused = False

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        stop_all([self], timeout_s)

    def __enter__(self) -> Proc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_all(procs: Sequence[Proc], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Stop ``procs`` in order (paused ones resumed first): see ``stop_popens``."""
    for p in procs:
        if p.paused and p.alive:
            p.resume()
    stop_popens([p.proc for p in procs if p.proc is not None], timeout_s)


@contextlib.contextmanager
def running(procs: list[Proc], timeout_s: float = STOP_TIMEOUT_S) -> Iterator[list[Proc]]:
    """Yield ``procs`` (started inside, or added to the list there); on the way
    out, however it is left, stop every one of them in the list's order."""
    try:
        yield procs
    finally:
        stop_all(procs, timeout_s)


def start_all(procs: Sequence[Proc], timeout_s: float = START_TIMEOUT_S) -> None:
    """Start every process (they load in parallel), then wait for each one's
    ``/health``."""
    for p in procs:
        p.start()
    for p in procs:
        p.wait_http("/health", timeout_s)
