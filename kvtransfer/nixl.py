"""NIXL transfer backend (UCX underneath): one-sided writes into a peer's
registered buffer, host (DRAM) or GPU (VRAM) memory.

``nixl`` is imported lazily, so this module imports without it. The PyPI
meta package ``nixl`` exposes the API as ``nixl._api``; the per-CUDA wheels
(``nixl-cu12`` / ``nixl-cu13``) also work alone, as ``nixl_cu12._api`` etc.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import torch

from kvtransfer import cuda_ipc
from kvtransfer.backend import ByteRange, TransferBackend, TransferError, TransferState
from kvtransfer.layout import buffer_nbytes, check_ranges

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 10.0
_API_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")


def import_nixl() -> Any:
    """The ``nixl._api`` module (or a per-CUDA equivalent); ImportError says why not."""
    errors = []
    for name in _API_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as e:  # includes a CUDA-variant mismatch inside the meta package
            errors.append(f"{name}: {e}")
    raise ImportError("NIXL is not usable (pip install nixl): " + "; ".join(errors))


PROGRESS_DELAY_US = 100
"""Pause of the agent's progress thread between rounds. The Python API starts
that thread with no pause, so it spins a core even when nothing is in flight
(a whole core on a CPU host, a fifth to a quarter on the GPU machine). The
thread must stay (over TCP or shared memory a write lands only while the
receiver's side progresses, and the receiver does not poll), so it sleeps:
idle it then costs little (docs/perf/2026-12-01-kv-transfer-paths.md), and a
transfer's completion is seen at most this much later."""


@contextlib.contextmanager
def _progress_delay(api: Any, delay_us: int) -> Iterator[None]:
    """Agents created inside get ``delay_us`` as their progress-thread pause:
    the API sets the pause on its config object to 0 just before creating the
    agent, so the config class is swapped for one that keeps ours."""
    bind = api.nixlBind
    base = bind.nixlAgentConfig

    class _Config(base):  # type: ignore[misc, valid-type]
        def __setattr__(self, name: str, value: Any) -> None:
            super().__setattr__(name, delay_us if name == "pthrDelay" else value)

    bind.nixlAgentConfig = _Config
    try:
        yield
    finally:
        bind.nixlAgentConfig = base


def nixl_available() -> tuple[bool, str]:
    """``(True, "")`` when NIXL imports, else ``(False, reason)``."""
    try:
        import_nixl()
    except ImportError as e:
        return False, str(e)
    return True, ""


class NixlMetadata(msgspec.Struct, frozen=True):
    agent: str
    agent_md: bytes
    """``nixl_agent.get_agent_metadata()``: connection info + registrations."""
    base: int
    nbytes: int
    device_id: int
    mem_type: str  # "DRAM" or "VRAM"
    ipc: cuda_ipc.IpcExport | None = None
    """The buffer as a CUDA IPC handle, for writers on the same host
    (``kvtransfer.cuda_ipc``); None for host memory or when it cannot be
    exported. A default, so that peers without it decode it as None."""


_encode = msgspec.msgpack.Encoder().encode
_decode_meta = msgspec.msgpack.Decoder(NixlMetadata).decode


@dataclass(eq=False)
class _Xfer:
    peer: str
    handle: Any | None  # nixl_xfer_handle, None once released or never created
    state: TransferState
    deadline: float
    error: str | None = None
    done: torch.cuda.Event | None = None
    """A CUDA IPC write: the event recorded after its copy (it has no NIXL handle)."""
    keep: Any = None
    """What a CUDA IPC write's copy reads until ``done``: its chunk table and the
    peer's mapped buffer."""


class NixlBackend(TransferBackend):
    """Args:
    agent_name: NIXL agent name; peers must ``connect`` to it under this name.
    backends: NIXL plugins to instantiate (UCX moves DRAM and VRAM).
    timeout: seconds a write may stay in progress before it is FAILED (and
        aborted); guards against a peer that died mid-transfer.
    num_threads: UCX worker threads (0: NIXL's default).
    cuda_ipc: write into peers on this host by a copy kernel through CUDA IPC
        (``kvtransfer.cuda_ipc``) instead of UCX, where the peer can be opened
        that way; False: always UCX.
    """

    name = "nixl"

    def __init__(
        self,
        agent_name: str,
        backends: Sequence[str] = ("UCX",),
        timeout: float = DEFAULT_TIMEOUT_S,
        num_threads: int = 0,
        cuda_ipc: bool = True,
    ) -> None:
        super().__init__(agent_name)
        self.cuda_ipc = cuda_ipc
        api = import_nixl()
        self.timeout = float(timeout)
        self.last_error: str | None = None
        config = api.nixl_agent_config(backends=list(backends), num_threads=num_threads)
        with _progress_delay(api, PROGRESS_DELAY_US):
            self._agent = api.nixl_agent(agent_name, config)
        missing = [b for b in backends if b not in self._agent.backends]
        if missing:
            raise TransferError(
                f"NIXL plugin(s) {missing} unavailable; have {self._agent.get_plugin_list()}"
            )
        self._reg_descs: Any | None = None
        self._buffer: torch.Tensor | None = None
        self._local: tuple[int, int, int, str] | None = None  # base, nbytes, dev, mem
        self._peers: dict[str, tuple[bytes, NixlMetadata]] = {}
        self._xfers: dict[int, _Xfer] = {}
        self._handles = itertools.count(1)
        self._leaked: list[Any] = []
        self._closed = False
        self._export: cuda_ipc.IpcExport | None = None
        self._ipc_writer: cuda_ipc.IpcWriter | None = None
        self._ipc_peers: dict[str, torch.Tensor] = {}
        """Peers written through CUDA IPC: their opened buffers."""
        self._exited: set[str] = set()
        """Peers ``prune`` found gone: writes to them fail (they do not raise)."""

    # ------------------------------------------------------------------ API

    def register(self, buffer: torch.Tensor) -> None:
        self._check_open()
        if not buffer.is_contiguous():
            raise TransferError("the registered buffer must be contiguous")
        if buffer.device.type not in ("cpu", "cuda"):
            raise TransferError(f"NIXL backend cannot register {buffer.device} memory")
        if self._reg_descs is not None:
            self._agent.deregister_memory(self._reg_descs)
            self._reg_descs = None
        mem = "DRAM" if buffer.device.type == "cpu" else "VRAM"
        dev = 0 if mem == "DRAM" else buffer.device.index or 0
        base, nbytes = buffer.data_ptr(), buffer_nbytes(buffer)
        try:
            self._reg_descs = self._agent.register_memory([(base, nbytes, dev, "")], mem)
        except Exception as e:
            raise TransferError(f"NIXL could not register {nbytes} bytes of {mem}: {e}") from e
        self._buffer = buffer
        self._local = (base, nbytes, dev, mem)
        if self.cuda_ipc and mem == "VRAM":
            self._export = cuda_ipc.export_buffer(buffer)

    def metadata(self) -> bytes:
        if self._local is None:
            raise TransferError("register() a buffer before publishing metadata")
        base, nbytes, dev, mem = self._local
        md = self._agent.get_agent_metadata()
        return _encode(
            NixlMetadata(self.agent_name, bytes(md), base, nbytes, dev, mem, self._export)
        )

    def connect(self, peer: str, metadata: bytes) -> None:
        self._check_open()
        metadata = bytes(metadata)
        known = self._peers.get(peer)
        if known is not None and known[0] == metadata:
            return
        self._exited.discard(peer)
        try:
            meta = _decode_meta(metadata)
        except msgspec.DecodeError as e:
            raise TransferError(f"bad nixl metadata for peer {peer!r}: {e}") from None
        if meta.agent != peer:
            raise TransferError(f"metadata is for agent {meta.agent!r}, not {peer!r}")
        if known is not None:  # peer restarted or re-registered: reload its metadata
            self._forget(peer)
        try:
            name = self._agent.add_remote_agent(meta.agent_md)
        except Exception as e:
            raise TransferError(f"NIXL could not load metadata of {peer!r}: {e}") from e
        if isinstance(name, bytes):
            name = name.decode()
        if name != peer:
            self._agent.remove_remote_agent(name)
            raise TransferError(f"NIXL metadata names agent {name!r}, not {peer!r}")
        self._peers[peer] = (metadata, meta)
        self._open_ipc(peer, meta)

    def prune(self) -> list[str]:
        gone = []
        for peer in list(self._ipc_peers):
            ipc = self._peers[peer][1].ipc
            if ipc is not None and cuda_ipc.exporter_gone(ipc):
                logger.info("%s: peer %s has exited; its pool is unmapped", self.agent_name, peer)
                self._forget(peer)
                self._exited.add(peer)
                gone.append(peer)
        return gone

    def path(self, peer: str, ranges: Sequence[ByteRange]) -> str:
        """How a write of ``ranges`` to ``peer`` travels: "cuda_ipc" or "ucx"."""
        return "ucx" if self._ipc_ranges(peer, ranges) is None else "cuda_ipc"

    def _ipc_ranges(self, peer: str, ranges: Sequence[ByteRange]) -> np.ndarray | None:
        """``ranges`` as an array when the copy kernel takes them to ``peer``."""
        if peer not in self._ipc_peers:
            return None
        r = cuda_ipc.as_array(ranges)
        return r if cuda_ipc.pays(r) and cuda_ipc.aligned(r) else None

    def route(self, peer: str) -> str:
        """How writes to ``peer`` may travel: "cuda_ipc" (many small ranges go
        through the copy kernel, few large ones through UCX) or "ucx"."""
        return "cuda_ipc" if peer in self._ipc_peers else "ucx"

    def write(self, peer: str, ranges: Sequence[ByteRange]) -> int:
        self._check_open()
        if self._local is None:
            raise TransferError("register() a buffer before writing")
        known = self._peers.get(peer)
        if known is None and peer not in self._exited:
            raise TransferError(f"unknown peer {peer!r}: connect() it first")
        ranges = [ByteRange(*map(int, r)) for r in ranges if r[2] != 0]
        handle = next(self._handles)
        xfer = _Xfer(peer, None, TransferState.PENDING, time.monotonic() + self.timeout)
        self._xfers[handle] = xfer
        if known is None:
            self._fail(xfer, f"write to {peer!r} refused: the peer has exited")
            return handle
        meta = known[1]
        if not ranges:
            xfer.state = TransferState.DONE
            return handle
        base, nbytes, dev, mem = self._local
        error = check_ranges(ranges, nbytes, meta.nbytes)
        if error is not None:
            self._fail(xfer, f"write to {peer!r} refused: {error}")
            return handle
        ipc_ranges = self._ipc_ranges(peer, ranges)
        if ipc_ranges is not None:
            assert self._ipc_writer is not None
            peer_buf = self._ipc_peers[peer]
            try:
                xfer.done, table = self._ipc_writer.start(peer_buf, ipc_ranges)
            except Exception as e:
                self._fail(xfer, f"CUDA IPC write to {peer!r} failed to start: {e}")
                return handle
            xfer.keep = (table, peer_buf)
            return handle
        n = len(ranges)
        r = np.asarray(ranges, dtype=np.uint64).reshape(n, 3)
        local = np.empty((n, 3), dtype=np.uint64)
        local[:, 0] = r[:, 0] + np.uint64(base)
        local[:, 1] = r[:, 2]
        local[:, 2] = dev
        remote = np.empty((n, 3), dtype=np.uint64)
        remote[:, 0] = r[:, 1] + np.uint64(meta.base)
        remote[:, 1] = r[:, 2]
        remote[:, 2] = meta.device_id
        try:
            src = self._agent.get_xfer_descs(local, mem)
            dst = self._agent.get_xfer_descs(remote, meta.mem_type)
            xfer.handle = self._agent.initialize_xfer("WRITE", src, dst, peer)
            status = self._agent.transfer(xfer.handle)
        except Exception as e:
            self._fail(xfer, f"NIXL write to {peer!r} failed to start: {e}")
            return handle
        if status == "DONE":
            self._settle(xfer, TransferState.DONE)
        elif status == "ERR":
            self._fail(xfer, f"NIXL write to {peer!r} failed to post")
        return handle

    def poll(self, handle: int) -> TransferState:
        xfer = self._xfers.get(handle)
        if xfer is None:
            raise TransferError(f"unknown transfer handle {handle}")
        if xfer.state is TransferState.PENDING and xfer.done is not None:
            # No deadline: a kernel cannot be aborted, and the peer's pages
            # must not be reused while it may still write them; it ends in
            # the time its bytes take.
            if xfer.done.query():
                self._settle(xfer, TransferState.DONE)
        elif xfer.state is TransferState.PENDING:
            try:
                status = self._agent.check_xfer_state(xfer.handle)
            except Exception as e:
                status, why = "ERR", str(e)
            else:
                why = "transfer error reported by NIXL"
            if status == "DONE":
                self._settle(xfer, TransferState.DONE)
            elif status == "ERR":
                self._fail(xfer, f"write to {xfer.peer!r} failed: {why}")
            elif time.monotonic() > xfer.deadline:
                self._fail(xfer, f"write to {xfer.peer!r} timed out after {self.timeout:g}s")
        if xfer.state is TransferState.PENDING:
            return xfer.state
        del self._xfers[handle]
        if xfer.state is TransferState.FAILED:
            self.last_error = xfer.error
        return xfer.state

    def disconnect(self, peer: str) -> None:
        if self._closed or peer not in self._peers:
            return
        self._forget(peer)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._ipc_writer is not None:
            self._ipc_writer.stream.synchronize()  # no copy may outlive the backend
        for xfer in self._xfers.values():
            if xfer.state is TransferState.PENDING:
                self._fail(xfer, "backend closed")
        self._xfers.clear()
        for peer in list(self._peers):
            self._forget(peer)
        if self._reg_descs is not None:
            try:
                self._agent.deregister_memory(self._reg_descs)
            except Exception:
                logger.exception("NIXL deregister_memory failed")
            self._reg_descs = None
        self._buffer = None
        self._leaked.clear()
        self._agent = None

    # ------------------------------------------------------------- internals

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("backend is closed")

    def _open_ipc(self, peer: str, meta: NixlMetadata) -> None:
        """Write into ``peer`` through CUDA IPC from now on, if it can be opened."""
        if not self.cuda_ipc or meta.ipc is None or self._buffer is None:
            return
        if not self._buffer.is_cuda or meta.ipc.nbytes != meta.nbytes:
            return
        opened = cuda_ipc.open_buffer(meta.ipc, self._buffer.device)
        if opened is None:
            return
        if self._ipc_writer is None:
            self._ipc_writer = cuda_ipc.IpcWriter(self._buffer)
        self._ipc_peers[peer] = opened
        logger.info("%s: writes to %s go through CUDA IPC", self.agent_name, peer)

    def _forget(self, peer: str) -> None:
        for xfer in self._xfers.values():
            # A copy already queued on the device runs to its end (its event
            # is no longer polled; what it reads stays referenced by it).
            if xfer.peer == peer and xfer.state is TransferState.PENDING and xfer.done is None:
                self._fail(xfer, f"peer {peer!r} was disconnected")
        self._ipc_peers.pop(peer, None)
        self._peers.pop(peer, None)
        try:
            self._agent.remove_remote_agent(peer)
        except Exception as e:
            logger.warning("NIXL remove_remote_agent(%r) failed: %s", peer, e)

    def _release(self, xfer: _Xfer) -> None:
        if xfer.handle is None:
            return
        try:
            xfer.handle.release()  # aborts it when still in flight
        except Exception as e:
            # NIXL could not abort it: keep the handle alive rather than free
            # memory a backend thread may still touch.
            logger.warning("NIXL could not release a transfer handle: %s", e)
            self._leaked.append(xfer.handle)
        xfer.handle = None

    def _settle(self, xfer: _Xfer, state: TransferState) -> None:
        xfer.state = state
        xfer.keep = None
        self._release(xfer)

    def _fail(self, xfer: _Xfer, error: str) -> None:
        xfer.error = error
        logger.warning("%s: %s", self.agent_name, error)
        self._settle(xfer, TransferState.FAILED)
