"""What the gateway's routes share: configuration, routing, dispatch, metrics,
and the facts of the served model."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

import httpx

from gateway.admission import Admission, Overloaded
from gateway.busy_poll import BusyPoller
from gateway.config import GatewayConfig
from gateway.dispatch import Dispatcher, NoWorkerAvailable
from gateway.metrics import GatewayMetrics
from gateway.routing import HealthChecker, Router, WorkerAdmin, WorkerUnreachable
from gateway.routing.workers import WorkerInfo
from gateway.text import Tokenizer
from protocol import tokenizer_files

log = logging.getLogger("gateway.app")


@dataclass
class GatewayState:
    config: GatewayConfig
    router: Router
    health: HealthChecker
    dispatcher: Dispatcher
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    tokenizer: Tokenizer | None = None
    model_name: str = ""
    context_length: int = 0
    worker_vocab_size: int | None = None
    """Rows of the model's embedding, where a worker's /server_info tells."""
    admin: WorkerAdmin = field(init=False)
    """Adds and removes workers over the health checker's HTTP client."""
    admission: Admission = field(init=False)
    busy_poll: BusyPoller = field(init=False)

    def __post_init__(self) -> None:
        self.admin = WorkerAdmin(self.router, self.health.probe)
        self.admission = Admission(self.config.admission, self._worker_capacity)
        self.busy_poll = BusyPoller(self.config.busy_poll_linger_s)

    def _worker_capacity(self) -> int | None:
        """Requests the available decode workers take at their bound (None:
        no per-worker bound)."""
        bound = self.router.config.max_requests_per_worker
        if not bound:
            return None
        return bound * len(self.router.available_decode())

    async def add_initial_workers(self) -> None:
        """The workers named at start. One that does not answer yet is listed
        as down, and joins once a health check reaches it: the gateway and its
        workers may start in any order."""
        cfg = self.config
        for role, urls in (("prefill", cfg.prefill), ("decode", cfg.decode)):
            for url in urls:
                try:
                    await self.admin.add_worker(url, role)
                except WorkerUnreachable as e:
                    worker = self.router.add(WorkerInfo(url=url, role=role, healthy=False))
                    worker.last_error = str(e)
                    log.warning("worker %s is not up yet; it joins once it answers", worker.url)
        with contextlib.suppress(RuntimeError):
            await self.load_model_facts()

    async def refresh_model_facts(self) -> None:
        """Load the model's facts once a worker is up (health-round hook)."""
        if self.tokenizer is None:
            with contextlib.suppress(RuntimeError, httpx.HTTPError, ValueError):
                await self.load_model_facts()

    @property
    def ready(self) -> bool:
        """The model's facts are known (some worker answered once)."""
        return self.tokenizer is not None

    async def wait_ready(self) -> None:
        """Until ``ready``, for at most ``worker_startup_timeout_s``; then
        ``NoWorkerAvailable``. (Waiting for a worker that can take a request
        is the dispatcher's, with the same bound.)"""
        if self.ready:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.worker_startup_timeout_s
        while not self.ready:
            if loop.time() >= deadline:
                down = "; ".join(
                    f"{w.url}: {w.last_error or 'not up'}" for w in self.router.workers()
                )
                raise NoWorkerAvailable(
                    "no worker is up"
                    + (f" within {self.config.worker_startup_timeout_s:g}s" if down else "")
                    + (f" ({down})" if down else ": none registered")
                )
            await self.refresh_model_facts()
            await asyncio.sleep(0.05)

    async def admit(self, tokens: int) -> None:
        """Take a slot for a generation request (``Overloaded`` if none);
        ``release`` gives it back."""
        try:
            await self.admission.acquire(tokens)
        except Overloaded:
            self.metrics.failures.inc("rate_limit_exceeded")
            raise

    async def load_model_facts(self) -> None:
        """Tokenizer, served name and context window from the first worker
        that answers."""
        workers = [w for w in self.router.workers() if w.healthy] or self.router.workers()
        if not workers:
            raise RuntimeError("no workers to take the tokenizer from")
        w = workers[0]
        async with httpx.AsyncClient(timeout=30) as http:
            body = (await http.get(f"{w.url}/tokenizer")).raise_for_status().json()
            info = (await http.get(f"{w.url}/server_info")).raise_for_status().json()
        self.tokenizer = Tokenizer.from_files(tokenizer_files.unpack(body))
        self.model_name = self.config.served_model_name or info.get("served_model_name") or "model"
        self.context_length = int(info.get("context_length") or self.tokenizer.model_max_length)
        vocab = info.get("vocab_size")
        self.worker_vocab_size = vocab if type(vocab) is int and vocab > 0 else None

    @property
    def vocab_size(self) -> int:
        """Token ids a request may carry are in [0, this): ids the tokenizer
        knows and, where the worker tells, the model can embed (a model's
        embedding may have fewer rows than its tokenizer has tokens, or more:
        padding rows no text maps to)."""
        assert self.tokenizer is not None
        vocab = self.tokenizer.vocab_size
        return vocab if self.worker_vocab_size is None else min(vocab, self.worker_vocab_size)
