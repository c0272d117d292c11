"""Configuration of the routing layer: each field is a ``setting``
(``protocol.settings``), a flag of the gateway's command line."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.routing.policies import DECODE_POLICIES, PREFILL_POLICIES
from protocol.settings import setting

ROUTING_GROUP = "routing and health checks"


@dataclass(frozen=True)
class RouterConfig:
    prefill_policy: str = setting(
        "cache_aware",
        help="how a prefill worker is picked (default: %(default)s)",
        group=ROUTING_GROUP,
        choices=sorted(PREFILL_POLICIES),
    )
    decode_policy: str = setting(
        "least_load",
        help="how a decode worker is picked (default: %(default)s)",
        group=ROUTING_GROUP,
        choices=sorted(DECODE_POLICIES),
    )
    skip_prefill_threshold: int = setting(
        0,
        help="prompts of at most this many tokens skip the prefill pool and are prefilled "
        "on their decode worker (conditional disaggregation); 0 disables (default: %(default)s)",
        group=ROUTING_GROUP,
    )

    breaker_failure_threshold: int = setting(
        5,
        help="consecutive failed requests that open a worker's circuit breaker "
        "(default: %(default)s)",
        group=ROUTING_GROUP,
    )
    breaker_cooldown_s: float = setting(
        10.0,
        help="how long an open circuit breaker stays open before it lets one trial request "
        "through (default: %(default)s)",
        group=ROUTING_GROUP,
    )

    cache_block_tokens: int = setting(
        16,
        help="granularity of the cache-aware prefix trees: prefixes match in blocks of this "
        "many tokens, plus an exact-match tail block (default: %(default)s)",
        group=ROUTING_GROUP,
    )
    cache_max_tokens: int = setting(
        1 << 20,
        help="size bound of each prefill worker's prefix tree in tokens; the blocks routed "
        "least recently are evicted first (default: %(default)s)",
        group=ROUTING_GROUP,
    )
    kv_events: bool = setting(
        True,
        help="cache_aware scores a prefill worker by the blocks its prefix cache really "
        "holds, from the KV events the worker publishes (a worker that publishes none is "
        "scored by the gateway's own prefix tree of what it routed there) "
        "(default: %(default)s)",
        group=ROUTING_GROUP,
    )
    kv_event_pending_s: float = setting(
        5.0,
        help="with KV events: a prompt routed to a worker this recently counts as cached "
        "there too (its prefill may not have reached the cache yet) (default: %(default)s)",
        group=ROUTING_GROUP,
    )
    cache_min_match_ratio: float = setting(
        0.5,
        help="below this matched fraction of the prompt, cache_aware picks by least load "
        "(default: %(default)s)",
        group=ROUTING_GROUP,
    )
    balance_abs_threshold: int = setting(
        8192,
        help="cache_aware ignores the cache when the most loaded worker has more than this "
        "many outstanding tokens above the least loaded one and more than "
        "--balance-rel-threshold times its outstanding tokens (default: %(default)s)",
        group=ROUTING_GROUP,
    )
    balance_rel_threshold: float = setting(
        2.0,
        help="the ratio of outstanding tokens beyond which cache_aware balances load "
        "(see --balance-abs-threshold) (default: %(default)s)",
        group=ROUTING_GROUP,
    )

    max_requests_per_worker: int = setting(
        0,
        help="requests one worker gets at once; a full worker is passed over (and the "
        "admission queue holds what no worker has room for); 0: no bound "
        "(default: %(default)s)",
        group=ROUTING_GROUP,
    )

    health_interval_s: float = setting(
        5.0,
        help="seconds between two health checks of a worker; a worker failing "
        "--unhealthy-after in a row takes no new requests until one passes "
        "(default: %(default)s)",
        group=ROUTING_GROUP,
    )
    health_timeout_s: float = setting(
        2.0,
        help="HTTP timeout of one health check (a /health or /server_info call) "
        "(default: %(default)s)",
        group=ROUTING_GROUP,
    )
    probe_interval_s: float = setting(
        0.5,
        help="seconds between two checks of a worker that is down, so that it is back in "
        "routing soon after it answers (default: %(default)s)",
        group=ROUTING_GROUP,
    )
    unhealthy_after: int = setting(
        2,
        help="failed health checks in a row that mark a worker unhealthy (default: %(default)s)",
        group=ROUTING_GROUP,
    )

    def __post_init__(self) -> None:
        if self.prefill_policy not in PREFILL_POLICIES:
            raise ValueError(
                f"unknown prefill policy {self.prefill_policy!r}; "
                f"choose from {', '.join(PREFILL_POLICIES)}"
            )
        if self.decode_policy not in DECODE_POLICIES:
            raise ValueError(
                f"unknown decode policy {self.decode_policy!r}; "
                f"choose from {', '.join(DECODE_POLICIES)}"
            )
        checks: list[tuple[str, bool]] = [
            ("skip_prefill_threshold must be >= 0", self.skip_prefill_threshold >= 0),
            ("breaker_failure_threshold must be >= 1", self.breaker_failure_threshold >= 1),
            ("breaker_cooldown_s must be >= 0", self.breaker_cooldown_s >= 0),
            ("cache_block_tokens must be >= 1", self.cache_block_tokens >= 1),
            ("kv_event_pending_s must be >= 0", self.kv_event_pending_s >= 0),
            (
                "cache_max_tokens must be >= cache_block_tokens",
                self.cache_max_tokens >= self.cache_block_tokens,
            ),
            (
                "cache_min_match_ratio must be in [0, 1]",
                0.0 <= self.cache_min_match_ratio <= 1.0,
            ),
            ("balance_abs_threshold must be >= 0", self.balance_abs_threshold >= 0),
            ("balance_rel_threshold must be >= 1", self.balance_rel_threshold >= 1.0),
            ("health_interval_s must be > 0", self.health_interval_s > 0),
            ("max_requests_per_worker must be >= 0", self.max_requests_per_worker >= 0),
            ("health_timeout_s must be > 0", self.health_timeout_s > 0),
            ("probe_interval_s must be > 0", self.probe_interval_s > 0),
            ("unhealthy_after must be >= 1", self.unhealthy_after >= 1),
        ]
        for message, ok in checks:
            if not ok:
                raise ValueError(message)
