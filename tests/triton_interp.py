"""Triton kernels under Triton's interpreter (no GPU needed), one test module
at a time.

The interpreter must be chosen before triton is first imported, and for the
whole process, so a module's kernel tests (marked ``interpreted``) run in a
child pytest started with ``TRITON_INTERPRET=1``; in the parent, one test
marked ``parent_only`` starts it (``run_interpreted``)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None
interpreted = pytest.mark.skipif(
    not INTERPRETED, reason="run in a child process under TRITON_INTERPRET=1"
)
parent_only = pytest.mark.skipif(
    INTERPRETED or not HAS_TRITON, reason="the parent process runs this"
)


def run_interpreted(module_file: str, timeout_s: float) -> None:
    """Run the test module ``module_file`` in a child pytest under the
    interpreter; fail with its output unless every test there passed."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", module_file]
    root = Path(module_file).resolve().parents[1]
    done = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout
