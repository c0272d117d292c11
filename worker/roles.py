"""What a worker role is to the shell: a name, a line of help and the factory of
its ``WorkerLoop``.

The servers (``prefill_server``, ``decode_server``) define their own roles and
hand them to ``worker.cli.main``; the shell only defines the colocated one.
A factory is a module-level function, pickled by reference into the spawned
engine process, that imports torch and the loop's module only when called, so
the front process (and ``--help``) stays light.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from protocol.roles import BOTH

if TYPE_CHECKING:
    from worker.config import WorkerConfig
    from worker.loop import WorkerLoop


class Role(NamedTuple):
    name: str
    """One of ``protocol.roles.ROLES``."""
    help: str
    make_loop: Callable[[WorkerConfig], WorkerLoop]
    """Builds the loop in the engine process from the resolved config."""


def _colocated_loop(config: WorkerConfig) -> WorkerLoop:
    from worker.colocated import ColocatedLoop

    return ColocatedLoop(config)


COLOCATED = Role(BOTH, "prefill and decode in one engine (no KV transfer)", _colocated_loop)
