"""KV-cache transfer between prefill and decode workers.

Backends are looked up by name; their modules are imported only when used, so
a missing optional dependency (``nixl``) only matters to whoever asks for it,
and the names (the worker's ``--transfer-backend`` choices) can be listed
without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtransfer.backend import TransferBackend

# name -> "module:Class", resolved lazily by backend_class().
TRANSFER_BACKENDS: dict[str, str] = {
    "tcp": "kvtransfer.tcp:TcpBackend",
    "nixl": "kvtransfer.nixl:NixlBackend",
    "nccl": "kvtransfer.nccl:NcclBackend",
}

AUTO_BACKEND = "auto"
TRANSFER_CHOICES = (AUTO_BACKEND, *sorted(TRANSFER_BACKENDS))
"""The worker's ``--transfer-backend`` choices."""


def auto_backend(device: str) -> str:
    """The backend of ``--transfer-backend auto``: nixl for a worker on a CUDA
    device where NIXL imports (NVLink and RDMA, CUDA IPC between the GPUs of
    one host), tcp otherwise. Imports torch on CUDA: call it where the engine runs."""
    if device.startswith("cuda"):
        from kvtransfer.nixl import nixl_available

        if nixl_available()[0]:
            return "nixl"
    return "tcp"


def backend_class(name: str) -> type[TransferBackend]:
    """The backend class registered as ``name``."""
    try:
        target = TRANSFER_BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown KV transfer backend {name!r}; choices: {', '.join(sorted(TRANSFER_BACKENDS))}"
        ) from None
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)


def make_backend(name: str, agent_name: str, **kwargs: Any) -> TransferBackend:
    """Build backend ``name`` for agent ``agent_name``; ``kwargs`` go to its
    constructor (e.g. ``host``/``timeout`` for tcp, ``backends`` for nixl)."""
    return backend_class(name)(agent_name, **kwargs)
