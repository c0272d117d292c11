"""The decode role: pages reserved for incoming KV, the transfer queue, overlap
decode, and the decode side's room states."""

from __future__ import annotations

from typing import TYPE_CHECKING

from protocol.roles import DECODE
from worker.roles import Role

if TYPE_CHECKING:
    from worker.config import WorkerConfig
    from worker.loop import WorkerLoop


def _decode_loop(config: WorkerConfig) -> WorkerLoop:
    from decode_server.loop import DecodeLoop

    return DecodeLoop(config)


DECODE_ROLE = Role(
    DECODE, "receive KV from prefill workers (or prefill locally) and decode", _decode_loop
)
