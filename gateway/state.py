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
from gateway.routing import (
    HealthChecker,
    Router,
    WorkerAdmin,
    WorkerError,
    WorkerNotAdmitted,
    WorkerRefused,
    WorkerUnreachable,
)
from gateway.routing.workers import WorkerInfo
from gateway.text import Tokenizer
from protocol.roles import DECODE, PREFILL

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
    worker_model_name: str | None = None
    """The served model name of the worker the tokenizer came from: every
    other worker must serve the same (the gateway's own ``model_name`` may
    be ``served_model_name`` instead)."""
    admin: WorkerAdmin = field(init=False)
    """Adds and removes workers over the health checker's HTTP client."""
    admission: Admission = field(init=False)
    busy_poll: BusyPoller = field(init=False)
    background: set[asyncio.Task[None]] = field(default_factory=set)
    """Tasks nobody awaits (admin changes passed on to peer replicas): held
    here so that they are not collected while they run."""
    _facts_lock: asyncio.Lock = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.admin = WorkerAdmin(self.router, self.health.probe, admit=self.health.admit)
        self.admission = Admission(self.config.admission, self._worker_capacity)
        self.busy_poll = BusyPoller(self.config.busy_poll_linger_s)
        self.metrics.planner.configure(self.config.planner)
        self._facts_lock = asyncio.Lock()
        # What a worker must pass before it takes requests: its request plane
        # (the cluster token) first, then the model (a tokenizer to take, or
        # the same model as the workers before it).
        self.health.checks += [self.check_request_plane, self.check_model]

    def _worker_capacity(self) -> int | None:
        """Requests the available decode workers take at their bound (None:
        no per-worker bound)."""
        bound = self.router.config.max_requests_per_worker
        if not bound:
            return None
        return bound * len(self.router.available_decode())

    async def add_initial_workers(self) -> None:
        """The workers named at start. One whose first contact fails (it does
        not answer yet, answers something else than a worker, or fails its
        admission checks) is listed as down with the reason, logged once, and
        joins once a health check finds it fit: the gateway and its workers
        may start in any order, and the gateway serves whatever it has."""
        cfg = self.config
        for role, urls in ((PREFILL, cfg.prefill), (DECODE, cfg.decode)):
            for url in urls:
                try:
                    await self.admin.add_worker(url, role)
                except WorkerNotAdmitted:
                    pass  # listed, out of routing; the health checker logged why
                except (WorkerError, ValueError, httpx.HTTPError) as e:
                    # Not up yet; or a role other than the one named, a URL
                    # given twice (refused: no wait makes it right).
                    self._list_down(url, role, str(e), refused=not isinstance(e, WorkerUnreachable))
        if not self.router.workers():
            # The workers' admission checks load the model's facts; with none
            # listed, whatever ``load_model_facts`` takes them from.
            await self.refresh_model_facts()

    def _list_down(self, url: str, role: str, error: str, refused: bool = False) -> None:
        """List the worker at ``url`` as down with ``error`` (logged)."""
        worker = self.router.get(url)
        if worker is not None and worker.url not in self.router.pool_for(role):
            # Named for both pools: the entry of the other one stays as it is.
            log.error("worker %s is not added as %s: %s", worker.url, role, error)
            return
        if worker is None:
            worker = self.router.add(WorkerInfo(url=url, role=role, healthy=False))
        worker.healthy = False
        worker.last_error = error
        if refused:
            worker.refused = error
            log.warning("worker %s is not usable: %s", worker.url, error)
        elif not worker.info:
            log.warning("worker %s is not up yet (%s); it joins once it answers", worker.url, error)
        else:
            log.warning("worker %s is down: %s", worker.url, error)

    async def check_request_plane(self, worker: WorkerInfo) -> None:
        """Admission check: requests reach the worker (``Dispatcher.verify``:
        its request-plane handshake, which fails when the worker and the
        gateway do not hold the same cluster token)."""
        await self.dispatcher.verify(worker)

    async def check_model(self, worker: WorkerInfo) -> None:
        """Admission check: the worker serves this gateway's model. The first
        worker to pass gives the model's facts (``load_facts_from``); every
        later one must serve the same (``same_model``). Raises
        ``WorkerRefused`` with the reason and the fix."""
        async with self._facts_lock:
            if self.tokenizer is None:
                await self.load_facts_from(worker)
            else:
                self.same_model(worker)

    async def load_facts_from(self, worker: WorkerInfo) -> None:
        """Tokenizer (``GET /tokenizer``), served name, context window and
        vocabulary size (its /server_info, in ``worker.info``) from
        ``worker``. Raises ``WorkerRefused`` when it serves no usable
        tokenizer (and ``WorkerUnreachable`` or ``httpx.HTTPError`` when it
        did not answer)."""
        files = await self.health.probe.tokenizer_files(worker.url)
        try:
            tokenizer = Tokenizer.from_files(files)
        except Exception as e:  # any file that does not load: not this gateway's fault
            raise WorkerRefused(
                f"its tokenizer files (GET /tokenizer) do not load: {type(e).__name__}: {e}"
            ) from e
        info = worker.info
        served = info.get("served_model_name")
        self.tokenizer = tokenizer
        self.worker_model_name = served if isinstance(served, str) and served else None
        self.model_name = self.config.served_model_name or self.worker_model_name or "model"
        context = info.get("context_length")
        if not (type(context) is int and context > 0):
            context = tokenizer.model_max_length or 0
        self.context_length = context
        vocab = info.get("vocab_size")
        self.worker_vocab_size = vocab if type(vocab) is int and vocab > 0 else None
        log.info(
            "serving %r (context %d tokens) with the tokenizer of worker %s",
            self.model_name,
            self.context_length,
            worker.url,
        )

    def same_model(self, worker: WorkerInfo) -> None:
        """Raises ``WorkerRefused`` unless ``worker`` serves the model whose
        facts the gateway has (the same served name and vocabulary size, as
        far as its /server_info tells)."""
        name, vocab = worker.info.get("served_model_name"), worker.info.get("vocab_size")
        ours, our_vocab = self.worker_model_name, self.worker_vocab_size
        if isinstance(name, str) and ours is not None and name != ours:
            raise WorkerRefused(
                f"it serves the model {name!r}, the other workers serve {ours!r}: start it "
                f"with the same checkpoint (and --served-model-name {ours} if its directory "
                "is named otherwise)"
            )
        if type(vocab) is int and our_vocab is not None and vocab != our_vocab:
            raise WorkerRefused(
                f"its model has a vocabulary of {vocab} tokens, the other workers' has "
                f"{our_vocab}: it serves another model under the name {name!r}"
            )

    async def refresh_model_facts(self) -> None:
        """Load the model's facts if no worker gave them yet (errors suppressed)."""
        if self.tokenizer is None:
            with contextlib.suppress(RuntimeError, httpx.HTTPError, ValueError, WorkerError):
                await self.load_model_facts()

    @property
    def ready(self) -> bool:
        """The model's facts are known (some worker answered once)."""
        return self.tokenizer is not None

    async def wait_ready(self) -> None:
        """Until ``ready``, for at most ``worker_startup_timeout_s``; then
        ``NoWorkerAvailable``, at once when every listed worker was refused.
        (Waiting for a worker that can take a request is the dispatcher's,
        with the same bound.)"""
        if self.ready:
            return
        if not self.router.workers():
            await self.refresh_model_facts()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.worker_startup_timeout_s
        while not self.ready:
            refused = self._all_refused()
            if refused or loop.time() >= deadline:
                down = "; ".join(
                    f"{w.role} worker {w.url}: {w.refused or w.last_error or 'not up yet'}"
                    for w in self.router.workers()
                )
                within = "" if refused else f" within {self.config.worker_startup_timeout_s:g}s"
                raise NoWorkerAvailable(
                    f"no usable worker{within}" + (f" ({down})" if down else ": none registered")
                )
            # The health checker's rounds admit workers (and load the facts).
            await asyncio.sleep(0.05)

    def _all_refused(self) -> bool:
        workers = [w for w in self.router.workers() if not w.draining]
        return bool(workers) and all(w.refused is not None for w in workers)

    async def admit(self, tokens: int) -> None:
        """Take a slot for a generation request (``Overloaded`` if none);
        ``release`` gives it back."""
        try:
            await self.admission.acquire(tokens)
        except Overloaded:
            self.metrics.failures.inc("rate_limit_exceeded")
            raise

    async def load_model_facts(self) -> None:
        """The model's facts now: the health checks (and with them the
        admission checks, which load the facts) of every worker that is down;
        ``RuntimeError`` if no worker gave them."""
        if not self.router.workers():
            raise RuntimeError("no workers to take the tokenizer from")
        await self.health.check_all(only_unhealthy=True)
        if self.tokenizer is None:
            raise RuntimeError(
                "no worker gave the model's facts: "
                + "; ".join(
                    f"{w.url}: {w.last_error or 'not up yet'}" for w in self.router.workers()
                )
            )

    @property
    def max_model_len(self) -> int:
        """Prompt plus output tokens a request may have: the least of the
        workers' limits (``WorkerInfo.token_limit``: a KV pool may hold fewer
        tokens than the context length), over the workers that passed their
        checks; the model's context length while none tells."""
        limits = [
            w.token_limit
            for w in self.router.workers()
            if w.info and w.refused is None and not w.draining
        ]
        known = [x for x in limits if x is not None]
        return min(known) if known else self.context_length

    @property
    def vocab_size(self) -> int:
        """Token ids a request may carry are in [0, this): ids the tokenizer
        knows and, where the worker tells, the model can embed (a model's
        embedding may have fewer rows than its tokenizer has tokens, or more:
        padding rows no text maps to)."""
        assert self.tokenizer is not None
        vocab = self.tokenizer.vocab_size
        return vocab if self.worker_vocab_size is None else min(vocab, self.worker_vocab_size)
