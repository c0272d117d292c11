"""Gateway configuration."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.admission import AdmissionConfig
from gateway.routing import RouterConfig
from protocol.host import auto_busy_poll_s

LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "0.0.0.0"
    port: int = 8000
    prefill: tuple[str, ...] = ()
    """Prefill worker URLs at start (more can join with --register or the admin API)."""
    decode: tuple[str, ...] = ()
    served_model_name: str | None = None
    """Name clients use; None: the workers' served name."""
    api_key: str | None = None
    admin_key: str | None = None
    """Bearer key of /admin/*; None: the cluster token. With neither, the admin
    API refuses every call (it is never open)."""
    cluster_token: str | None = None
    """Shared secret of the cluster: the request plane's CURVE keys derive from
    it, and it is the admin key unless ``admin_key`` is set."""
    router: RouterConfig = field(default_factory=RouterConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    worker_startup_timeout_s: float = 30.0
    """While no worker is up (the gateway started first, or every worker is
    down), a request waits this long for one before it fails with 503."""
    shutdown_timeout_s: float = 30.0
    """On SIGTERM/Ctrl-C: how long in-flight requests may finish before the
    rest are aborted on the workers."""
    request_timeout_s: float = 600.0
    """Every request ends within this, streaming or not."""
    worker_timeout_s: float = 120.0
    """A worker that sends nothing for a request this long fails it."""
    connect_timeout_s: float = 3.0
    """A request waits this long for a connection to its worker before it goes
    to another worker."""
    max_body_bytes: int = 4 << 20
    max_prompt_tokens: int | None = None
    """None: only the model's context window limits prompts."""
    log_level: str = "info"
    """One of ``LOG_LEVELS``: the gateway's and its HTTP server's logging."""
    busy_poll_s: float | None = None
    """How long after its last request the event loop keeps polling instead of
    sleeping (``gateway.busy_poll``); 0: never; None: auto (on with 4 or more
    usable cores)."""

    def __post_init__(self) -> None:
        if min(self.request_timeout_s, self.worker_timeout_s, self.connect_timeout_s) <= 0:
            raise ValueError("timeouts must be > 0")
        if self.worker_startup_timeout_s < 0 or self.shutdown_timeout_s < 0:
            raise ValueError("worker_startup_timeout_s and shutdown_timeout_s must be >= 0")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be >= 1024")
        if self.busy_poll_s is not None and self.busy_poll_s < 0:
            raise ValueError("busy_poll_s must be >= 0 (0 disables it)")

    @property
    def busy_poll_linger_s(self) -> float:
        """``busy_poll_s`` resolved."""
        return auto_busy_poll_s() if self.busy_poll_s is None else self.busy_poll_s

    @property
    def admin_bearer(self) -> str | None:
        """The key /admin/* requires (None: the admin API is disabled)."""
        return self.admin_key or self.cluster_token or None
