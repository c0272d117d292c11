"""KV-plane setup shared by the prefill and decode roles: the transfer backend
over the engine's KV pool and the compatibility record of the handshake."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from engine.engine import Engine
from engine.parallel.shard import kv_head_ranges
from kvtransfer import make_backend
from kvtransfer.backend import TransferBackend
from kvtransfer.compat import compat_info
from kvtransfer.tp_map import format_ranges


def engine_compat(engine: Engine, backend_name: str) -> dict[str, str]:
    mc = engine.model_config
    pool = engine.runner.pool
    tp = engine.config.tp_size
    return compat_info(
        model=_model_id(engine.config.model),
        architecture=mc.architecture,
        num_layers=mc.num_layers,
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        dtype=str(mc.dtype).removeprefix("torch."),
        page_size=pool.page_size,
        page_bytes=pool.config.page_bytes,
        backend=backend_name,
        tp_size=tp,
        kv_head_ranges=format_ranges(kv_head_ranges(mc.num_kv_heads, tp)),
        kv_dtype=str(pool.config.dtype).removeprefix("torch."),
    )


def _model_id(model: str) -> str:
    """The served model's name plus its config's content hash, so two workers
    agree only when they serve the same model (path-independent)."""
    import hashlib

    cfg = Path(model) / "config.json"
    if cfg.is_file():
        digest = hashlib.sha256(cfg.read_bytes()).hexdigest()[:12]
        return f"{Path(model).name}@{digest}"
    return os.path.basename(model)


def backend_kwargs(
    backend_name: str, host: str, timeout: float | None, cluster_token: str | None
) -> dict[str, Any]:
    """Constructor arguments of a transfer backend. ``timeout``: how long a
    write may take before the backend fails it (None: the backend's default).
    ``cluster_token``: the tcp data channel and the nccl pairing take writes
    only from connections that prove they hold it."""
    kwargs: dict[str, Any] = {}
    if backend_name in ("tcp", "nccl"):
        kwargs = {"host": host, "cluster_token": cluster_token}
    if timeout is not None:
        kwargs["timeout"] = timeout
    return kwargs


def agent_name(role: str) -> str:
    # Agent names must be unique across the cluster (NIXL keys peers by them).
    return f"{role}-{uuid.uuid4().hex[:12]}"


def kv_backend(
    engine: Engine,
    backend_name: str,
    role: str,
    host: str,
    timeout: float | None = None,
    cluster_token: str | None = None,
) -> TransferBackend:
    """The KV transfer backend over ``engine``'s pool (the lead rank's, with
    tensor parallelism); the writing (prefill) side passes its
    ``transfer_timeout_s`` as ``timeout``."""
    kwargs = backend_kwargs(backend_name, host, timeout, cluster_token)
    backend = make_backend(backend_name, agent_name(role), **kwargs)
    backend.register(engine.runner.pool.kv)
    return backend
