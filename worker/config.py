"""Configuration of one worker (front process plus engine process).

``WorkerConfig`` is frozen and holds its engine's settings as an
``EngineConfig`` (``engine``) next to its own. Both are made of
``protocol.settings.setting`` fields, and every setting is one flat flag
(``--page-size`` for ``engine.page_size``): the command line (``worker.cli``)
and ``WorkerConfig.to_argv`` are generated from the fields (``flags``).

Values that start as "auto" or ``None`` are resolved by building a new config
(``resolve``) in the engine process, where the model is loaded; the front
never needs torch.
"""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass, field, replace
from typing import Any

from engine.checkpoints import served_name
from engine.config import MODEL_GROUP, EngineConfig
from kvtransfer import AUTO_BACKEND, TRANSFER_CHOICES, auto_backend
from protocol import settings
from protocol.host import auto_busy_poll_s
from protocol.host import usable_cores as _usable_cores
from protocol.roles import BOTH, ROLES
from protocol.settings import CLUSTER_TOKEN_ENV, LOG_LEVELS, Flag, setting

REGISTER_KEY_ENV = "DISAGG_REGISTER_KEY"
NETWORK_GROUP = "role and network"
TRANSFER_GROUP = "KV transfer and timeouts"
PROGRAM_SETTINGS = ("role", "port")
"""Settings whose command-line default each server program picks (its first
role, its port), so ``to_argv`` always writes them."""
_WILDCARD_HOSTS = ("", "0.0.0.0", "::", "*")


