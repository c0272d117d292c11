"""The gateway's routing layer: worker pools, load tracking, circuit breakers,
prefill/decode routing policies, health checks and run-time membership.

Everything here runs on the gateway's event loop (one thread), so nothing is
locked. Torch-free by rule: this package imports neither torch, transformers
nor any engine or worker module.

- ``workers``: ``WorkerInfo`` and the ``WorkerPool`` of each pool.
- ``breaker``: ``CircuitBreaker``, per worker.
- ``prefix_tree``: ``ApproxPrefixTree``, what the cache-aware policy remembers.
- ``policies``: the policies and their name registries.
- ``config``: ``RouterConfig``.
- ``router``: ``Router``, which ties the above together.
- ``probe``: ``WorkerProbe``, the HTTP calls to a worker's front.
- ``health``: ``HealthChecker``, the periodic checks.
- ``admin``: ``WorkerAdmin``, adding, removing and listing workers.
"""

from gateway.routing.admin import WorkerAdmin, WorkerNotAdmitted, WorkerRoleMismatch
from gateway.routing.breaker import CircuitBreaker, Clock
from gateway.routing.config import RouterConfig
from gateway.routing.health import HealthChecker
from gateway.routing.policies import (
    DECODE_POLICIES,
    PREFILL_POLICIES,
    CacheAwarePolicy,
    LeastLoadPolicy,
    Policy,
    PowerOfTwoPolicy,
    RoundRobinPolicy,
)
from gateway.routing.prefix_tree import ApproxPrefixTree, block_keys
from gateway.routing.probe import (
    WorkerError,
    WorkerProbe,
    WorkerRefused,
    WorkerStopping,
    WorkerUnreachable,
)
from gateway.routing.router import Router
from gateway.routing.workers import POOL_ROLES, WorkerInfo, WorkerPool, normalize_url

__all__ = [
    "DECODE_POLICIES",
    "POOL_ROLES",
    "PREFILL_POLICIES",
    "ApproxPrefixTree",
    "CacheAwarePolicy",
    "CircuitBreaker",
    "Clock",
    "HealthChecker",
    "LeastLoadPolicy",
    "Policy",
    "PowerOfTwoPolicy",
    "Router",
    "RouterConfig",
    "RoundRobinPolicy",
    "WorkerAdmin",
    "WorkerError",
    "WorkerInfo",
    "WorkerNotAdmitted",
    "WorkerPool",
    "WorkerProbe",
    "WorkerRefused",
    "WorkerRoleMismatch",
    "WorkerStopping",
    "WorkerUnreachable",
    "block_keys",
    "normalize_url",
]
