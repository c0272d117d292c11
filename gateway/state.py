"""What the gateway's routes share: configuration, routing, dispatch, metrics,
and the facts of the served model."""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx

from gateway.config import GatewayConfig
from gateway.dispatch import Dispatcher
from gateway.metrics import GatewayMetrics
from gateway.routing import HealthChecker, Router, WorkerAdmin
from gateway.text import Tokenizer
from protocol import tokenizer_files


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

    def __post_init__(self) -> None:
        self.admin = WorkerAdmin(self.router, self.health.probe)

    async def load_model_facts(self) -> None:
        """Tokenizer, served name and context window from the first worker."""
        workers = self.router.workers()
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
