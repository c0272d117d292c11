"""Facts of this checkout and host that result records carry. Torch-free."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def git_commit(full: bool = False) -> str:
    """The checked-out commit, short ("unknown" outside a git checkout);
    ``full``: the whole hash, with "-dirty" when the tree has changes."""
    try:
        rev = ["git", "rev-parse", *([] if full else ["--short"]), "HEAD"]
        commit = subprocess.check_output(rev, cwd=REPO, text=True).strip()
        if full:
            status = ["git", "status", "--porcelain"]
            if subprocess.check_output(status, cwd=REPO, text=True).strip():
                commit += "-dirty"
        return commit
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def host_info() -> dict[str, Any]:
    """The facts of this host every result record carries."""
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
    }
