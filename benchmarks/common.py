"""Helpers shared by the benchmark scripts."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
from pathlib import Path
from typing import Any


def git_commit() -> str:
    """Short hash of the checked-out commit, or "unknown" outside a git checkout."""
    try:
        return subprocess.check_output(
            ["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, text=True
        ).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def host_info() -> dict[str, Any]:
    """The facts of this host every result record carries (torch-free)."""
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
    }


def write_record(
    benchmark: str,
    argv: list[str],
    body: dict[str, Any],
    output_file: str | None,
    stem: str,
    machine: dict[str, Any] | None = None,
) -> Path:
    """Write a result record (date, command, commit, machine, then ``body``) to
    ``output_file``, or to ``results/{stem}-{date}.json`` beside this file;
    returns the path."""
    import json
    from datetime import UTC, datetime

    now = datetime.now(UTC)
    record = {
        "benchmark": benchmark,
        "date": now.isoformat(timespec="seconds"),
        "command": " ".join([f"{benchmark}.py", *argv]),
        "git_commit": git_commit(),
        "machine": machine or host_info(),
        **body,
    }
    path = Path(
        output_file or Path(__file__).parent / "results" / f"{stem}-{now:%Y%m%d-%H%M%S}.json"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
    print(f"wrote {path}")
    return path
