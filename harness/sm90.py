"""Triton kernels compiled for the H100/H200's architecture (sm_90) on any
machine, the GPU's absence included: a launch is caught instead of run, then
handed to ``triton.compile`` with sm_90 as the target, with the
specialization and options Triton would give that call on the GPU, down to
the cubin (Triton's bundled ptxas). The cubin's resources and the
instructions of its main loop come from Triton's bundled ``cuobjdump``.

Used by the compile checks (``tests/test_triton_sm90.py``) and by
``benchmarks.kernels.kernel_sass``, which reads what a kernel costs a tile
before any GPU time is spent on it."""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

SM90 = GPUTarget("cuda", 90, 32)
SHARED_BYTES = 232448
"""Shared memory one block may opt into on sm_90 (227 KiB)."""
REGISTERS_PER_SM = 65536

Launch = tuple[JITFunction, tuple, dict]
"""A caught launch: the kernel, its positional and keyword arguments."""


def supported() -> str | None:
    """Why this Triton cannot be driven so (its internals moved), or None."""
    if not hasattr(JITFunction, "_pack_args"):
        return f"triton {triton.__version__}: JITFunction._pack_args is gone"
    return None


@contextmanager
def caught_launches() -> Iterator[list[Launch]]:
    """Kernel launches made inside the block, caught instead of run, in order."""
    caught: list[Launch] = []
    run = JITFunction.run

    def catch(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        caught.append((self, args, kwargs))

    JITFunction.run = catch  # type: ignore[method-assign]
    try:
        yield caught
    finally:
        JITFunction.run = run  # type: ignore[method-assign]


def specialized(launch: Launch) -> tuple[tuple, Any, Any, Any, Any]:
    """``(key, signature, constexprs, attrs, options)`` of the compile Triton
    makes for this call on sm_90; two launches with one key share a binary."""
    kernel, args, kwargs = launch
    backend = make_backend(SM90)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, kwargs, bound, specialization, options
    )
    key = (kernel.fn.__qualname__, repr(signature), repr(constexprs), repr(attrs), repr(options))
    return key, signature, constexprs, attrs, options


def compile_launch(launch: Launch, registers: int = 0) -> Any:
    """The compiled kernel of a caught launch (``.asm``: ttgir, llir, ptx,
    cubin; ``.metadata.shared``: its shared memory in bytes). ``registers``:
    a cap on a thread's registers (Triton's ``maxnreg``), as the engine's
    launches pass it on CUDA tensors only (a launch caught on CPU tensors
    lacks it); 0: none."""
    if registers:
        kernel, args, kwargs = launch
        launch = (kernel, args, {**kwargs, "maxnreg": registers})
    _, signature, constexprs, attrs, options = specialized(launch)
    src = ASTSource(launch[0], signature, constexprs, attrs)
    return triton.compile(src, target=SM90, options=options.__dict__)


class Sass(NamedTuple):
    """What a cubin costs the SM, per thread and per trip of its main loop."""

    registers: int
    stack: int
    """Bytes of local stack a thread (spilled registers among them)."""
    loop: Counter[str]
    """Instructions of the loop with the most tensor-core instructions (a
    backward branch's range), by opcode; SASS instructions are issued a
    warp at a time, so each is one issue a warp per trip."""
    instructions: int = 0
    """Instructions of the whole kernel but the padding after it (``NOP``):
    for a kernel without loops, what a warp issues, give or take the
    subroutines of rarely taken paths."""

    @property
    def loop_instructions(self) -> int:
        return sum(self.loop.values())

    def blocks_per_sm(self, warps: int, shared: int) -> int:
        """Blocks one SM holds at once, by registers and shared memory."""
        by_registers = REGISTERS_PER_SM // (self.registers * 32 * warps)
        return min(by_registers, SHARED_BYTES // shared if shared else by_registers)


def _tool(name: str) -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


_INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")
_PREDICATE = re.compile(r"^@!?U?P\w+\s+")
_KEEP_SUFFIX = ("LDS", "STS", "LDG", "LDSM", "STSM", "HMMA", "F2FP", "PRMT", "HGMMA")
"""Opcodes kept whole (``LDS.U8`` apart from ``LDS.64``); others lose their suffixes."""


def sass(cubin: bytes, workdir: Path) -> Sass:
    """Resources and main-loop instructions of ``cubin`` (written to ``workdir``)."""
    path = workdir / "kernel.cubin"
    path.write_bytes(cubin)
    usage = subprocess.run(
        [_tool("cuobjdump"), "-res-usage", str(path)], capture_output=True, text=True, check=True
    ).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    if found is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output: {usage[:200]!r}")
    listing = subprocess.run(
        [_tool("cuobjdump"), "-sass", str(path)], capture_output=True, text=True, check=True
    ).stdout
    code = []
    for line in listing.splitlines():
        m = _INSTRUCTION.match(line)
        if m:
            code.append((int(m.group(1), 16), _PREDICATE.sub("", m.group(2).strip())))
    best: tuple[int, list[str]] = (-1, [])
    for at, text in code:
        branch = re.match(r"BRA\s+0x([0-9a-f]+)", text)
        if branch and int(branch.group(1), 16) < at:
            body = [t for a, t in code if int(branch.group(1), 16) <= a <= at]
            mma = sum(t.startswith(("HMMA", "HGMMA")) for t in body)
            if mma > best[0]:
                best = (mma, body)
    loop: Counter[str] = Counter()
    for text in best[1]:
        op = text.split()[0]
        loop[op if op.startswith(_KEEP_SUFFIX) else op.split(".")[0]] += 1
    instructions = sum(not text.startswith("NOP") for _, text in code)
    return Sass(int(found.group(1)), int(found.group(2)), loop, instructions)
