"""Gateway configuration.

``GatewayConfig`` holds the gateway's settings and, nested, the router's
(``RouterConfig``), the admission queue's (``AdmissionConfig``) and the
planner's (``PlannerConfig``). Each is a
``setting`` (``protocol.settings``): its default and its help text live on
the field, once, and ``python -m gateway``'s command line is generated from
them, one flat flag per setting (``--health-interval-s`` for
``router.health_interval_s``). The embedded workers' flags are the workers'
own (``gateway.embedded``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.admission import AdmissionConfig
from gateway.planner import PlannerConfig
from gateway.routing import RouterConfig
from protocol import settings
from protocol.host import AUTO_BUSY_POLL_S, BUSY_POLL_MIN_CORES, auto_busy_poll_s
from protocol.settings import CLUSTER_TOKEN_ENV, LOG_LEVELS, Flag, setting


@dataclass(frozen=True)
class GatewayConfig:
    host: str = setting("0.0.0.0", help="address to serve on (default: %(default)s)")
    port: int = setting(8000, help="HTTP port (default: %(default)s)")
    replicas: int = setting(
        1,
        help="gateway processes serving --port together (SO_REUSEPORT: the kernel spreads "
        "connections over them); each routes on its own from the same health checks and "
        "KV events, and they pass worker registrations on to one another; admission "
        "limits hold per replica (default: %(default)s)",
        minimum=1,
    )
    reuse_port: bool = setting(
        False,
        help="bind --port with SO_REUSEPORT so that other gateway processes on this host "
        "serve it too (what --replicas sets on its replicas) (default: off)",
    )
    replica_port: int = setting(
        0,
        help="also serve on 127.0.0.1:PORT, this process alone: how replicas that share "
        "--port reach one another (default: none)",
        minimum=0,
    )
    peers: tuple[str, ...] = setting(
        (),
        help="the other gateway replicas (URLs): worker registrations and removals received "
        "through the admin API are passed on to them, so that every replica routes to the "
        "same workers (default: none)",
        metavar="URL",
    )
    prefill: tuple[str, ...] = setting(
        (),
        help="prefill worker URLs at start; more can join with the workers' --register or "
        "the admin API (default: none; with no --decode either, embedded workers)",
        metavar="URL",
    )
    decode: tuple[str, ...] = setting(
        (),
        help="decode (or --role both) worker URLs at start (default: none)",
        metavar="URL",
    )
    wait_for_workers: bool = setting(
        False,
        help="with no --prefill/--decode, start no embedded workers: serve the workers that "
        "register (--register on the workers) (default: off)",
    )
    served_model_name: str | None = setting(
        None, help="model name clients use (default: the workers')"
    )
    api_key: str | None = setting(
        None,
        help="require 'Authorization: Bearer KEY' on /v1/* (default: none, /v1/* is open)",
    )
    admin_key: str | None = setting(
        None,
        help="require this bearer key on /admin/* (worker registration; default: the "
        "cluster token; with neither, the admin API refuses every call: it is never open)",
    )
    cluster_token: str | None = setting(
        None,
        help=f"the workers' shared secret (default: ${CLUSTER_TOKEN_ENV}; prefer the "
        "variable, command lines are visible to other users): the request plane is "
        "authenticated and encrypted with keys derived from it, and it is the admin key "
        "unless --admin-key is set",
        env=CLUSTER_TOKEN_ENV,
    )
    router: RouterConfig = field(default_factory=RouterConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    worker_startup_timeout_s: float = setting(
        30.0,
        help="while no worker is up (the gateway started first, or every worker is down), "
        "a request waits this long for one before it fails with 503 (default: %(default)s)",
    )
    shutdown_timeout_s: float = setting(
        30.0,
        help="on SIGTERM/Ctrl-C, in-flight requests may finish for this long; the rest are "
        "then aborted on the workers (default: %(default)s)",
    )
    request_timeout_s: float = setting(
        600.0,
        help="every request ends within this many seconds, streaming or not (default: %(default)s)",
    )
    worker_timeout_s: float = setting(
        120.0,
        help="fail a request when its worker sends nothing for this long (default: %(default)s)",
    )
    connect_timeout_s: float = setting(
        3.0,
        help="how long a request waits for a connection to the worker it was routed to "
        "before it is sent to another worker (default: %(default)s)",
    )
    max_body_bytes: int = setting(
        4 << 20, help="largest request body in bytes (default: %(default)s, 4 MiB)"
    )
    max_prompt_tokens: int | None = setting(
        None, help="largest prompt in tokens (default: the model's context window)"
    )
    log_level: str = setting(
        "info",
        help="log level of the gateway and its HTTP server (default: %(default)s)",
        choices=LOG_LEVELS,
    )
    busy_poll_s: float | None = setting(
        None,
        help="while requests are in flight and this long after the last one, the event "
        "loop polls instead of sleeping, so that a worker's first token or the next "
        "request is read at once rather than after the CPU wakes from idle (0.1-0.4 ms "
        "per wake on virtualized hosts); spins one core meanwhile; 0 disables; auto: "
        f"{AUTO_BUSY_POLL_S:g} with {BUSY_POLL_MIN_CORES} or more usable cores, else 0 "
        "(default: auto)",
        metavar="SECONDS",
        minimum=0,
    )

    def __post_init__(self) -> None:
        if min(self.request_timeout_s, self.worker_timeout_s, self.connect_timeout_s) <= 0:
            raise ValueError("timeouts must be > 0")
        if self.worker_startup_timeout_s < 0 or self.shutdown_timeout_s < 0:
            raise ValueError("worker_startup_timeout_s and shutdown_timeout_s must be >= 0")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be >= 1024")
        if self.busy_poll_s is not None and self.busy_poll_s < 0:
            raise ValueError("busy_poll_s must be >= 0 (0 disables it)")
        if self.log_level.lower() not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}")

    @classmethod
    def from_settings(cls, **values: Any) -> GatewayConfig:
        """A config from one keyword per setting, named as on the command line
        (``health_interval_s=1``, not ``router=...``): the router's and the
        admission queue's go to ``router`` and ``admission``."""
        return settings.build(cls, values)

    def to_argv(self) -> list[str]:
        """The gateway command line's arguments for this config (after
        ``python -m gateway``): the settings that differ from their defaults.
        Parsing them gives back an equal config, where ``$DISAGG_CLUSTER_TOKEN``
        is unset."""
        return settings.to_argv(self, flags())

    @property
    def busy_poll_linger_s(self) -> float:
        """``busy_poll_s`` resolved."""
        return auto_busy_poll_s() if self.busy_poll_s is None else self.busy_poll_s

    @property
    def admin_bearer(self) -> str | None:
        """The key /admin/* requires (None: the admin API is disabled)."""
        return self.admin_key or self.cluster_token or None


def flags() -> tuple[Flag, ...]:
    """The gateway's flags, one per setting of ``GatewayConfig`` and of the
    configs nested in it, in the order of the fields; their names are the
    argparse destinations."""
    return settings.flags(GatewayConfig)
