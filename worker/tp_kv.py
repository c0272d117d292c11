"""The KV transfer agents of a tensor-parallel engine's other ranks.

Every rank registers its own pool with an agent of its own; the lead rank's
agent is the KV plane's (``worker.kv_setup``). This opens one on each other
rank, connects them to peers, starts their writes and collects the writes'
ends, which the ranks report as events while the lead goes on."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any

import torch

from engine.parallel.follower import RankContext
from engine.parallel.ranks import LeadRunner
from kvtransfer import make_backend
from kvtransfer.backend import ByteRange, TransferBackend, TransferError, TransferState

log = logging.getLogger(__name__)

_STATE = "kv_agent"


class RankAgents:
    """Agents on ranks 1..N-1 of ``runner``, driven from the lead."""

    def __init__(
        self, runner: LeadRunner, backend_name: str, names: Sequence[str], kwargs: dict[str, Any]
    ) -> None:
        self.runner = runner
        self._ids = itertools.count(1)
        self._ended: dict[int, TransferState] = {}
        self._pending: set[int] = set()
        self.agents: list[tuple[str, bytes]] = []
        """(agent name, metadata) of ranks 1..N-1."""
        for rank, name in enumerate(names, start=1):
            self.agents.append(runner.call(rank, _open, backend_name, name, kwargs))

    @property
    def size(self) -> int:
        return len(self.agents) + 1

    def connect(self, rank: int, peer: str, metadata: bytes) -> None:
        self.runner.call(rank, _connect, peer, metadata)

    def write(self, rank: int, peer: str, ranges: list[ByteRange]) -> int:
        """Start a write on ``rank``; a handle for ``poll``."""
        handle = next(self._ids)
        self._pending.add(handle)
        self.runner.post(rank, _write, handle, peer, ranges)
        return handle

    def prune(self) -> None:
        """Each rank's agent forgets the peers known to have exited (and lets
        go of what it holds of them: a mapped pool)."""
        for rank in range(1, self.size):
            self.runner.post(rank, _prune)

    def poll(self, handle: int) -> TransferState:
        """The state of a write; a DONE or FAILED handle is released by this call."""
        if handle in self._pending:
            for _, (h, state) in self.runner.events():
                if h in self._pending:
                    self._pending.discard(h)
                    self._ended[h] = TransferState(state)
        return self._ended.pop(handle, TransferState.PENDING)

    def close(self) -> None:
        for rank in range(1, self.size):
            try:
                self.runner.call(rank, _close, timeout=10.0)
            except Exception as e:  # noqa: BLE001 (a lost rank has nothing left to close)
                log.debug("closing the KV agent of rank %d: %s", rank, e)


class _Agent:
    """A rank's agent and its writes in flight (lead handle -> backend handle)."""

    def __init__(self, backend: TransferBackend, ctx: RankContext) -> None:
        self.backend = backend
        self.ctx = ctx
        self.writes: dict[int, int] = {}

    def tick(self) -> list[tuple[int, str]]:
        ended = []
        for handle, h in list(self.writes.items()):
            state = self.backend.poll(h)
            if state != TransferState.PENDING:
                del self.writes[handle]
                ended.append((handle, state.value))
        if not self.writes:  # an idle rank waits on its pipe alone
            self.ctx.tickers.remove(self.tick)
        return ended


def _agent(ctx: RankContext) -> _Agent:
    return ctx.state[_STATE]


def _open(
    ctx: RankContext, backend_name: str, name: str, kwargs: dict[str, Any]
) -> tuple[str, bytes]:
    backend = make_backend(backend_name, name, **kwargs)
    backend.register(ctx.runner.pool.kv)
    agent = _Agent(backend, ctx)
    ctx.state[_STATE] = agent
    ctx.closers.append(backend.close)
    return backend.agent_name, backend.metadata()


def _connect(ctx: RankContext, peer: str, metadata: bytes) -> None:
    _agent(ctx).backend.connect(peer, metadata)


def _prune(ctx: RankContext) -> None:
    agent = ctx.state.get(_STATE)
    if agent is not None:
        agent.backend.prune()


def _write(ctx: RankContext, handle: int, peer: str, ranges: list[ByteRange]) -> None:
    agent = _agent(ctx)
    device = ctx.runner.device
    if device.type == "cuda":
        # The forward that filled these pages was queued before this call.
        torch.cuda.current_stream(device).synchronize()
    try:
        agent.writes[handle] = agent.backend.write(peer, ranges)
    except TransferError as e:
        log.warning("KV write to %s failed to start: %s", peer, e)
        ctx.send_event((handle, TransferState.FAILED.value))
        return
    if agent.tick not in ctx.tickers:
        ctx.tickers.append(agent.tick)


def _close(ctx: RankContext) -> None:
    agent = ctx.state.pop(_STATE, None)
    if agent is not None:
        if agent.tick in ctx.tickers:
            ctx.tickers.remove(agent.tick)
        agent.backend.close()
