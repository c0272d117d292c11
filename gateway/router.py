"""The gateway's routing layer: worker pools, load tracking, circuit breakers,
prefill/decode routing policies and the health checker.

Everything here runs on the gateway's event loop (one thread), so nothing is
locked. Torch-free by rule: this module imports neither torch, transformers nor
any engine runtime module.

A request goes through the router like this::

    if router.should_skip_prefill(len(ids)):
        decode = router.pick_decode(ids)                  # prefills locally
    else:
        prefill = router.pick_prefill(ids)
        decode = router.pick_decode(ids, with_prefill=True)
    router.begin(worker, n) ... router.end(worker, n, ok)  # for each worker used

Pools: prefill workers (role "prefill") go into the prefill pool; decode
workers (role "decode") and colocated workers (role "both") go into the decode
pool. Only role "decode" can take KV from a prefill worker; a "both" worker
serves requests that skip prefill.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import httpx

from protocol.roles import BOTH, DECODE, PREFILL, ROLES

log = logging.getLogger("gateway.router")

POOL_ROLES: dict[str, tuple[str, ...]] = {PREFILL: (PREFILL,), DECODE: (DECODE, BOTH)}
"""Pool name -> the worker roles it holds."""

Clock = Callable[[], float]


# -- config ----------------------------------------------------------------------


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

    health_interval_s: float = 5.0
    """Seconds between two health checks of a worker."""
    health_timeout_s: float = 2.0
    """HTTP timeout of one /health or /server_info call."""
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
            ("health_timeout_s must be > 0", self.health_timeout_s > 0),
            ("unhealthy_after must be >= 1", self.unhealthy_after >= 1),
        ]
        for message, ok in checks:
            if not ok:
                raise ValueError(message)


# -- circuit breaker ---------------------------------------------------------------


class CircuitBreaker:
    """Per-worker breaker over request outcomes.

    closed --(``failure_threshold`` failures in a row)--> open
    open --(``cooldown_s`` elapsed)--> half_open
    half_open: lets one trial request through; its success closes the breaker,
    its failure re-opens it (and restarts the cooldown).
    """

    CLOSED: ClassVar[str] = "closed"
    OPEN: ClassVar[str] = "open"
    HALF_OPEN: ClassVar[str] = "half_open"

    def __init__(
        self, failure_threshold: int = 5, cooldown_s: float = 10.0, clock: Clock = time.monotonic
    ) -> None:
        if failure_threshold < 1:
            raise ValueError("failure_threshold must be >= 1")
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self.clock = clock
        self.failures = 0
        """Failed requests in a row (reset by a success)."""
        self._state = self.CLOSED
        self._opened_at = 0.0
        self._trial_in_flight = False

    @property
    def state(self) -> str:
        if self._state == self.OPEN and self.clock() - self._opened_at >= self.cooldown_s:
            self._state = self.HALF_OPEN
            self._trial_in_flight = False
        return self._state

    def allows(self) -> bool:
        """Whether a new request may go to the worker now. Does not consume the
        half-open trial (``on_request`` does)."""
        state = self.state
        if state == self.CLOSED:
            return True
        return state == self.HALF_OPEN and not self._trial_in_flight

    def on_request(self) -> None:
        """A request was sent to the worker."""
        if self.state == self.HALF_OPEN:
            self._trial_in_flight = True

    def record(self, ok: bool) -> None:
        """A request to the worker ended, well (``ok``) or not."""
        state = self.state
        if ok:
            if state != self.CLOSED:
                log.info("circuit breaker closes after a successful request")
            self._state = self.CLOSED
            self.failures = 0
            self._trial_in_flight = False
            return
        self.failures += 1
        if state == self.HALF_OPEN or (
            state == self.CLOSED and self.failures >= self.failure_threshold
        ):
            self._open()

    def _open(self) -> None:
        self._state = self.OPEN
        self._opened_at = self.clock()
        self._trial_in_flight = False

    def __repr__(self) -> str:
        return f"CircuitBreaker(state={self.state!r}, failures={self.failures})"


# -- workers and pools -----------------------------------------------------------


@dataclass(eq=False)
class WorkerInfo:
    """One worker as the gateway sees it. Identity is the object (and ``url``,
    unique within a router)."""

    url: str
    """Base URL of the worker's HTTP front, without a trailing slash."""
    role: str
    """"prefill", "decode" or "both"."""
    request_endpoint: str | None = None
    """ZMQ request-plane endpoint (from /server_info)."""
    bootstrap_endpoint: str | None = None
    """KV-plane bootstrap endpoint (prefill/decode roles; None for "both")."""
    page_size: int | None = None
    context_length: int | None = None
    healthy: bool = True
    draining: bool = False
    """Removed: takes no new requests; dropped once ``outstanding_requests`` is 0."""
    consecutive_failures: int = 0
    """Failed health checks in a row (reset by a passing one)."""
    outstanding_requests: int = 0
    outstanding_tokens: int = 0
    last_error: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    """The "stats" object of the last /server_info."""
    info: dict[str, Any] = field(default_factory=dict)
    """The whole last /server_info."""
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)

    def __post_init__(self) -> None:
        self.url = normalize_url(self.url)
        if self.role not in ROLES:
            raise ValueError(f"unknown worker role {self.role!r}; choose from {', '.join(ROLES)}")

    @classmethod
    def from_server_info(cls, url: str, info: Mapping[str, Any]) -> WorkerInfo:
        """A worker from its /server_info answer (raises ``ValueError`` if malformed)."""
        role = info.get("role")
        if role not in ROLES:
            raise ValueError(f"/server_info of {url} has no valid role (got {role!r})")
        worker = cls(url=url, role=role)
        worker.update_from_server_info(info)
        return worker

    def update_from_server_info(self, info: Mapping[str, Any]) -> None:
        """Refresh endpoints, static facts and stats from a /server_info answer."""
        self.request_endpoint = info.get("request_endpoint", self.request_endpoint)
        self.bootstrap_endpoint = info.get("bootstrap_endpoint", self.bootstrap_endpoint)
        self.page_size = info.get("page_size", self.page_size)
        self.context_length = info.get("context_length", self.context_length)
        stats = info.get("stats")
        if isinstance(stats, dict):
            self.stats = dict(stats)
        self.info = dict(info)

    @property
    def load(self) -> tuple[int, int]:
        """Sort key of the load policies: outstanding tokens, then requests."""
        return (self.outstanding_tokens, self.outstanding_requests)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able summary (for an admin endpoint or logs)."""
        return {
            "url": self.url,
            "role": self.role,
            "request_endpoint": self.request_endpoint,
            "bootstrap_endpoint": self.bootstrap_endpoint,
            "page_size": self.page_size,
            "context_length": self.context_length,
            "healthy": self.healthy,
            "draining": self.draining,
            "breaker": self.breaker.state,
            "consecutive_failures": self.consecutive_failures,
            "outstanding_requests": self.outstanding_requests,
            "outstanding_tokens": self.outstanding_tokens,
            "last_error": self.last_error,
            "stats": self.stats,
        }


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url:
        raise ValueError("empty worker URL")
    if "://" not in url:
        url = f"http://{url}"
    return url


class WorkerPool:
    """The workers of one pool ("prefill" or "decode"), in registration order."""

    def __init__(self, name: str) -> None:
        if name not in POOL_ROLES:
            raise ValueError(f"unknown pool {name!r}; choose from {', '.join(POOL_ROLES)}")
        self.name = name
        self.roles = POOL_ROLES[name]
        self._workers: dict[str, WorkerInfo] = {}

    def add(self, worker: WorkerInfo) -> WorkerInfo:
        """Add ``worker`` and return the pool's entry for its URL. Adding a URL
        that is already here refreshes that entry (and cancels its draining), so
        counters of requests in flight survive a re-registration."""
        if worker.role not in self.roles:
            raise ValueError(
                f"the {self.name} pool takes roles {', '.join(self.roles)}, not {worker.role!r}"
            )
        old = self._workers.get(worker.url)
        if old is None:
            self._workers[worker.url] = worker
            return worker
        old.role = worker.role
        old.request_endpoint = worker.request_endpoint
        old.bootstrap_endpoint = worker.bootstrap_endpoint
        old.page_size = worker.page_size
        old.context_length = worker.context_length
        if worker.info:
            old.info = worker.info
            old.stats = worker.stats
        old.draining = False
        return old

    def remove(self, url: str) -> WorkerInfo | None:
        """Mark the worker draining; drop it now if it has no request in flight.
        Returns the worker (None if unknown)."""
        worker = self._workers.get(normalize_url(url))
        if worker is None:
            return None
        worker.draining = True
        self.drop_if_drained(worker)
        return worker

    def drop_if_drained(self, worker: WorkerInfo) -> bool:
        """Drop a draining worker with nothing in flight; True if dropped."""
        drained = worker.draining and worker.outstanding_requests <= 0
        if drained and self._workers.get(worker.url) is worker:
            del self._workers[worker.url]
            return True
        return False

    def get(self, url: str) -> WorkerInfo | None:
        return self._workers.get(normalize_url(url))

    def list(self, include_draining: bool = True) -> list[WorkerInfo]:
        return [w for w in self._workers.values() if include_draining or not w.draining]

    def __contains__(self, url: object) -> bool:
        return isinstance(url, str) and normalize_url(url) in self._workers

    def __len__(self) -> int:
        return len(self._workers)

    def __iter__(self):
        return iter(list(self._workers.values()))


# -- approximate prefix tree -------------------------------------------------------


def block_keys(token_ids: Sequence[int], block_tokens: int) -> list[tuple[int, int]]:
    """(key, tokens) per block of the prompt: the key of a block hashes its
    parent's key with its tokens, so equal keys mean equal prefixes (up to hash
    collisions; the tree is approximate). The last, partial block matches only
    an identical tail."""
    keys: list[tuple[int, int]] = []
    parent = 0
    for start in range(0, len(token_ids), block_tokens):
        block = tuple(token_ids[start : start + block_tokens])
        parent = hash((parent, block))
        keys.append((parent, len(block)))
    return keys


class ApproxPrefixTree:
    """The prefixes routed to one worker, as a tree of token blocks stored by
    chained hash (a node's key hashes its parent's key and its tokens), bounded
    to ``max_blocks`` blocks with least-recently-routed eviction.

    Inserting touches a prompt's blocks deepest first, so a parent is always
    more recent than its children and eviction trims trees from their leaves.
    """

    def __init__(self, block_tokens: int, max_blocks: int) -> None:
        if block_tokens < 1 or max_blocks < 1:
            raise ValueError("block_tokens and max_blocks must be >= 1")
        self.block_tokens = block_tokens
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, token_ids: Sequence[int] | None = None, *, keys=None) -> int:
        """Tokens of the longest stored prefix of ``token_ids`` (or of prompt
        ``keys`` from ``block_keys``). Does not refresh recency."""
        if keys is None:
            keys = block_keys(token_ids or (), self.block_tokens)
        matched = 0
        for key, n in keys:
            if key not in self._blocks:
                break
            matched += n
        return matched

    def insert(self, token_ids: Sequence[int] | None = None, *, keys=None) -> None:
        """Store (or refresh) every prefix of the prompt, evicting the least
        recently routed blocks beyond the bound."""
        if keys is None:
            keys = block_keys(token_ids or (), self.block_tokens)
        if len(keys) > self.max_blocks:
            keys = keys[: self.max_blocks]
        for key, _ in reversed(keys):
            self._blocks[key] = None
            self._blocks.move_to_end(key)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()


# -- policies --------------------------------------------------------------------


class Policy:
    """Picks one of the candidate workers (all available: healthy, not
    draining, breaker allowing). Subclasses set ``name`` and override ``pick``."""

    name: ClassVar[str] = ""

    def __init__(self, config: RouterConfig, rng: random.Random) -> None:
        self.config = config
        self.rng = rng

    def pick(self, workers: Sequence[WorkerInfo], token_ids: Sequence[int]) -> WorkerInfo | None:
        raise NotImplementedError

    def forget(self, url: str) -> None:
        """The worker at ``url`` left the pool (or restarted): drop its state."""


def least_loaded(workers: Iterable[WorkerInfo]) -> WorkerInfo | None:
    """Fewest outstanding tokens, then fewest outstanding requests, then first."""
    return min(workers, key=lambda w: w.load, default=None)


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self, config: RouterConfig, rng: random.Random) -> None:
        super().__init__(config, rng)
        self._last: str | None = None

    def pick(self, workers: Sequence[WorkerInfo], token_ids: Sequence[int]) -> WorkerInfo | None:
        if not workers:
            return None
        # The first candidate after the last one picked, in URL order, so the
        # rotation survives candidates leaving, failing and coming back.
        ordered = sorted(workers, key=lambda w: w.url)
        chosen = ordered[0]
        if self._last is not None:
            for w in ordered:
                if w.url > self._last:
                    chosen = w
                    break
        self._last = chosen.url
        return chosen


class LeastLoadPolicy(Policy):
    name = "least_load"

    def pick(self, workers: Sequence[WorkerInfo], token_ids: Sequence[int]) -> WorkerInfo | None:
        return least_loaded(workers)


class PowerOfTwoPolicy(Policy):
    """Two distinct workers at random; the less loaded one (the first drawn on a tie)."""

    name = "power_of_two"

    def pick(self, workers: Sequence[WorkerInfo], token_ids: Sequence[int]) -> WorkerInfo | None:
        if len(workers) <= 1:
            return workers[0] if workers else None
        a, b = self.rng.sample(list(workers), 2)
        return b if b.load < a.load else a


class CacheAwarePolicy(Policy):
    """Longest matched prefix wins, as long as the load is balanced.

    Per worker an ``ApproxPrefixTree`` of the prompts routed to it. If the most
    and least loaded candidates differ by more than ``balance_abs_threshold``
    outstanding tokens and by more than ``balance_rel_threshold`` times, or the
    best match covers less than ``cache_min_match_ratio`` of the prompt, the
    least loaded worker is picked instead. Either way the prompt is recorded in
    the picked worker's tree.
    """

    name = "cache_aware"

    def __init__(self, config: RouterConfig, rng: random.Random) -> None:
        super().__init__(config, rng)
        self.max_blocks = max(1, config.cache_max_tokens // config.cache_block_tokens)
        self.trees: dict[str, ApproxPrefixTree] = {}
        self.last_decision: str = ""
        """"cache", "imbalance" or "low_match": why the last pick was made (for
        logs and tests)."""

    def tree(self, url: str) -> ApproxPrefixTree:
        tree = self.trees.get(url)
        if tree is None:
            tree = self.trees[url] = ApproxPrefixTree(
                self.config.cache_block_tokens, self.max_blocks
            )
        return tree

    def imbalanced(self, workers: Sequence[WorkerInfo]) -> bool:
        loads = [w.outstanding_tokens for w in workers]
        lo, hi = min(loads), max(loads)
        return (
            hi - lo > self.config.balance_abs_threshold
            and hi > self.config.balance_rel_threshold * lo
        )

    def pick(self, workers: Sequence[WorkerInfo], token_ids: Sequence[int]) -> WorkerInfo | None:
        if not workers:
            return None
        keys = block_keys(token_ids, self.config.cache_block_tokens)
        if self.imbalanced(workers):
            chosen = least_loaded(workers)
            self.last_decision = "imbalance"
        else:
            total = max(1, len(token_ids))
            ratios = [(self.tree(w.url).match(keys=keys) / total, w) for w in workers]
            best = max(r for r, _ in ratios)
            if not token_ids or best < self.config.cache_min_match_ratio:
                chosen = least_loaded(workers)
                self.last_decision = "low_match"
            else:
                chosen = least_loaded(w for r, w in ratios if r == best)
                self.last_decision = "cache"
        assert chosen is not None
        self.tree(chosen.url).insert(keys=keys)
        return chosen

    def forget(self, url: str) -> None:
        self.trees.pop(url, None)


PREFILL_POLICIES: dict[str, type[Policy]] = {
    RoundRobinPolicy.name: RoundRobinPolicy,
    LeastLoadPolicy.name: LeastLoadPolicy,
    CacheAwarePolicy.name: CacheAwarePolicy,
}
"""Prefill policy name -> class; ``choices=list(PREFILL_POLICIES)`` in argparse."""
DECODE_POLICIES: dict[str, type[Policy]] = {
    LeastLoadPolicy.name: LeastLoadPolicy,
    PowerOfTwoPolicy.name: PowerOfTwoPolicy,
}
"""Decode policy name -> class; ``choices=list(DECODE_POLICIES)`` in argparse."""


# -- router ----------------------------------------------------------------------


class Router:
    """Pools, policies, load accounting and breakers, tied together."""

    def __init__(
        self,
        config: RouterConfig | None = None,
        *,
        clock: Clock = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config or RouterConfig()
        self.clock = clock
        self.rng = rng or random.Random()
        self.prefill = WorkerPool("prefill")
        self.decode = WorkerPool("decode")
        self.prefill_policy = PREFILL_POLICIES[self.config.prefill_policy](self.config, self.rng)
        self.decode_policy = DECODE_POLICIES[self.config.decode_policy](self.config, self.rng)

    # -- membership

    def pool_for(self, role: str) -> WorkerPool:
        if role not in ROLES:
            raise ValueError(f"unknown worker role {role!r}; choose from {', '.join(ROLES)}")
        return self.prefill if role == "prefill" else self.decode

    def add(self, worker: WorkerInfo) -> WorkerInfo:
        """Register ``worker`` (or refresh the entry of its URL); returns the entry.
        A URL already registered under a role of the other pool is an error."""
        pool = self.pool_for(worker.role)
        other = self.decode if pool is self.prefill else self.prefill
        existing = other.get(worker.url)
        if existing is not None and not (existing.draining and self._drop(other, existing)):
            raise ValueError(
                f"worker {worker.url} is already registered with role {existing.role!r}"
                + (" and still has requests in flight" if existing.draining else "")
                + f"; remove it (and let it drain) before adding it as {worker.role!r}"
            )
        new = pool.get(worker.url) is None
        entry = pool.add(worker)
        if new:
            entry.breaker = CircuitBreaker(
                self.config.breaker_failure_threshold, self.config.breaker_cooldown_s, self.clock
            )
            log.info("added %s worker %s", entry.role, entry.url)
        return entry

    def remove(self, url: str) -> WorkerInfo | None:
        """Start draining the worker at ``url``: no new requests; it is dropped
        once its last outstanding request ends (now, if it has none)."""
        for pool in (self.prefill, self.decode):
            worker = pool.get(url)
            if worker is not None:
                worker.draining = True
                if not self._drop(pool, worker):
                    log.info(
                        "draining %s worker %s (%d requests in flight)",
                        worker.role,
                        worker.url,
                        worker.outstanding_requests,
                    )
                return worker
        return None

    def _drop(self, pool: WorkerPool, worker: WorkerInfo) -> bool:
        if not pool.drop_if_drained(worker):
            return False
        policy = self.prefill_policy if pool is self.prefill else self.decode_policy
        policy.forget(worker.url)
        log.info("dropped %s worker %s", worker.role, worker.url)
        return True

    def get(self, url: str) -> WorkerInfo | None:
        return self.prefill.get(url) or self.decode.get(url)

    def workers(self) -> list[WorkerInfo]:
        return self.prefill.list() + self.decode.list()

    def forget_cache(self, url: str) -> None:
        """The worker at ``url`` lost its prefix cache (restarted)."""
        self.prefill_policy.forget(normalize_url(url))

    # -- routing

    @staticmethod
    def is_available(worker: WorkerInfo) -> bool:
        return worker.healthy and not worker.draining and worker.breaker.allows()

    def available_prefill(self, exclude: Collection[str] = ()) -> list[WorkerInfo]:
        """Available prefill workers, leaving out the URLs in ``exclude``."""
        return [w for w in self.prefill.list() if self.is_available(w) and w.url not in exclude]

    def available_decode(
        self, *, with_prefill: bool = False, exclude: Collection[str] = ()
    ) -> list[WorkerInfo]:
        """Available decode-pool workers; with ``with_prefill`` only those that
        take KV from a prefill worker (role "decode")."""
        return [
            w
            for w in self.decode.list()
            if self.is_available(w)
            and (not with_prefill or w.role == "decode")
            and w.url not in exclude
        ]

    def pick_prefill(
        self, token_ids: Sequence[int], *, exclude: Collection[str] = ()
    ) -> WorkerInfo | None:
        return self.prefill_policy.pick(self.available_prefill(exclude), token_ids)

    def pick_decode(
        self,
        token_ids: Sequence[int],
        *,
        with_prefill: bool = False,
        exclude: Collection[str] = (),
    ) -> WorkerInfo | None:
        """A decode worker; ``with_prefill=True`` when a prefill worker will send
        it the prompt's KV (excludes role "both")."""
        candidates = self.available_decode(with_prefill=with_prefill, exclude=exclude)
        return self.decode_policy.pick(candidates, token_ids)

    def should_skip_prefill(self, prompt_len: int, exclude: Collection[str] = ()) -> bool:
        """Whether to send the request straight to a decode worker, which then
        prefills it: short prompts (``skip_prefill_threshold``), or no prefill
        worker (or no KV-receiving decode worker) while some decode-pool worker
        is available."""
        if not self.available_prefill(exclude) or not self.available_decode(
            with_prefill=True, exclude=exclude
        ):
            return bool(self.available_decode(exclude=exclude))
        threshold = self.config.skip_prefill_threshold
        return threshold > 0 and prompt_len <= threshold

    # -- load accounting

    def begin(self, worker: WorkerInfo, num_tokens: int) -> None:
        """A request of ``num_tokens`` (load units) was sent to ``worker``."""
        worker.outstanding_requests += 1
        worker.outstanding_tokens += max(0, num_tokens)
        worker.breaker.on_request()

    def end(self, worker: WorkerInfo, num_tokens: int, ok: bool, error: str | None = None) -> None:
        """The request counted by ``begin(worker, num_tokens)`` ended; ``ok=False``
        counts against the worker's breaker."""
        worker.outstanding_requests = max(0, worker.outstanding_requests - 1)
        worker.outstanding_tokens = max(0, worker.outstanding_tokens - max(0, num_tokens))
        before = worker.breaker.state
        worker.breaker.record(ok)
        if not ok:
            worker.last_error = error or "request failed"
            if worker.breaker.state == CircuitBreaker.OPEN and before != CircuitBreaker.OPEN:
                log.warning(
                    "circuit breaker of %s opened after %d failures: %s",
                    worker.url,
                    worker.breaker.failures,
                    worker.last_error,
                )
        if worker.draining:
            self._drop(self.pool_for(worker.role), worker)


