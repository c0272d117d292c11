"""What the prefill and decode loops share: an engine whose KV pool is
registered with a transfer backend, the KV plane over it, the table of rooms
(one per request whose KV moves between the two), the requesters still owed a
final delta, the outbox and the counters."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from engine.engine import Engine
from engine.parallel.ranks import LeadRunner
from engine.request import Request
from engine.scheduler import Scheduler
from kvtransfer.backend import TransferBackend
from protocol.to_gateway import TokenDelta
from worker.config import WorkerConfig
from worker.kv_setup import agent_name, backend_kwargs, engine_compat, kv_backend
from worker.loop import Outbox, WorkerLoop, engine_stats, error_delta
from worker.tp_kv import RankAgents


class RoomLike(Protocol):
    @property
    def id(self) -> str: ...

    @property
    def req(self) -> Request: ...


class KVPlane(Protocol):
    endpoint: str

    def close(self) -> None: ...


RoomT = TypeVar("RoomT", bound=RoomLike)
PlaneT = TypeVar("PlaneT", bound=KVPlane)


class Rooms(Generic[RoomT]):
    """Live rooms by id and by the id of the request each one serves (a room
    serves one request, and a request has at most one room)."""

    def __init__(self) -> None:
        self._by_id: dict[str, RoomT] = {}
        self._by_rid: dict[str, RoomT] = {}

    def add(self, room: RoomT) -> None:
        self._by_id[room.id] = room
        self._by_rid[room.req.rid] = room

    def get(self, room_id: str) -> RoomT | None:
        return self._by_id.get(room_id)

    def serving(self, rid: str) -> RoomT | None:
        """The room of request ``rid``, if it has one."""
        return self._by_rid.get(rid)

    def remove(self, room: RoomT) -> None:
        self._by_id.pop(room.id, None)
        self._by_rid.pop(room.req.rid, None)

    def __contains__(self, room_id: object) -> bool:
        return room_id in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[RoomT]:
        # A snapshot, so rooms can be removed while the caller walks them.
        return iter(list(self._by_id.values()))


class DisaggLoop(WorkerLoop, Generic[RoomT, PlaneT]):
    """Base of the prefill and decode loops.

    A request's requester is in ``clients`` from admission until its final
    delta (``finish_reason`` set) is queued: ``_reply`` drops it then, so no
    later failure of the room can answer the requester a second time."""

    role: ClassVar[str]
    """Reported as ``role`` in ``stats``; names the transfer-backend agent."""
    COUNTERS: ClassVar[dict[str, float]] = {}
    """The loop's counters and their starting values."""

    def __init__(self, config: WorkerConfig, scheduler_cls: type[Scheduler] = Scheduler) -> None:
        super().__init__(config)
        self.engine = Engine(config.engine_config(), scheduler_cls)
        self.scheduler = self.engine.scheduler
        self.rank_agents: RankAgents | None = None
        """The transfer agents of the engine's other tensor-parallel ranks."""
        self.kv: PlaneT = self._open_kv_plane()
        self.rooms: Rooms[RoomT] = Rooms()
        self.clients: dict[str, bytes] = {}
        """rid -> requester of every admitted request not yet sent its final delta."""
        self.outbox = Outbox()
        self.counters: dict[str, float] = dict(self.COUNTERS)

    # -- KV plane ------------------------------------------------------------

    @abstractmethod
    def _open_kv_plane(self) -> PlaneT:
        """This role's end of the KV plane, over ``_kv_backend`` and ``_kv_compat``."""

    def _kv_backend(self, write_timeout_s: float | None = None) -> TransferBackend:
        return kv_backend(
            self.engine,
            self.config.transfer_backend,
            self.role,
            self.config.host,
            timeout=write_timeout_s,
            cluster_token=self.config.cluster_token,
        )

    def _open_rank_agents(self, write_timeout_s: float | None = None) -> RankAgents | None:
        """An agent on each of the engine's other ranks (None on one device)."""
        runner = self.engine.runner
        if not isinstance(runner, LeadRunner):
            return None
        kwargs = backend_kwargs(
            self.config.transfer_backend,
            self.config.host,
            write_timeout_s,
            self.config.cluster_token,
        )
        names = [agent_name(f"{self.role}-rank{r}") for r in range(1, runner.config.tp_size)]
        self.rank_agents = RankAgents(runner, self.config.transfer_backend, names, kwargs)
        return self.rank_agents

    def _kv_compat(self) -> dict[str, str]:
        return engine_compat(self.engine, self.config.transfer_backend)

    @property
    def bootstrap_endpoint(self) -> str | None:
        return self.kv.endpoint

    # -- answers -------------------------------------------------------------

    def _refuse(self, client: bytes, rid: str, message: str, param: str | None = None) -> None:
        """Answer a request that was never admitted (``param``: the request's
        parameter at fault)."""
        self.outbox.put(client, error_delta(rid, message, param))

    def _reply(self, rid: str, delta: TokenDelta) -> None:
        """Queue ``delta`` for the requester of ``rid``; a final delta is its last."""
        if delta.finish_reason is None:
            client = self.clients.get(rid)
        else:
            client = self.clients.pop(rid, None)
        if client is not None:
            self.outbox.put(client, delta)

    # -- introspection ---------------------------------------------------------

    @abstractmethod
    def _room_stats(self) -> dict[str, int]:
        """How many rooms are in which of this role's states, for ``stats``."""

    def stats(self) -> dict[str, Any]:
        return {**engine_stats(self.engine, self.role), **self._room_stats(), **self.counters}

    def close(self) -> None:
        try:
            self.kv.close()
            if self.rank_agents is not None:
                self.rank_agents.close()
        finally:
            self.engine.close()
