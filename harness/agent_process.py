"""A child process that owns one transfer agent and answers commands over a pipe.

The KV-transfer benchmark and tests move bytes between two real processes (the
backends keep per-process state: registered memory, NIXL agents, sockets). Each
side is an ``AgentProcess`` whose ``handler(state, cmd, *args)`` (a module-level
function, so that a spawned child can import it) runs in the child; the parent
sends commands with ``call`` and gets the handler's result or its traceback.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

Handler = Callable[..., Any]
"""``handler(state: dict, cmd: str, *args)`` -> the reply of ``cmd``."""


def _child_main(conn: Any, handler: Handler) -> None:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    state: dict[str, Any] = {}
    while True:
        cmd, args = conn.recv()
        try:
            if cmd == "exit":
                if "backend" in state:
                    state["backend"].close()
                conn.send(("ok", None))
                # Skip interpreter teardown (about a second with torch loaded).
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)
            conn.send(("ok", handler(state, cmd, *args)))
        except BaseException:
            conn.send(("err", traceback.format_exc()))


class AgentProcess:
    def __init__(self, ctx: Any, name: str, handler: Handler, timeout_s: float) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_child_main, args=(child, handler), name=name, daemon=True)
        self.proc.start()
        child.close()

    def call(self, cmd: str, *args: Any, timeout: float | None = None) -> Any:
        """Run ``cmd`` in the child; raises with the child's traceback on failure."""
        timeout = self.timeout_s if timeout is None else timeout
        self.conn.send((cmd, args))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.name} did not answer {cmd!r} within {timeout:g}s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"{self.name} failed {cmd!r}:\n{value}")
        return value

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)

    def stop(self) -> None:
        """Ask the child to exit; terminate, then kill it if it does not."""
        try:
            if self.proc.is_alive():
                self.call("exit", timeout=10)
        except (OSError, EOFError, TimeoutError, RuntimeError):
            pass
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()
