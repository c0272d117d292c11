"""Direct GPU-to-GPU page copies between processes of one host (CUDA IPC).

A decode worker's KV pool is exported as a CUDA IPC handle in its transfer
metadata; a prefill worker on the same host opens it (the same GPU, or a peer
GPU over NVLink) and copies byte ranges into it with one kernel launch: one
program per 64 KiB chunk of a range, however scattered the pages are. Through
UCX a write costs a fixed time per descriptor on top of its bytes, so scattered
pages move several times slower than one range of the same size; the kernel
does not care how the pages are scattered (figures:
docs/perf/2026-12-01-kv-transfer-paths.md).

Used by the nixl backend for peers that can be opened this way; a peer that
cannot (another host, no peer access, a pool that cannot be exported) keeps
the UCX path. The handle is only ever sent inside the authenticated KV
handshake.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch

from kvtransfer.backend import ByteRange

logger = logging.getLogger(__name__)

WORD = 8
"""Bytes per element the kernel moves."""
ALIGN = 16
"""Ranges must start and end on multiples of it (128-bit loads and stores)."""
MIN_RANGES = 32
MAX_MEAN_BYTES = 8 << 20
"""The copy kernel pays where UCX's cost per descriptor dominates: at least
this many ranges of at most this mean size; a few large ranges go faster
through UCX's copy engines (docs/perf/2026-12-01-kv-transfer-paths.md)."""
CHUNK_WORDS = 8192
"""Words per program (64 KiB): large enough to stream, small enough that a
few pages give every SM work."""
PIECE_CHUNKS = 32
PIECE_WORDS = PIECE_CHUNKS * CHUNK_WORDS
"""A range is cut into pieces of 2 MiB, one table row each."""


class IpcExport(msgspec.Struct, frozen=True):
    """What a peer needs to open a CUDA buffer: torch's IPC description of the
    allocation that holds it (``UntypedStorage._share_cuda_``), the buffer's
    place in it, and the host it lives on."""

    host: str
    device: int
    handle: bytes
    storage_bytes: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool
    buffer_offset: int
    """Bytes from the start of the shared storage to the buffer's first byte."""
    nbytes: int
    process: str
    """The exporting process (``process_id``): a writer that sees it gone lets
    go of the mapping, which holds the whole pool's memory until then."""


@cache
def host_id() -> str:
    """This host's name and boot id: equal only for processes of one running
    system (CUDA IPC handles mean nothing anywhere else)."""
    boot = ""
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return f"{socket.gethostname()}/{boot}"


