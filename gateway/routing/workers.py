"""Workers as the gateway sees them, and the pools they are routed from.

Pools: prefill workers (role "prefill") go into the prefill pool; decode
workers (role "decode") and colocated workers (role "both") go into the decode
pool. Only role "decode" can take KV from a prefill worker; a "both" worker
serves requests that skip prefill.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from gateway.routing.breaker import CircuitBreaker
from protocol.roles import BOTH, DECODE, PREFILL, ROLES

POOL_ROLES: dict[str, tuple[str, ...]] = {PREFILL: (PREFILL,), DECODE: (DECODE, BOTH)}
"""Pool name -> the worker roles it holds."""


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
    max_model_len: int | None = None
    """Longest prompt plus output the worker takes: its context length, or
    fewer where its KV pool holds fewer tokens (None: not reported)."""
    healthy: bool = True
    draining: bool = False
    """Removed: takes no new requests; dropped once ``outstanding_requests`` is 0."""
    consecutive_failures: int = 0
    """Failed health checks in a row (reset by a passing one)."""
    outstanding_requests: int = 0
    outstanding_tokens: int = 0
    last_error: str | None = None
    refused: str | None = None
    """Why the worker, though it answers, cannot serve this gateway's
    requests (no tokenizer, another model, a failed request-plane
    handshake); None once it passes its checks. It stays out of routing
    meanwhile, and is checked again every health round."""
    stopping: bool = False
    """The worker said it is draining before it stops (its /health, or a
    request it refused as retryable); cleared by a passing health check."""
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
        self.max_model_len = info.get("max_model_len", self.max_model_len)
        stats = info.get("stats")
        if isinstance(stats, dict):
            self.stats = dict(stats)
        self.info = dict(info)

    @property
    def token_limit(self) -> int | None:
        """Prompt plus output tokens one request may have on this worker:
        ``max_model_len``, else ``context_length`` (None: neither reported)."""
        for limit in (self.max_model_len, self.context_length):
            if type(limit) is int and limit > 0:
                return limit
        return None

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
            "max_model_len": self.max_model_len,
            "healthy": self.healthy,
            "draining": self.draining,
            "breaker": self.breaker.state,
            "consecutive_failures": self.consecutive_failures,
            "outstanding_requests": self.outstanding_requests,
            "outstanding_tokens": self.outstanding_tokens,
            "last_error": self.last_error,
            "refused": self.refused,
            "stats": self.stats,
        }


def normalize_url(url: str) -> str:
    """``url`` without surrounding blanks and trailing slashes, ``http://``
    added when it names no scheme; ``ValueError`` if it is no http(s) URL of a
    host (checked here so that a bad URL is refused where it comes in, not
    when a request to it fails)."""
    url = url.strip()
    if not url.rstrip("/"):
        raise ValueError("empty worker URL")
    if "://" not in url:
        url = f"http://{url}"
    url = url.rstrip("/")
    problem = _url_problem(url)
    if problem is not None:
        raise ValueError(f"invalid worker URL {url!r}: {problem}")
    return url


def _url_problem(url: str) -> str | None:
    """What makes ``url`` no http(s) URL of a host (None: nothing)."""
    # urlsplit silently drops tabs and newlines: look at the text first.
    if any(c.isspace() or not c.isprintable() for c in url):
        return "it contains blanks or control characters"
    try:
        parts = urlsplit(url)
        port = parts.port  # ValueError unless a number in [0, 65535]
    except ValueError as e:
        return str(e)
    if parts.scheme not in ("http", "https"):
        return "the scheme must be http or https"
    if not parts.hostname:
        return "it names no host"
    if port == 0:
        return "port 0"
    return None


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
        old.max_model_len = worker.max_model_len
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
        if not isinstance(url, str):
            return False
        try:
            return normalize_url(url) in self._workers
        except ValueError:  # no worker has an invalid URL
            return False

    def __len__(self) -> int:
        return len(self._workers)

    def __iter__(self) -> Iterator[WorkerInfo]:
        return iter(list(self._workers.values()))
