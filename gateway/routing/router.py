"""The router: pools, policies, load accounting and breakers, tied together.

A request goes through the router like this::

    if router.should_skip_prefill(len(ids)):
        decode = router.pick_decode(ids)                  # prefills locally
    else:
        prefill = router.pick_prefill(ids)
        decode = router.pick_decode(ids, with_prefill=True)
    router.begin(worker, n) ... router.end(worker, n, ok)  # for each worker used
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Collection, Sequence

from gateway.routing.breaker import CircuitBreaker, Clock
from gateway.routing.config import RouterConfig
from gateway.routing.policies import DECODE_POLICIES, PREFILL_POLICIES
from gateway.routing.workers import WorkerInfo, WorkerPool, normalize_url
from protocol.kv_events import KvEvents
from protocol.roles import ROLES

log = logging.getLogger("gateway.router")


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

    def kv_events(self, url: str, batch: KvEvents | None) -> None:
        """KV events of the worker at ``url`` (see ``Policy.kv_events``)."""
        self.prefill_policy.kv_events(normalize_url(url), batch)

    def forget_cache(self, url: str) -> None:
        """The worker at ``url`` lost its prefix cache (restarted)."""
        self.prefill_policy.forget(normalize_url(url))

    def restarted(self, worker: WorkerInfo) -> None:
        """``worker`` is a new process at the same URL: it has an empty cache,
        and the failures of the old one say nothing about it."""
        self.forget_cache(worker.url)
        worker.breaker = CircuitBreaker(
            self.config.breaker_failure_threshold, self.config.breaker_cooldown_s, self.clock
        )
        log.info("worker %s restarted: prefix tree and circuit breaker reset", worker.url)

    def mark_down(self, worker: WorkerInfo, reason: str) -> None:
        """Passive health: ``worker`` failed in a way that proves it cannot take
        requests now (its request-plane connection dropped): out of routing at
        once, until a health check passes."""
        worker.last_error = reason
        if worker.healthy:
            worker.healthy = False
            log.warning("worker %s is out of routing: %s", worker.url, reason)

    def refused(self, pool: WorkerPool) -> bool:
        """Whether every worker of ``pool`` (draining ones aside; at least one)
        answers but cannot serve (``WorkerInfo.refused``): none will take a
        request until someone fixes one, so waiting for one is pointless."""
        workers = pool.list(include_draining=False)
        return bool(workers) and all(w.refused is not None for w in workers)

    def why_unavailable(self, pool: WorkerPool) -> str:
        """Why each worker of ``pool`` that cannot take a request now cannot,
        one clause each (empty: none is listed)."""
        return "; ".join(
            f"{w.role} worker {w.url}: {w.refused or w.last_error or 'not up yet'}"
            for w in pool.list(include_draining=False)
            if not self.is_available(w)
        )

    # -- routing

    def is_available(self, worker: WorkerInfo) -> bool:
        bound = self.config.max_requests_per_worker
        return (
            worker.healthy
            and not worker.draining
            and worker.breaker.allows()
            and not (bound and worker.outstanding_requests >= bound)
        )

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

    @staticmethod
    def _trial(candidates: Sequence[WorkerInfo]) -> WorkerInfo | None:
        """A candidate whose breaker is half-open waits for one trial request to
        close it: it gets the next request (a policy that prefers cached or
        less loaded workers would otherwise never pick it)."""
        for w in candidates:
            if w.breaker.state == CircuitBreaker.HALF_OPEN:
                return w
        return None

    def pick_prefill(
        self, token_ids: Sequence[int], *, exclude: Collection[str] = ()
    ) -> WorkerInfo | None:
        candidates = self.available_prefill(exclude)
        trial = self._trial(candidates)
        if trial is not None:
            self.prefill_policy.routed(trial, token_ids)
            return trial
        return self.prefill_policy.pick(candidates, token_ids)

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
        return self._trial(candidates) or self.decode_policy.pick(candidates, token_ids)

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