def process_id(pid: int) -> str:
    """Process ``pid`` of this PID namespace as "namespace/pid/start time" ("" when
    it does not exist): equal only for one process, even once its pid is reused."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    # The start time is field 22; the command name before it may hold spaces.
    return f"{ns}/{pid}/{stat.rpartition(')')[2].split()[19]}"


def exporter_gone(export: IpcExport) -> bool:
    """True when the process that exported ``export`` has certainly exited
    (False while it runs, and when this process cannot tell: another PID
    namespace)."""
    if not export.process:
        return False
    ns, pid, _ = export.process.rsplit("/", 2)
    try:
        if ns != os.readlink("/proc/self/ns/pid"):
            return False
    except OSError:
        return False
    return process_id(int(pid)) != export.process


def export_buffer(buffer: torch.Tensor) -> IpcExport | None:
    """``buffer``'s IPC description, or None when it cannot be shared (not on
    CUDA, or an allocator mode without IPC)."""
    if not buffer.is_cuda or not buffer.is_contiguous():
        return None
    storage = buffer.untyped_storage()
    try:
        dev, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync = storage._share_cuda_()
    except Exception as e:  # e.g. expandable segments, which CUDA IPC cannot map
        logger.info("KV pool not exported over CUDA IPC: %s", e)
        return None
    return IpcExport(
        host=host_id(),
        device=int(dev),
        handle=bytes(handle),
        storage_bytes=int(size),
        storage_offset=int(offset),
        ref_counter_handle=bytes(rc_handle),
        ref_counter_offset=int(rc_offset),
        event_handle=None if ev_handle is None else bytes(ev_handle),
        event_sync_required=bool(ev_sync),
        buffer_offset=buffer.storage_offset() * buffer.element_size(),
        nbytes=buffer.numel() * buffer.element_size(),
        process=process_id(os.getpid()),
    )


def open_buffer(export: IpcExport, local: torch.device) -> torch.Tensor | None:
    """The peer's buffer as a flat uint8 tensor this process can write, or
    None when it cannot be opened from ``local`` (another host, no peer
    access between the two GPUs)."""
    if export.host != host_id() or local.type != "cuda":
        return None
    try:
        torch.cuda._lazy_init()
        storage = torch.UntypedStorage._new_shared_cuda(
            export.device,
            export.handle,
            export.storage_bytes,
            export.storage_offset,
            export.ref_counter_handle,
            export.ref_counter_offset,
            export.event_handle,
            export.event_sync_required,
        )
    except Exception as e:
        logger.info("peer KV pool not opened over CUDA IPC: %s", e)
        return None
    flat = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    return flat[export.buffer_offset : export.buffer_offset + export.nbytes]


def as_array(ranges: Sequence[ByteRange] | np.ndarray) -> np.ndarray:
    """``ranges`` as one [n, 3] int64 array (the same array when it is one):
    the checks and the table below all read it, so it is built once per write."""
    return np.asarray(ranges, dtype=np.int64).reshape(-1, 3)


def aligned(ranges: Sequence[ByteRange] | np.ndarray) -> bool:
    """Whether every range starts and ends on an ``ALIGN`` boundary."""
    return not (as_array(ranges) % ALIGN).any()


def pays(ranges: Sequence[ByteRange] | np.ndarray) -> bool:
    """Whether the copy kernel beats UCX for these ranges (many, small)."""
    r = as_array(ranges)
    return len(r) >= MIN_RANGES and int(r[:, 2].sum()) <= MAX_MEAN_BYTES * len(r)


def chunk_table(ranges: Sequence[ByteRange] | np.ndarray) -> np.ndarray:
    """[3, pieces] int64: source word, destination word and length in words of
    every piece of at most ``PIECE_WORDS`` of the ``WORD``-aligned ranges (the
    kernel gives each piece ``PIECE_CHUNKS`` programs of ``CHUNK_WORDS``)."""
    r = as_array(ranges) // WORD
    r = r[r[:, 2] > 0]
    counts = -(-r[:, 2] // PIECE_WORDS)
    if (counts == 1).all():
        return np.ascontiguousarray(r.T)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    step = (np.arange(int(counts.sum()), dtype=np.int64) - first) * PIECE_WORDS
    out = np.empty((3, step.size), dtype=np.int64)
    out[0] = np.repeat(r[:, 0], counts) + step
    out[1] = np.repeat(r[:, 1], counts) + step
    out[2] = np.minimum(np.repeat(r[:, 2], counts) - step, PIECE_WORDS)
    return out


@cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def copy_pieces(src, dst, table, pieces, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        start = tl.program_id(1) * BLOCK
        n = tl.load(table + 2 * pieces + i) - start
        # Offsets are in whole 16-byte units (``aligned``): 128-bit accesses.
        s = tl.multiple_of(tl.load(table + i) + start, 2)
        d = tl.multiple_of(tl.load(table + pieces + i) + start, 2)
        offs = tl.arange(0, BLOCK)
        if n >= BLOCK:  # unmasked, so the accesses stay vectorized
            tl.store(dst + d + offs, tl.load(src + s + offs))
        elif n > 0:
            keep = offs < n
            tl.store(dst + d + offs, tl.load(src + s + offs, mask=keep), mask=keep)

    return copy_pieces


def copy_ranges(src: torch.Tensor, dst: torch.Tensor, table: torch.Tensor) -> None:
    """Copy the pieces of ``table`` (``chunk_table``, on the device) from the
    flat uint8 ``src`` into the flat uint8 ``dst`` on the current stream."""
    pieces = table.shape[1]
    if pieces == 0:
        return
    _kernel()[(pieces, PIECE_CHUNKS)](
        src.view(torch.int64), dst.view(torch.int64), table, pieces, BLOCK=CHUNK_WORDS, num_warps=8
    )


class IpcWriter:
    """Writes into opened peer buffers from a side stream: each write waits for
    what the caller's stream has queued so far (the KV it copies was computed
    there), runs while that stream goes on, and ends with an event to poll.

    The piece tables go up from pinned buffers that are kept and reused once
    the copy that read one has ended (pinning memory per write cost more than
    the copy of a few hundred pages)."""

    def __init__(self, local: torch.Tensor) -> None:
        self.local = local.view(-1).view(torch.uint8)
        self.device = local.device
        self.stream = torch.cuda.Stream(self.device)
        self._staging: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []

    def _pinned(self, words: int) -> int:
        """Index of a free pinned buffer of at least ``words`` int64."""
        for i, (buf, used) in enumerate(self._staging):
            if buf.numel() >= words and (used is None or used.query()):
                return i
        size = max(1024, 1 << (words - 1).bit_length())
        self._staging.append((torch.empty(size, dtype=torch.int64).pin_memory(), None))
        return len(self._staging) - 1

    def start(
        self, peer: torch.Tensor, ranges: Sequence[ByteRange] | np.ndarray
    ) -> tuple[torch.cuda.Event, Any]:
        """Queue the copy of ``ranges``; returns its completion event and what
        must stay alive until then (the piece table on the device)."""
        table = chunk_table(ranges)
        i = self._pinned(table.size)
        buf = self._staging[i][0]
        buf.numpy()[: table.size] = table.reshape(-1)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        done = torch.cuda.Event()
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            dev = buf[: table.size].to(self.device, non_blocking=True).view(3, -1)
            copy_ranges(self.local, peer, dev)
            done.record(self.stream)
        self._staging[i] = (buf, done)
        return done, dev
