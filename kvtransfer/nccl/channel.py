"""Two-rank communicators: the data path of the nccl backend.

A ``Channel`` connects the two ends of one (writer, receiver) pair. Rank 0 (the
writer) makes a rendezvous (``offer``), the receiver learns it over the
authenticated control connection and both ``join`` it; from then on ``post``
queues sends and receives of byte ranges of the registered buffer, and
``wait`` bounds how long they may take. A channel that failed or timed out is
``abort``ed and never used again: the pair builds a new one.

Two implementations behind one interface, chosen by the buffer's device:

* ``NcclChannel`` (CUDA buffers): an NCCL communicator through ``nccl4py``,
  created non-blocking so that its creation can time out and be aborted. The
  ranges of one post travel inside one group call (``ncclGroupStart/End``) on a
  side stream that first waits for the compute stream.
* ``GlooChannel`` (CPU buffers): a gloo process group of torch.distributed,
  built directly from a ``TCPStore`` the writer hosts (no global process
  group, no rank table). It runs the same protocol on any host, which is how
  CI covers the backend.

Ranges are sent as they are, one message each, when they are large; many
small ranges (tensor-parallel head slices, scattered small pages) go through
a staging buffer: gathered into one message by the sender and scattered into
place by the receiver (``STAGE_BELOW_BYTES``).
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec
import torch

STAGE_BELOW_BYTES = 256 << 10
"""A post whose ranges average fewer bytes goes through a staging buffer."""


class Span(NamedTuple):
    """``nbytes`` at ``offset`` of a buffer (one side of a ``ByteRange``)."""

    offset: int
    nbytes: int


class ChannelError(RuntimeError):
    """The channel failed or timed out; it must be aborted."""


def staged(spans: Sequence[Span]) -> bool:
    """Whether ``spans`` travel through a staging buffer (one message)."""
    total = sum(s.nbytes for s in spans)
    return len(spans) > 1 and total < STAGE_BELOW_BYTES * len(spans)


def gather(buf: torch.Tensor, spans: Sequence[Span]) -> torch.Tensor:
    """The bytes of ``spans`` of ``buf`` (uint8, one dimension), back to back."""
    return torch.cat([buf[s.offset : s.offset + s.nbytes] for s in spans])


def scatter(buf: torch.Tensor, spans: Sequence[Span], staging: torch.Tensor) -> None:
    """Write ``staging`` (``gather``'s layout) into ``spans`` of ``buf``."""
    at = 0
    for s in spans:
        buf[s.offset : s.offset + s.nbytes].copy_(staging[at : at + s.nbytes], non_blocking=True)
        at += s.nbytes


class Op:
    """Posted sends and receives; ``Channel.wait`` ends them."""


class Channel(ABC):
    """One end of a two-rank communicator over a registered uint8 buffer."""

    rank: int

    @classmethod
    @abstractmethod
    def offer(cls, host: str) -> tuple[bytes, Any]:
        """A new rendezvous for rank 0 to create and rank 1 to join: the bytes
        the peer needs, and what rank 0 must keep until it has joined."""

    @classmethod
    @abstractmethod
    def join(
        cls, rendezvous: bytes, rank: int, buf: torch.Tensor, host: str, timeout_s: float, kept: Any
    ) -> Channel:
        """Join ``rendezvous`` as ``rank`` (blocks until both ranks have, or
        raises ``ChannelError`` after ``timeout_s``)."""

    @abstractmethod
    def post(
        self, sends: Sequence[Span], recvs: Sequence[Span], peer: int, stage: bool | None = None
    ) -> Op:
        """Queue sends of ``sends`` to and receives into ``recvs`` from ``peer``
        (all within one group call where the library has them). ``stage``:
        force (True) or forbid (False) the staging buffer; None decides by the
        ranges' sizes (``staged``). Both ends must decide alike."""

    @abstractmethod
    def wait(self, op: Op, deadline: float) -> None:
        """Return once ``op`` has completed (its received bytes are in the
        buffer); ``ChannelError`` on failure or at ``deadline`` (monotonic)."""

    @abstractmethod
    def abort(self) -> None:
        """End the communicator and whatever it still has in flight; the
        buffer is not touched by it afterwards. Safe to call twice and from
        another thread."""


# ---------------------------------------------------------------------- gloo


class _GlooRendezvous(msgspec.Struct, frozen=True, array_like=True):
    host: str
    port: int


class _GlooOp(Op):
    def __init__(self, works: list[Any], unstage: tuple[list[Span], torch.Tensor] | None) -> None:
        self.works = works
        self.unstage = unstage


class GlooChannel(Channel):
    """A gloo process group of two ranks (CPU buffers)."""

    def __init__(self, pg: Any, rank: int, buf: torch.Tensor, store: Any) -> None:
        self.pg = pg
        self.rank = rank
        self.buf = buf
        self._store = store  # the rendezvous store lives as long as the group
        self._tag = 0
        self._aborted = False

    @classmethod
    def offer(cls, host: str) -> tuple[bytes, Any]:
        import torch.distributed as dist

        store = dist.TCPStore(
            host, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60)
        )
        return msgspec.msgpack.encode(_GlooRendezvous(host, store.port)), store

    @classmethod
    def join(
        cls, rendezvous: bytes, rank: int, buf: torch.Tensor, host: str, timeout_s: float, kept: Any
    ) -> Channel:
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            rv = msgspec.msgpack.decode(rendezvous, type=_GlooRendezvous)
            store = kept
            if store is None:
                store = dist.TCPStore(rv.host, rv.port, is_master=False, timeout=timeout)
            opts = dist.ProcessGroupGloo._Options()
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            opts._timeout = timeout
            opts._threads = 2
            pg = dist.ProcessGroupGloo(store, rank, 2, opts)
        except (RuntimeError, ValueError, msgspec.DecodeError) as e:
            raise ChannelError(f"gloo rendezvous failed: {e}") from None
        return cls(pg, rank, buf, store)

    def _next_tag(self) -> int:
        self._tag = (self._tag + 1) % (1 << 30)
        return self._tag

    def post(
        self, sends: Sequence[Span], recvs: Sequence[Span], peer: int, stage: bool | None = None
    ) -> Op:
        if self._aborted:
            raise ChannelError("the channel was aborted")
        works: list[Any] = []
        unstage = None
        try:
            # Tags follow the order of posts, which both ends share.
            if sends:
                stage_sends = staged(sends) if stage is None else stage
                parts = [gather(self.buf, sends)] if stage_sends else self._views(sends)
                works += [self.pg.send([t], peer, self._next_tag()) for t in parts]
            if recvs:
                if staged(recvs) if stage is None else stage:
                    staging = torch.empty(sum(s.nbytes for s in recvs), dtype=torch.uint8)
                    works.append(self.pg.recv([staging], peer, self._next_tag()))
                    unstage = (list(recvs), staging)
                else:
                    works += [self.pg.recv([t], peer, self._next_tag()) for t in self._views(recvs)]
        except RuntimeError as e:
            raise ChannelError(f"gloo could not post: {e}") from None
        return _GlooOp(works, unstage)

    def _views(self, spans: Sequence[Span]) -> list[torch.Tensor]:
        return [self.buf[s.offset : s.offset + s.nbytes] for s in spans]

    def wait(self, op: Op, deadline: float) -> None:
        assert isinstance(op, _GlooOp)
        for work in op.works:
            left = deadline - time.monotonic()
            if self._aborted:
                raise ChannelError("the channel was aborted")
            if left <= 0:
                raise ChannelError("timed out")
            try:
                work.wait(datetime.timedelta(seconds=left))
            except RuntimeError as e:
                raise ChannelError(
                    "the channel was aborted" if self._aborted else f"gloo: {e}"
                ) from None
        if op.unstage is not None:
            scatter(self.buf, *op.unstage)

    def abort(self) -> None:
        if self._aborted:
            return
        self._aborted = True
        with contextlib.suppress(RuntimeError):
            self.pg.abort()


