"""Facts of the host a process runs on that the gateway and the workers both
decide by. Torch-free."""

from __future__ import annotations

import os

AUTO_BUSY_POLL_S = 1.0
"""``--busy-poll-s auto`` of the gateway and the workers, on a host with cores
to spare: how long a process polls without sleeping after its last request."""
BUSY_POLL_MIN_CORES = 4
"""Below this many usable cores a spinning process takes a core from those
beside it (the other engine, the gateway, a CPU deployment's forwards): auto
busy polling is off."""


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def auto_busy_poll_s() -> float:
    """``--busy-poll-s auto``: ``AUTO_BUSY_POLL_S`` with cores to spare, else 0."""
    return AUTO_BUSY_POLL_S if usable_cores() >= BUSY_POLL_MIN_CORES else 0.0