# -- health checking -------------------------------------------------------------


class WorkerError(RuntimeError):
    """A worker could not be added."""


class WorkerUnreachable(WorkerError):
    """The worker did not answer /server_info (connection, timeout or HTTP error)."""


class WorkerRoleMismatch(WorkerError):
    """The worker reports another role than the one it was added as."""


class HealthChecker:
    """Polls every worker's /health and /server_info every
    ``config.health_interval_s``: ``config.unhealthy_after`` failed checks in a
    row mark a worker unhealthy, one passing check re-admits it, and each
    passing check refreshes endpoints and stats.

    Use ``await start()`` / ``await stop()`` or ``async with``. ``client`` (or
    ``transport``, for tests) replaces the AsyncClient it would create itself; a
    given client is not closed by ``stop``.
    """

    def __init__(
        self,
        router: Router,
        config: RouterConfig | None = None,
        *,
        client: httpx.AsyncClient | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.router = router
        self.config = config or router.config
        self._client = client
        self._owns_client = client is None
        self._transport = transport
        self._task: asyncio.Task[None] | None = None
        self.after_round: list[Callable[[], Awaitable[None]]] = []
        """Called after every round of checks (e.g. to close clients of workers
        that left)."""

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def _http(self) -> httpx.AsyncClient:
        if self._client is None or self._client.is_closed:
            self._client = httpx.AsyncClient(
                timeout=self.config.health_timeout_s, transport=self._transport
            )
            self._owns_client = True
        return self._client

    async def _server_info(self, url: str) -> dict[str, Any]:
        resp = await self._http().get(f"{url}/server_info")
        if resp.status_code != 200:
            raise WorkerUnreachable(
                f"{url}/server_info answered {resp.status_code}: {resp.text[:200]}"
            )
        try:
            info = resp.json()
        except ValueError as e:
            raise WorkerUnreachable(f"{url}/server_info sent invalid JSON: {e}") from e
        if not isinstance(info, dict):
            raise WorkerUnreachable(f"{url}/server_info sent {type(info).__name__}, not an object")
        return info

    async def add_worker(self, url: str, role: str | None = None) -> WorkerInfo:
        """Fetch the worker's /server_info and register it. ``role`` defaults to
        the worker's own; a different one raises ``WorkerRoleMismatch``. Raises
        ``WorkerUnreachable`` if the worker does not answer."""
        url = normalize_url(url)
        if role is not None and role not in ROLES:
            raise ValueError(f"unknown worker role {role!r}; choose from {', '.join(ROLES)}")
        try:
            info = await self._server_info(url)
        except httpx.HTTPError as e:
            raise WorkerUnreachable(
                f"cannot reach worker {url}: GET /server_info failed: {type(e).__name__}: {e}"
            ) from e
        except WorkerUnreachable as e:
            raise WorkerUnreachable(f"cannot add worker {url}: {e}") from e
        actual = info.get("role")
        if actual not in ROLES:
            raise WorkerUnreachable(
                f"worker {url} reports no valid role in /server_info: {actual!r}"
            )
        # A colocated worker ("both") serves the decode pool: --decode URL and
        # role "decode" take it.
        if role is not None and role != actual and (role, actual) != ("decode", "both"):
            raise WorkerRoleMismatch(
                f"worker {url} was added as {role!r} but reports role {actual!r}"
            )
        return self.router.add(WorkerInfo.from_server_info(url, info))

    async def remove_worker(self, url: str) -> WorkerInfo | None:
        return self.router.remove(url)

    async def check_worker(self, worker: WorkerInfo) -> bool:
        """One check of one worker; updates its health. True if it passed."""
        try:
            resp = await self._http().get(f"{worker.url}/health")
            if resp.status_code != 200:
                raise WorkerUnreachable(f"/health answered {resp.status_code}")
            info = await self._server_info(worker.url)
            if info.get("role") != worker.role:
                raise WorkerUnreachable(
                    f"now reports role {info.get('role')!r}, registered as {worker.role!r}"
                )
        except (httpx.HTTPError, WorkerUnreachable) as e:
            self._failed(worker, f"{type(e).__name__}: {e}")
            return False
        restarted = worker.info.get("started_at") not in (None, info.get("started_at"))
        worker.update_from_server_info(info)
        if restarted:
            self.router.forget_cache(worker.url)
        worker.consecutive_failures = 0
        if not worker.healthy:
            log.info("worker %s is healthy again", worker.url)
        worker.healthy = True
        return True

    def _failed(self, worker: WorkerInfo, error: str) -> None:
        worker.consecutive_failures += 1
        worker.last_error = error
        if worker.healthy and worker.consecutive_failures >= self.config.unhealthy_after:
            worker.healthy = False
            log.warning(
                "worker %s marked unhealthy after %d failed checks: %s",
                worker.url,
                worker.consecutive_failures,
                error,
            )

    async def check_all(self) -> None:
        """Check every registered worker once, concurrently."""
        workers = self.router.workers()
        if workers:
            await asyncio.gather(*(self.check_worker(w) for w in workers))

    async def _run(self) -> None:
        interval = self.config.health_interval_s
        next_at = asyncio.get_running_loop().time()
        while True:
            try:
                await self.check_all()
                for hook in self.after_round:
                    await hook()
            except Exception:  # never let one bad round end the loop
                log.exception("health check round failed")
            next_at += interval
            now = asyncio.get_running_loop().time()
            if next_at < now:  # a slow round: skip missed slots, no burst
                next_at = now
            await asyncio.sleep(next_at - now)

    async def start(self) -> None:
        if self.running:
            return
        self._http()
        self._task = asyncio.create_task(self._run(), name="gateway-health-checker")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._client is not None and self._owns_client:
            await self._client.aclose()
            self._client = None

    async def __aenter__(self) -> HealthChecker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
