"""Role registry: which ``WorkerLoop`` class the engine process runs for a role.

Import strings, not classes, so that the front process (and ``--help``) never
imports torch or a role's dependencies.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.worker.loop import WorkerLoop

ROLES: dict[str, str] = {
    "both": "engine.worker.loop:ColocatedLoop",
    "prefill": "prefill_server.loop:PrefillLoop",
    "decode": "decode_server.loop:DecodeLoop",
}

ROLE_HELP: dict[str, str] = {
    "both": "prefill and decode in one engine (no KV transfer)",
    "prefill": "prefill prompts and push their KV to decode workers",
    "decode": "receive KV from prefill workers (or prefill locally) and decode",
}


def load_loop_class(role: str) -> type[WorkerLoop]:
    """Import and return the loop class registered for ``role``."""
    from engine.worker.loop import WorkerLoop

    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; choose from {', '.join(ROLES)}")
    module_name, _, class_name = ROLES[role].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(
            f"role {role!r} needs module {module_name!r}, which failed to import: {e}"
        ) from e
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, WorkerLoop)):
        raise TypeError(f"{ROLES[role]} is not a WorkerLoop subclass")
    return cls
