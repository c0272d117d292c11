"""The prefill engine's end of the KV plane: a ROUTER that decode engines
connect to; handshakes, reservations, and pushes of KV pages."""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import msgspec
import zmq

from kvtransfer import to_decode, to_prefill
from kvtransfer.backend import ByteRange, TransferBackend, TransferState
from kvtransfer.compat import compat_hash, describe_mismatch, verify
from kvtransfer.endpoint import bind_router
from kvtransfer.tp_map import HeadSlice, RankLayout, parse_layout, plan, slice_ranges

log = logging.getLogger(__name__)

PRUNE_INTERVAL_S = 0.5


class RankWriters(Protocol):
    """The transfer agents of this engine's tensor-parallel ranks 1..N-1
    (rank 0's is the plane's ``backend``)."""

    def connect(self, rank: int, peer: str, metadata: bytes) -> None: ...

    def write(self, rank: int, peer: str, ranges: list[ByteRange]) -> int: ...

    def poll(self, handle: int) -> TransferState: ...

    def prune(self) -> None: ...


class _Route(NamedTuple):
    """How KV reaches one decode engine: the head slices each prefill rank
    writes, the decode side's ranks and their agent names."""

    slices: list[HeadSlice]
    layout: RankLayout
    agents: list[str]


class PrefillKVPlane:
    def __init__(
        self,
        host: str,
        port: int,
        backend: TransferBackend,
        compat: dict[str, str],
        cluster_token: str,
        page_bytes: int,
        ranks: RankWriters | None = None,
    ) -> None:
        """``ranks``: with tensor parallelism, the agents of ranks 1..N-1."""
        self.backend = backend
        self.compat = compat
        self.cluster_token = cluster_token
        self.page_bytes = page_bytes
        self.ranks = ranks
        layout = parse_layout(compat)
        assert not isinstance(layout, str), layout
        self._layout = layout
        self._rows = int(compat["num_layers"]) * 2 * int(compat["page_size"])
        """Rows of a page: (layer, K or V, slot)."""
        self._routes: dict[str, _Route] = {}
        self._writes: dict[int, list[tuple[int, int]]] = {}
        """Write handle -> its parts not yet ended: (prefill rank, handle there)."""
        self._failed_writes: set[int] = set()
        self._write_ids = itertools.count(1)
        self._sock, self.endpoint = bind_router(host, port)
        self._identity: dict[str, bytes] = {}
        """Handshaken decode engines: name -> ZMQ identity."""
        self._names: dict[bytes, str] = {}
        self._agents: dict[str, str] = {}
        """Decode engine name -> its transfer-backend agent name."""
        self.rejected: dict[str, str] = {}
        """Decode engines whose handshake failed, with the reason."""
        self._next_prune = 0.0

    def poll(self) -> list[tuple[str, to_prefill.Reserve | to_prefill.AbortRoom]]:
        """Handle pending messages; returns reservations and aborts with the
        name of the decode engine that sent them."""
        events: list[tuple[str, to_prefill.Reserve | to_prefill.AbortRoom]] = []
        now = time.monotonic()
        if now >= self._next_prune:
            # A decode engine that exited may hold nothing of ours, but we may
            # hold its pool (CUDA IPC): a restarted engine on the same GPU
            # needs that memory back before it can start.
            self._next_prune = now + PRUNE_INTERVAL_S
            self.backend.prune()
            if self.ranks is not None:
                self.ranks.prune()
        while True:
            try:
                ident, payload = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return events
            except ValueError:
                continue
            try:
                msg = to_prefill.decoder.decode(payload)
            except msgspec.DecodeError as e:
                log.warning("dropping malformed KV-plane frame: %s", e)
                continue
            if isinstance(msg, to_prefill.Handshake):
                self._handshake(ident, msg)
            elif ident in self._names:
                events.append((self._names[ident], msg))
            else:
                log.warning("dropping %s from a peer without a handshake", type(msg).__name__)

    def sockets(self) -> list[zmq.Socket]:
        """The sockets whose messages ``poll`` reads."""
        return [self._sock]

    def has_pending(self) -> bool:
        """True when a KV-plane message waits to be handled by ``poll``."""
        return bool(self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    def _handshake(self, ident: bytes, msg: to_prefill.Handshake) -> None:
        reason = None
        if not verify(
            self.cluster_token, msg.mac, msg.decode_name, compat_hash(msg.compat), msg.nonce
        ):
            reason = "KV plane refused the peer: cluster token mismatch"
        else:
            reason = describe_mismatch(self.compat, msg.compat)
        route: _Route | str = ""
        if reason is None:
            route = self._route(msg)
            if isinstance(route, str):
                reason = "prefill and decode workers are incompatible: " + route
        if reason is None:
            assert isinstance(route, _Route)
            try:
                self._connect(msg, route)
            except Exception as e:  # noqa: BLE001 (any backend failure is reported to the peer)
                reason = f"transfer backend could not connect: {e}"
        if reason is not None:
            log.warning("handshake from %s rejected: %s", msg.decode_name, reason)
            self.rejected[msg.decode_name] = reason
            self._send_ident(ident, to_decode.HandshakeRejected(reason))
            return
        self.rejected.pop(msg.decode_name, None)
        self._identity[msg.decode_name] = ident
        self._names[ident] = msg.decode_name
        self._agents[msg.decode_name] = msg.agent
        assert isinstance(route, _Route)
        self._routes[msg.decode_name] = route
        log.info("KV plane connected to decode engine %s", msg.decode_name)
        self._send_ident(ident, to_decode.HandshakeOk(self.endpoint))

    def is_connected(self, decode_name: str) -> bool:
        return decode_name in self._identity

    def _route(self, msg: to_prefill.Handshake) -> _Route | str:
        """Which of our ranks writes which heads into which of the peer's."""
        slices = plan(self.compat, msg.compat)
        if isinstance(slices, str):
            return slices
        layout = parse_layout(msg.compat)
        assert not isinstance(layout, str)
        if len(msg.ranks) + 1 != len(layout.heads):
            return (
                f"decode tp_size is {len(layout.heads)} but its handshake names "
                f"{len(msg.ranks) + 1} rank agent(s)"
            )
        if self.ranks is None and len(self._layout.heads) > 1:
            return "this prefill engine's tensor-parallel ranks have no transfer agents"
        return _Route(slices, layout, [msg.agent, *(r.agent for r in msg.ranks)])

    def _connect(self, msg: to_prefill.Handshake, route: _Route) -> None:
        metadata = [msg.metadata, *(r.metadata for r in msg.ranks)]
        for src, dst in sorted({(s.src, s.dst) for s in route.slices}):
            if src == 0:
                self.backend.connect(route.agents[dst], metadata[dst])
            else:
                assert self.ranks is not None
                self.ranks.connect(src, route.agents[dst], metadata[dst])

    def write(self, decode_name: str, src_pages: Sequence[int], dst_pages: Sequence[int]) -> int:
        """Start writing our pages ``src_pages`` into the peer's ``dst_pages``:
        every rank of ours writes its heads into the peer ranks that hold them."""
        route = self._routes[decode_name]
        parts: list[tuple[int, int]] = []
        for s in route.slices:
            ranges = slice_ranges(s, self._layout, route.layout, self._rows, src_pages, dst_pages)
            peer = route.agents[s.dst]
            if s.src == 0:
                parts.append((0, self.backend.write(peer, ranges)))
            else:
                assert self.ranks is not None
                parts.append((s.src, self.ranks.write(s.src, peer, ranges)))
        handle = next(self._write_ids)
        self._writes[handle] = parts
        return handle

    def poll_write(self, handle: int) -> TransferState:
        """DONE once every rank's part has landed; FAILED once every part has
        ended and one failed (never while a part may still be writing)."""
        pending = []
        for rank, h in self._writes[handle]:
            if rank == 0:
                state = self.backend.poll(h)
            else:
                assert self.ranks is not None
                state = self.ranks.poll(h)
            if state == TransferState.PENDING:
                pending.append((rank, h))
            elif state == TransferState.FAILED:
                self._failed_writes.add(handle)
        if pending:
            self._writes[handle] = pending
            return TransferState.PENDING
        del self._writes[handle]
        if handle in self._failed_writes:
            self._failed_writes.discard(handle)
            return TransferState.FAILED
        return TransferState.DONE

    def send(self, decode_name: str, msg: to_decode.ToDecode) -> None:
        ident = self._identity.get(decode_name)
        if ident is not None:
            self._send_ident(ident, msg)

    def _send_ident(self, ident: bytes, msg: to_decode.ToDecode) -> None:
        try:
            self._sock.send_multipart([ident, to_decode.encoder.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.warning("KV-plane send failed: %s", e)

    def close(self) -> None:
        self._sock.close(0)
        self.backend.close()


def new_nonce() -> str:
    return secrets.token_hex(8)