@dataclass(frozen=True)
class WorkerConfig:
    role: str = setting(
        BOTH,
        help="what this worker does (default: %(default)s); see the roles below",
        group=NETWORK_GROUP,
        choices=ROLES,
    )
    """One of ``protocol.roles.ROLES``; a server program offers only its own roles."""
    host: str = setting(
        "127.0.0.1",
        help="address to bind HTTP, the request plane and the KV plane to "
        "(default: %(default)s; 0.0.0.0 for all interfaces)",
        group=NETWORK_GROUP,
    )
    advertise_host: str | None = setting(
        None,
        help="host name/IP put in the URL and endpoints this worker advertises "
        "(default: --host, or this machine's address when --host is a wildcard)",
        group=NETWORK_GROUP,
    )
    port: int = setting(30000, help="HTTP port (default: %(default)s)", group=NETWORK_GROUP)
    request_port: int = setting(
        0,
        help="request-plane (ZMQ ROUTER) port; 0 picks a free port at start, shown "
        "in /server_info as request_endpoint (default: %(default)s)",
        group=NETWORK_GROUP,
    )
    bootstrap_port: int = setting(
        0,
        help="KV-plane bootstrap port of the prefill/decode roles; 0 picks a free "
        "port, shown in /server_info as bootstrap_endpoint (default: %(default)s)",
        group=NETWORK_GROUP,
    )
    register: str | None = setting(
        None,
        help="once healthy, register with the gateway at this base URL "
        "(POST GATEWAY_URL/admin/workers; best effort, retried; default: do not register)",
        group=NETWORK_GROUP,
        metavar="GATEWAY_URL",
    )
    register_key: str | None = setting(
        None,
        help="bearer key for the gateway's admin API when registering: the gateway's "
        f"--admin-key (default: ${REGISTER_KEY_ENV}, else the cluster token)",
        group=NETWORK_GROUP,
        env=REGISTER_KEY_ENV,
    )
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The engine's settings; each is a flag of its own (see ``flags``)."""
    served_model_name: str | None = setting(
        None,
        help="model name reported to clients (default: the checkpoint directory's name)",
        group=MODEL_GROUP,
    )
    transfer_backend: str = setting(
        AUTO_BACKEND,
        help="how KV pages move between prefill and decode workers: nixl (NVLink/RDMA, "
        "CUDA IPC within a host), nccl (a communicator per worker pair; gloo on CPU) or "
        "tcp; auto: nixl on CUDA where it imports (the gpu extra), else tcp; prefill and "
        "decode must agree (default: %(default)s)",
        group=TRANSFER_GROUP,
        choices=TRANSFER_CHOICES,
    )
    cluster_token: str | None = setting(
        None,
        help="shared secret of the KV plane, also sent to the gateway on "
        f"registration (default: ${CLUSTER_TOKEN_ENV}; prefer the variable, "
        "command lines are visible to other users)",
        group=TRANSFER_GROUP,
        env=CLUSTER_TOKEN_ENV,
    )
    transfer_timeout_s: float = setting(
        30.0,
        help="fail a KV transfer (and its request) that takes longer (default: %(default)s)",
        group=TRANSFER_GROUP,
    )
    requester_timeout_s: float = setting(
        5.0,
        help="abort the requests of a requester (gateway) that sent heartbeats and then "
        "fell silent for this many seconds (killed, paused, cut off); 0 disables "
        "(default: %(default)s)",
        group=TRANSFER_GROUP,
    )
    torch_threads: int | None = setting(
        None,
        help="intra-op CPU threads of the engine process (torch.set_num_threads); auto: "
        "$OMP_NUM_THREADS when set, else half of the cores this process may use, so "
        "that one engine never takes every core from the processes beside it (the "
        "other engine, the front, the gateway) (default: auto)",
        group=MODEL_GROUP,
    )
    shutdown_timeout_s: float = setting(
        30.0,
        help="on SIGTERM/Ctrl-C the worker takes no new request (refused as retryable, "
        "and /health answers 503) and lets the in-flight ones finish for up to this "
        "many seconds, then aborts the rest; a second signal stops at once; 0: no "
        "drain (default: %(default)s)",
        group=TRANSFER_GROUP,
    )
    request_timeout_s: float = setting(
        600.0,
        help="fail a request still in the engine after this many seconds, e.g. one "
        "whose requester vanished without aborting; 0 disables (default: %(default)s)",
        group=TRANSFER_GROUP,
    )
    busy_poll_s: float | None = setting(
        None,
        help="after its last request or step, the engine process polls its sockets "
        "without sleeping for this many seconds, so that a request arriving within "
        "them is read at once instead of after the CPU wakes from idle (about 0.1-0.4 ms "
        "per wake on virtualized hosts); it spins one core meanwhile; 0 disables; auto: "
        "1 on CUDA devices of hosts with 4 or more usable cores, else 0 (default: auto)",
        group=NETWORK_GROUP,
    )
    log_level: str = setting(
        "info",
        help="log level of both processes (default: %(default)s)",
        choices=LOG_LEVELS,
    )

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r}; choose from {', '.join(ROLES)}")
        for name in ("port", "request_port", "bootstrap_port"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {value!r}")
        if self.transfer_backend not in TRANSFER_CHOICES:
            raise ValueError(
                f"transfer_backend must be one of {', '.join(TRANSFER_CHOICES)}, "
                f"got {self.transfer_backend!r}"
            )
        if self.log_level.lower() not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}")
        if self.transfer_timeout_s <= 0:
            raise ValueError("transfer_timeout_s must be > 0")
        if self.requester_timeout_s < 0:
            raise ValueError("requester_timeout_s must be >= 0 (0 disables it)")
        if self.request_timeout_s < 0:
            raise ValueError("request_timeout_s must be >= 0 (0 disables it)")
        if self.shutdown_timeout_s < 0:
            raise ValueError("shutdown_timeout_s must be >= 0 (0: no drain)")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError("torch_threads must be >= 1 (or auto)")
        if self.busy_poll_s is not None and self.busy_poll_s < 0:
            raise ValueError("busy_poll_s must be >= 0 (0 disables it, or auto)")

    @classmethod
    def from_settings(cls, **values: Any) -> WorkerConfig:
        """A config from one keyword per setting, named as on the command line
        (``page_size=4``, not ``engine=...``): the engine's go to ``engine``."""
        return settings.build(cls, values)

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
        name = served_name(self.engine.model)
        if name is None:
            from engine.tiny import TINY_MODEL_NAME

            return TINY_MODEL_NAME
        return name

    @property
    def engine_threads(self) -> int:
        """The engine process's intra-op thread count (``torch_threads`` resolved)."""
        if self.torch_threads is not None:
            return self.torch_threads
        with contextlib.suppress(ValueError):
            omp = int(os.environ.get("OMP_NUM_THREADS", ""))
            if omp >= 1:
                return omp
        return max(1, _usable_cores() // 2)

    @property
    def idle_spin_s(self) -> float:
        """How long the engine process polls without sleeping after its last
        activity (``busy_poll_s`` resolved; call on a resolved config)."""
        if self.busy_poll_s is not None:
            return self.busy_poll_s
        return auto_busy_poll_s() if self.engine.device.startswith("cuda") else 0.0

    @property
    def is_resolved(self) -> bool:
        return self.engine.model is not None and self.transfer_backend != AUTO_BACKEND

    # -- resolution ------------------------------------------------------------

    def resolve(self) -> WorkerConfig:
        """A new config with the model path, the device and the transfer backend
        filled in (builds the tiny model or fetches the checkpoint on first use
        and imports torch: call it in the engine process)."""
        name = self.served_model_name or self.model_name
        engine = self.engine.resolve_model_and_device()
        backend = self.transfer_backend
        if backend == AUTO_BACKEND:
            backend = auto_backend(engine.device)
        return replace(self, engine=engine, served_model_name=name, transfer_backend=backend)

    def with_request_port(self, port: int) -> WorkerConfig:
        return replace(self, request_port=port)

    def engine_config(self) -> EngineConfig:
        """The ``EngineConfig`` of this worker's engine (resolving first if needed)."""
        return (self if self.is_resolved else self.resolve()).engine

    # -- command line ----------------------------------------------------------

    def to_argv(self) -> list[str]:
        """The worker command line's arguments for this config (after
        ``python -m <server>``): the settings that differ from their defaults,
        plus ``PROGRAM_SETTINGS``. Parsing them gives back an equal config,
        where the environment variables of ``env`` settings are unset."""
        return settings.to_argv(self, flags(), always=PROGRAM_SETTINGS)


def flags() -> tuple[Flag, ...]:
    """Every flag, in the order of the fields (the engine's in place of
    ``engine``); their names are the argparse destinations."""
    return settings.flags(WorkerConfig)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def require_torch(what: str) -> None:
    """Exit with one line saying how to install the worker's packages when
    torch is missing (the base install is the gateway alone)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise SystemExit(
            f"{what}, but torch is not installed here: "
            "pip install 'disagg-serve[worker]' (docs/install.md)"
        )