# ---------------------------------------------------------------------- NCCL


def import_nccl() -> Any:
    """``nccl.core`` (the nccl4py package); ImportError says how to get it."""
    try:
        import nccl.core as nc
    except ImportError as e:
        raise ImportError(
            f"the nccl transfer backend on CUDA needs nccl4py (pip install nccl4py[cu13]): {e}"
        ) from e
    return nc


class _NcclOp(Op):
    def __init__(self, done: torch.cuda.Event, keep: Any) -> None:
        self.done = done
        self.keep = keep
        """What the queued kernels read or write until ``done`` (staging)."""


_POLL_S = 50e-6


class NcclChannel(Channel):
    """An NCCL communicator of one or two ranks (CUDA buffers)."""

    def __init__(self, comm: Any, rank: int, buf: torch.Tensor) -> None:
        self.nc = import_nccl()
        self.comm = comm
        self.rank = rank
        self.buf = buf
        self.stream = torch.cuda.Stream(buf.device)
        self._aborted = False
        self._lock = threading.Lock()
        """Held around calls into the communicator: ``abort`` may come from
        another thread."""

    @classmethod
    def offer(cls, host: str) -> tuple[bytes, Any]:
        return bytes(import_nccl().get_unique_id()), None

    @classmethod
    def join(
        cls, rendezvous: bytes, rank: int, buf: torch.Tensor, host: str, timeout_s: float, kept: Any
    ) -> Channel:
        return cls.create(rendezvous, 2, rank, buf, timeout_s)

    @classmethod
    def create(
        cls, rendezvous: bytes, nranks: int, rank: int, buf: torch.Tensor, timeout_s: float
    ) -> NcclChannel:
        """A communicator of ``nranks`` (1: a rank that sends to itself)."""
        nc = import_nccl()
        torch.cuda.set_device(buf.device)
        uid = nc.UniqueId.from_bytes(rendezvous)
        comm = nc.Communicator.init(nranks, rank, uid, nc.NCCLConfig(blocking=False))
        channel = cls(comm, rank, buf)
        channel._settle(time.monotonic() + timeout_s, "creating the communicator")
        return channel

    def _settle(self, deadline: float, what: str) -> None:
        """Wait for a non-blocking call to finish (``ncclInProgress`` ends)."""
        success, in_progress = 0, 7  # ncclSuccess, ncclInProgress
        while True:
            with self._lock:
                if self._aborted:
                    raise ChannelError("the channel was aborted")
                state = int(self.comm.get_async_error())
            if state == success:
                return
            if state != in_progress:
                raise ChannelError(f"NCCL error {state} while {what}")
            if time.monotonic() > deadline:
                raise ChannelError(f"timed out {what}")
            time.sleep(_POLL_S)

    def post(
        self, sends: Sequence[Span], recvs: Sequence[Span], peer: int, stage: bool | None = None
    ) -> Op:
        if self._aborted:
            raise ChannelError("the channel was aborted")
        nc = self.nc
        stream = self.stream
        # The pages were written by kernels queued on the compute stream.
        stream.wait_stream(torch.cuda.current_stream(self.buf.device))
        keep: list[Any] = []
        with torch.cuda.stream(stream):
            send_parts = list(self._views(sends))
            if sends and (staged(sends) if stage is None else stage):
                send_parts = [gather(self.buf, sends)]
            recv_parts = list(self._views(recvs))
            staging = None
            if recvs and (staged(recvs) if stage is None else stage):
                staging = torch.empty(
                    sum(s.nbytes for s in recvs), dtype=torch.uint8, device=self.buf.device
                )
                recv_parts = [staging]
            keep += send_parts + recv_parts
            try:
                with self._lock:
                    if self._aborted:
                        raise ChannelError("the channel was aborted")
                    nc.group_start()
                    try:
                        for t in send_parts:
                            self.comm.send(t, peer, stream=stream.cuda_stream)
                        for t in recv_parts:
                            self.comm.recv(t, peer, stream=stream.cuda_stream)
                    finally:
                        nc.group_end()
                self._settle(time.monotonic() + 60.0, "posting")
            except ChannelError:
                raise
            except Exception as e:  # noqa: BLE001 (any binding error ends the channel)
                raise ChannelError(f"NCCL could not post: {e}") from None
            if staging is not None:
                scatter(self.buf, recvs, staging)
            done = torch.cuda.Event()
            done.record(stream)
        return _NcclOp(done, keep)

    def _views(self, spans: Sequence[Span]) -> list[torch.Tensor]:
        return [self.buf[s.offset : s.offset + s.nbytes] for s in spans]

    def wait(self, op: Op, deadline: float) -> None:
        assert isinstance(op, _NcclOp)
        while not op.done.query():
            if self._aborted:
                raise ChannelError("the channel was aborted")
            if time.monotonic() > deadline:
                raise ChannelError("timed out")
            time.sleep(_POLL_S)
        with self._lock:
            if self._aborted or int(self.comm.get_async_error()) != 0:
                raise ChannelError("the channel was aborted or NCCL reported an error")
        op.keep = None

    def abort(self) -> None:
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
            # ncclCommAbort ends the kernels still in flight; one that fails
            # leaves nothing more to do.
            with contextlib.suppress(Exception):
                self.comm.abort()


def channel_class(buf: torch.Tensor) -> type[Channel]:
    """The channel for a buffer: NCCL on CUDA, gloo on the CPU."""
    return NcclChannel if buf.device.type == "cuda" else GlooChannel
