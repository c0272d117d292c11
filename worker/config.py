"""Configuration of one worker (front process plus engine process).

``WorkerConfig`` is frozen. Values that start as "auto", ``None`` or 0 are
resolved by building a new config (``resolve``) in the engine process, where
the model is loaded; the front never needs torch.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from protocol.roles import ROLES

if TYPE_CHECKING:
    from engine.config import EngineConfig

TRANSFER_BACKENDS = ("nixl", "tcp")
ATTENTION_BACKENDS = ("auto", "flashinfer", "torch_native")
"""``auto`` plus the names registered in ``engine.attention`` (kept torch-free here)."""
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_WILDCARD_HOSTS = ("", "0.0.0.0", "::", "*")


@dataclass(frozen=True)
class WorkerConfig:
    role: str = "both"
    """What the worker does, one of ``protocol.roles.ROLES``."""
    host: str = "127.0.0.1"
    """Address the HTTP server, the request plane and the KV plane bind to."""
    port: int = 30000
    """HTTP port (health, metrics, server info)."""
    request_port: int = 0
    """Request-plane (ZMQ ROUTER) port; 0 picks a free one at start."""
    bootstrap_port: int = 0
    """KV-plane bootstrap port (prefill/decode roles); 0 picks a free one."""
    advertise_host: str | None = None
    """Host put in the advertised URLs/endpoints; None: ``host``, or this
    machine's address when ``host`` is a wildcard."""
    model: str | None = None
    """Checkpoint dir, config.json or preset name; None: the built-in tiny model."""
    served_model_name: str | None = None
    """Name reported to clients; None: the checkpoint directory's name."""
    load_format: str = "auto"
    device: str = "auto"
    """Torch device; "auto": cuda when available, else cpu."""
    dtype: str = "auto"
    page_size: int = 16
    num_pages: int | None = None
    """KV pool pages; None sizes it from ``kv_cache_memory_gb``."""
    kv_cache_memory_gb: float = 0.25
    max_num_batched_tokens: int = 2048
    chunk_size: int | None = None
    max_running_requests: int = 256
    context_length: int | None = None
    enable_prefix_cache: bool = True
    seed: int = 0
    attention_backend: str = "auto"
    cuda_graph_max_bs: int | None = None
    transfer_backend: str = "tcp"
    cluster_token: str | None = None
    """Shared secret of the KV plane (and sent to the gateway on registration)."""
    transfer_timeout_s: float = 30.0
    request_timeout_s: float = 600.0
    """A request still in the engine after this long is failed; 0 disables."""
    register: str | None = None
    """Gateway base URL to register with once healthy; None: do not register."""
    register_key: str | None = None
    """Bearer key of the gateway's admin API; None: the cluster token."""
    log_level: str = "info"

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r}; choose from {', '.join(ROLES)}")
        for name in ("port", "request_port", "bootstrap_port"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {value!r}")
        if self.transfer_backend not in TRANSFER_BACKENDS:
            raise ValueError(
                f"transfer_backend must be one of {', '.join(TRANSFER_BACKENDS)}, "
                f"got {self.transfer_backend!r}"
            )
        if self.log_level.lower() not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}")
        if self.transfer_timeout_s <= 0:
            raise ValueError("transfer_timeout_s must be > 0")
        if self.request_timeout_s < 0:
            raise ValueError("request_timeout_s must be >= 0 (0 disables it)")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError("num_pages must be >= 2 (page 0 is reserved)")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError("kv_cache_memory_gb must be > 0")

    # -- derived values --------------------------------------------------------

    @property
    def public_host(self) -> str:
        """The host other machines should use to reach this worker."""
        if self.advertise_host:
            return self.advertise_host
        if self.host not in _WILDCARD_HOSTS:
            return self.host
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"

    @property
    def url(self) -> str:
        """Base URL of the HTTP server."""
        return f"http://{_bracket(self.public_host)}:{self.port}"

    @property
    def request_endpoint(self) -> str | None:
        """ZMQ endpoint of the request plane; None until the port is known."""
        if self.request_port == 0:
            return None
        return f"tcp://{_bracket(self.public_host)}:{self.request_port}"

    @property
    def model_name(self) -> str:
        """The served model name."""
        if self.served_model_name:
            return self.served_model_name
        if self.model is None:
            from engine.tiny import TINY_MODEL_NAME

            return TINY_MODEL_NAME
        return os.path.basename(os.path.normpath(self.model)) or self.model

    @property
    def is_resolved(self) -> bool:
        return self.model is not None and self.device != "auto"

    # -- resolution ------------------------------------------------------------

    def resolve(self) -> WorkerConfig:
        """A new config with the model path and device filled in (builds the tiny
        model on first use and imports torch: call it in the engine process)."""
        model, name = self.model, self.served_model_name
        if model is None:
            from engine.tiny import TINY_MODEL_NAME, ensure_tiny_model

            model, name = str(ensure_tiny_model()), name or TINY_MODEL_NAME
        device = self.device
        if device == "auto":
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        return replace(self, model=model, device=device, served_model_name=name)

    def with_request_port(self, port: int) -> WorkerConfig:
        return replace(self, request_port=port)

    def engine_config(self) -> EngineConfig:
        """The ``EngineConfig`` of this worker's engine (resolving first if needed)."""
        from engine.config import EngineConfig

        cfg = self if self.is_resolved else self.resolve()
        assert cfg.model is not None
        return EngineConfig(
            model=cfg.model,
            load_format=cfg.load_format,
            dtype=cfg.dtype,
            device=cfg.device,
            page_size=cfg.page_size,
            num_pages=cfg.num_pages,
            kv_cache_memory_gb=cfg.kv_cache_memory_gb,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            chunk_size=cfg.chunk_size,
            max_running_requests=cfg.max_running_requests,
            context_length=cfg.context_length,
            enable_prefix_cache=cfg.enable_prefix_cache,
            seed=cfg.seed,
            attention_backend=cfg.attention_backend,
            cuda_graph_max_bs=cfg.cuda_graph_max_bs,
        )


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
