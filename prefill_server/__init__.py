"""The prefill role: whole-prompt reservation, chunked prefill whose KV is pushed
to a decode worker as it is computed, and the prefill side's room states."""

from __future__ import annotations

from typing import TYPE_CHECKING

from protocol.roles import PREFILL
from worker.roles import Role

if TYPE_CHECKING:
    from worker.config import WorkerConfig
    from worker.loop import WorkerLoop


def _prefill_loop(config: WorkerConfig) -> WorkerLoop:
    from prefill_server.loop import PrefillLoop

    return PrefillLoop(config)


PREFILL_ROLE = Role(PREFILL, "prefill prompts and push their KV to decode workers", _prefill_loop)
