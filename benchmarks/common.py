"""What the benchmark tools share: where results go, the command that reruns a
tool, and the record they write."""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from harness.host import git_commit, host_info

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def command(module: str, argv: Sequence[str] | None = None) -> str:
    """``python -m module ARGS``, ARGS being ``argv`` (default: this process's),
    as a result record gives its command."""
    return shlex.join(["python", "-m", module, *(sys.argv[1:] if argv is None else argv)])


def machine(device: str = "cuda") -> dict[str, Any]:
    """The host's facts, the torch version, and the GPU's name when ``device``
    is a CUDA device (imports torch: for the tools that run a model or kernel)."""
    import torch

    info = {**host_info(), "torch": torch.__version__}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def write_record(
    module: str,
    argv: Sequence[str] | None,
    body: dict[str, Any],
    output_file: str | Path | None,
    stem: str,
    machine: dict[str, Any] | None = None,
) -> Path:
    """Write a result record of the tool ``module`` (its name, date, command,
    commit, machine, then ``body``) to ``output_file``, or to
    ``results/{stem}-{date}.json``; returns the path."""
    now = datetime.now(UTC)
    record = {
        "benchmark": module.removeprefix("benchmarks."),
        "date": now.isoformat(timespec="seconds"),
        "command": command(module, argv),
        "git_commit": git_commit(),
        "machine": machine or host_info(),
        **body,
    }
    path = Path(output_file or RESULTS_DIR / f"{stem}-{now:%Y%m%d-%H%M%S}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
    print(f"wrote {path}")
    return path


KERNEL_SETTINGS = (
    "quantization",
    "quantize_lm_head",
    "kv_cache_dtype",
    "fuse_rope_kv_write",
    "decode_kernel",
    "cuda_graph_max_tokens",
    "fresh_prefill_graphs",
)
"""Engine settings that choose kernels: flags of the engine tools, copied
into their configs and records."""


def add_engine_flag(parser: Any, name: str) -> None:
    """Add the worker's flag for engine setting ``name`` (its help, default
    and type, from ``EngineConfig``) to a tool's parser."""
    from engine.config import EngineConfig
    from protocol.settings import add_flag, flags

    (flag,) = [f for f in flags(EngineConfig) if f.name == name]
    add_flag(parser, flag)
