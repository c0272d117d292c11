"""Helpers shared by the benchmark scripts."""

from __future__ import annotations

import subprocess
from pathlib import Path


def git_commit() -> str:
    """Short hash of the checked-out commit, or "unknown" outside a git checkout."""
    try:
        return subprocess.check_output(
            ["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, text=True
        ).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
