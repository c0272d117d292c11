"""Configuration of the routing layer."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.routing.policies import DECODE_POLICIES, PREFILL_POLICIES


@dataclass(frozen=True)
class RouterConfig:
    prefill_policy: str = "cache_aware"
    """A key of ``PREFILL_POLICIES``."""
    decode_policy: str = "least_load"
    """A key of ``DECODE_POLICIES``."""
    skip_prefill_threshold: int = 0
    """Prompts of at most this many tokens skip the prefill pool and are
    prefilled on their decode worker (conditional disaggregation); 0 disables."""

    breaker_failure_threshold: int = 5
    """Consecutive failed requests that open a worker's circuit breaker."""
    breaker_cooldown_s: float = 10.0
    """How long an open breaker stays open before it lets one trial request through."""

    cache_block_tokens: int = 16
    """Granularity of the cache-aware prefix trees: prefixes match in blocks of
    this many tokens (plus an exact-match tail block)."""
    cache_max_tokens: int = 1 << 20
    """Size bound of each prefill worker's prefix tree, in tokens (blocks are
    evicted least recently routed first)."""
    cache_min_match_ratio: float = 0.5
    """Below this matched fraction of the prompt, cache_aware uses least load."""
    balance_abs_threshold: int = 8192
    """cache_aware ignores the cache when the most loaded worker has more than
    this many outstanding tokens above the least loaded one ..."""
    balance_rel_threshold: float = 2.0
    """... and more than this many times its outstanding tokens."""

    max_requests_per_worker: int = 0
    """Requests one worker gets at once; a full worker is passed over (and the
    gateway's admission queue holds what no worker has room for). 0: no bound."""

    health_interval_s: float = 5.0
    """Seconds between two health checks of a worker."""
    health_timeout_s: float = 2.0
    """HTTP timeout of one /health or /server_info call."""
    probe_interval_s: float = 0.5
    """Seconds between two checks of a worker that is down (so it is back in
    routing soon after it answers)."""
    unhealthy_after: int = 2
    """Failed health checks in a row that mark a worker unhealthy."""

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
