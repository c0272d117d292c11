"""The fault matrix: a real cluster under steady streaming load, dealt one fault
after another, with every greedy output checked against the offline engine.
The tool is ``python -m benchmarks.fault_matrix``; ``tests/test_fault_matrix.py``
runs the short matrix (``short_config``) through ``run_matrix``.

It starts N prefill and M decode workers (the built-in tiny model on the CPU,
or ``MatrixConfig.model``) and a gateway, computes the greedy completions of a
fixed set of token-id prompts with ``engine.llm.LLM``, and runs
``MatrixConfig.clients`` streaming clients (``/v1/completions``,
``return_token_ids``) through each scenario:

  baseline        no fault
  kill-prefill    SIGKILL a prefill worker (front and engine), restart it
  kill-decode     the same for a decode worker
  pause-prefill   SIGSTOP a prefill worker for a while, then SIGCONT
  pause-decode    the same for a decode worker
  kv-drop         the KV data of a write is lost (tcp and nccl only)
  kv-delay        every KV write's data is held back for a while (tcp and nccl only)
  disconnect      half the clients hang up mid-stream
  admin-readd     a decode worker removed through the admin API, then added back
  malformed       a burst of malformed requests beside the load (each must be a 4xx)
  overload        a burst of many more streams than the gateway admits (429 + Retry-After)
  kill-gateway    with two gateway replicas (``gateways=2``, each with half the clients):
                  SIGKILL one under load, restart it; its clients may fail, the
                  other's must not

Per scenario a ``Result``: requests; ok (output equal to the offline
engine's); wrong (any token that differs, even in a stream that then failed);
failed (ended with an error that says why: an error event or a 4xx/429); hung
(no end within ``hang_s``); leaked pages (after the load stops every worker
must go back to its starting KV pool, read from /server_info, and nothing may
stay in flight in a worker or the gateway); 5xx (an HTTP status >= 500, or a
stream ended by an internal error, on a valid request); failover (seconds from
the fault to the first token of the first request sent after it that
completed: served by another worker); recovery (seconds from the restarted,
resumed or re-added worker answering /health to its first transferred
request); share_after (that worker's share of its role's transfers in the
after-phase that follows: about 1/N for N workers of the role when routing
gives it its share). ``Result.bad``: any wrong, hung, leaked or 5xx (or a
malformed request that got no 4xx, a 429 without Retry-After, or a scenario
where nothing completed).

The KV faults use a test hook of the tcp and nccl backends (``kvtransfer.faults``),
enabled only here through ``DISAGG_KV_FAULT_FILE`` on the prefill workers.
"""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from harness.cluster import Gateway, Worker
from harness.procs import stop_all, wait_until
from kvtransfer.faults import FAULT_FILE_ENV
from worker.config import CLUSTER_TOKEN_ENV

ALL_SCENARIOS = (
    "baseline",
    "kill-prefill",
    "kill-decode",
    "pause-prefill",
    "pause-decode",
    "kv-drop",
    "kv-delay",
    "disconnect",
    "admin-readd",
    "malformed",
    "overload",
    "kill-gateway",
)
SHORT_SCENARIOS = ("kill-decode", "kv-drop", "disconnect", "malformed")
KV_FAULTS = ("kv-drop", "kv-delay")
KV_FAULT_BACKENDS = ("tcp", "nccl")
"""The backends with the fault hook (nixl's data path has none)."""
ENGINE: dict[str, Any] = dict(
    page_size=4,
    num_pages=384,
    context_length=256,
    max_running_requests=32,
    max_num_batched_tokens=256,
)
LIMITS = {"kill": 1.0, "pause": 3.0, "recovery": 10.0}
"""The issue's bounds: failover after a kill / a pause, recovery after answering health."""


@dataclass(frozen=True)
class MatrixConfig:
    prefill: int = 2
    decode: int = 2
    backend: str = "tcp"
    model: str | None = None
    clients: int = 6
    scenarios: tuple[str, ...] = ALL_SCENARIOS
    before_s: float = 3.0
    """Load before the fault."""
    fault_s: float = 5.0
    """Load while the fault lasts (worker dead or paused, KV fault on)."""
    after_s: float = 4.0
    """Load after recovery (or after the fault, for one-shot faults)."""
    hang_s: float = 30.0
    quiesce_s: float = 30.0
    transfer_timeout_s: float = 5.0
    threads: int = 1
    """Intra-op threads of each engine process (many processes share the cores)."""
    prompts: int = 24
    seed: int = 0
    log_dir: Path | None = None
    gateways: int = 1
    """Gateway replicas (the clients are spread over them); kill-gateway needs 2."""


def short_config(**overrides: Any) -> MatrixConfig:
    """The short matrix (the test suite's): one prefill worker, four clients,
    the ``SHORT_SCENARIOS`` and shorter phases."""
    short = dict(prefill=1, clients=4, scenarios=SHORT_SCENARIOS)
    phases = dict(before_s=2.0, fault_s=3.0, after_s=2.0)
    return MatrixConfig(**{**short, **phases, **overrides})


# -- workload ------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    max_tokens: int
    expected: list[int]


def make_prompts(n: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    """Token-id prompts in a few families that share a prefix (so cache-aware
    routing has something to do), with their max_tokens."""
    rng = random.Random(seed)
    heads = [[rng.randrange(3, vocab) for _ in range(rng.randrange(16, 40))] for _ in range(4)]
    out = []
    for i in range(n):
        tail = [rng.randrange(3, vocab) for _ in range(rng.randrange(2, 24))]
        out.append((heads[i % len(heads)] + tail, rng.randrange(6, 17)))
    return out


def reference(model: str | None, prompts: list[tuple[list[int], int]]) -> list[Prompt]:
    """The offline engine's greedy completions (ignore_eos: fixed lengths)."""
    from engine.llm import LLM
    from protocol.sampling import SamplingParams

    llm = LLM(model, device="cpu", page_size=4, num_pages=1024, context_length=256)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in prompts]
    outs = llm.generate([ids for ids, _ in prompts], params)
    return [Prompt(ids, m, o.token_ids) for (ids, m), o in zip(prompts, outs)]


# -- one request -----------------------------------------------------------------


@dataclass
class Record:
    started: float
    outcome: str = "pending"
    """ok, wrong, failed, rejected (429), disconnected, hung, server_error."""
    status: int = 0
    first_token: float | None = None
    ended: float | None = None
    error: str = ""
    via: int = 0
    """The gateway replica it was sent to."""


def _error_outcome(error: dict[str, Any]) -> tuple[str, str]:
    message = str(error.get("message") or "")
    if error.get("code") == "internal_error" or not message:
        return "server_error", message or json.dumps(error)
    return "failed", message


async def stream_one(
    http: httpx.AsyncClient,
    url: str,
    model: str,
    prompt: Prompt,
    hang_s: float,
    hang_up_after: int | None = None,
) -> Record:
    """One streamed completion; ``hang_up_after``: close the connection after
    that many tokens (a client that goes away)."""
    rec = Record(time.monotonic())
    body = {
        "model": model,
        "prompt": prompt.ids,
        "max_tokens": prompt.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    got: list[int] = []
    events: list[str] = []
    try:
        async with asyncio.timeout(hang_s):
            async with http.stream("POST", f"{url}/v1/completions", json=body) as resp:
                rec.status = resp.status_code
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    rec.outcome, rec.error = _http_outcome(resp, text)
                    return rec
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    events.append(line[6:200])
                    if "error" in event:
                        rec.outcome, rec.error = _error_outcome(event["error"])
                        break
                    for choice in event.get("choices", []):
                        ids = choice.get("token_ids") or []
                        if ids and rec.first_token is None:
                            rec.first_token = time.monotonic()
                        got += ids
                    if hang_up_after is not None and len(got) >= hang_up_after:
                        rec.outcome = "disconnected"
                        break
    except TimeoutError:
        rec.outcome, rec.error = "hung", f"no end within {hang_s:g}s"
    except httpx.HTTPError as e:
        # The gateway closed the connection without an error event.
        rec.outcome, rec.error = "server_error", f"{type(e).__name__}: {e}"
    rec.ended = time.monotonic()
    if got != prompt.expected[: len(got)]:
        rec.outcome = "wrong"
        rec.error = f"got {got}, expected {prompt.expected}; events: {' | '.join(events)}"
    elif rec.outcome == "pending":
        if got == prompt.expected:
            rec.outcome = "ok"
        else:
            rec.outcome, rec.error = "server_error", f"stream ended early without an error: {got}"
    return rec


def _http_outcome(resp: httpx.Response, text: str) -> tuple[str, str]:
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = ""
    if resp.status_code == 429:
        if "retry-after" not in resp.headers:
            return "server_error", "429 without Retry-After"
        return "rejected", message
    if resp.status_code >= 500 or not message:
        return "server_error", f"{resp.status_code}: {text[:200]}"
    return "failed", message


# -- load ------------------------------------------------------------------------


class Load:
    """``clients`` streaming clients sending the prompts round robin until
    ``stop``; every request's record is kept."""

    def __init__(
        self,
        url: str | list[str],
        model: str,
        prompts: list[Prompt],
        clients: int,
        hang_s: float,
        hang_up: bool = False,
    ) -> None:
        """``url``: one gateway, or replicas (client ``c`` uses ``url[c % n]``)."""
        self.urls = [url] if isinstance(url, str) else list(url)
        self.model, self.prompts = model, prompts
        self.clients, self.hang_s, self.hang_up = clients, hang_s, hang_up
        self.records: list[Record] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        for c in range(self.clients):
            self._tasks.append(asyncio.create_task(self._client(c)))

    async def _client(self, c: int) -> None:
        rng = random.Random(c)
        # One connection per client, kept across requests (a failure must not break it).
        async with httpx.AsyncClient(timeout=None) as http:
            i = c
            while not self._stop.is_set():
                prompt = self.prompts[i % len(self.prompts)]
                i += self.clients
                hang_up = rng.randrange(1, 4) if self.hang_up and c % 2 == 0 else None
                via = c % len(self.urls)
                url = self.urls[via]
                rec = await stream_one(http, url, self.model, prompt, self.hang_s, hang_up)
                rec.via = via
                self.records.append(rec)
                if rec.outcome == "rejected":
                    await asyncio.sleep(0.2)  # as told by Retry-After, shortened
                elif rec.error.startswith("ConnectError"):
                    await asyncio.sleep(0.2)  # nobody listens (a killed replica): retry later

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


# -- malformed input -----------------------------------------------------------


def malformed_requests(model: str) -> list[tuple[str, str, Any]]:
    """(method, path, body) of requests that must each get a 4xx: a JSON
    body, raw bytes, or a query string (admin)."""
    base = {"model": model, "max_tokens": 4}
    bodies: list[Any] = [
        b'{"model": ',
        b"",
        b"[1, 2, 3]",
        {"prompt": "hi", "max_tokens": 4},
        {**base, "prompt": "hi", "stop_token_ids": [10**20]},
        {**base, "prompt": [[False]]},
        {**base, "prompt": [True, 5]},
        {**base, "prompt": "hi", "max_tokens": 0},
        {**base, "prompt": "hi", "max_tokens": -1},
        {**base, "prompt": [10**9]},
        {**base, "prompt": "hi", "temperature": "hot"},
        {**base, "prompt": "hi", "n": 1000},
        {**base, "prompt": "hi", "logit_bias": {"abc": 1}},
        {**base, "prompt": "hi", "no_such_field": 1},
        {**base, "prompt": list(range(3, 3000))},
        {**base, "prompt": "hi", "model": "no-such-model"},
        {**base, "prompt": "hi", "seed": 2**70},
    ]
    out: list[tuple[str, str, Any]] = [("POST", "/v1/completions", b) for b in bodies]
    out += [
        ("POST", "/v1/chat/completions", {**base, "messages": "not a list"}),
        ("POST", "/v1/chat/completions", {**base, "messages": []}),
        ("POST", "/v1/chat/completions", {**base, "messages": [{"role": "user", "content": 5}]}),
        ("DELETE", "/admin/workers?url=", None),
        ("DELETE", "/admin/workers?url=http://", None),
        ("POST", "/admin/workers", {"url": 5}),
        ("POST", "/admin/workers", {"url": "http://127.0.0.1:1", "role": "boss"}),
    ]
    return out


async def send_malformed(url: str, admin_key: str, model: str, repeat: int) -> list[Record]:
    """Every malformed request ``repeat`` times, all at once."""

    async def one(http: httpx.AsyncClient, method: str, path: str, body: Any) -> Record:
        rec = Record(time.monotonic())
        headers = {"Authorization": f"Bearer {admin_key}"} if path.startswith("/admin") else {}
        kw: dict[str, Any] = {}
        if isinstance(body, bytes):
            kw = {"content": body, "headers": {**headers, "Content-Type": "application/json"}}
        elif body is not None:
            kw = {"json": body, "headers": headers}
        else:
            kw = {"headers": headers}
        try:
            resp = await http.request(method, f"{url}{path}", **kw)
            rec.status = resp.status_code
            if 400 <= resp.status_code < 500 and "error" in resp.json():
                rec.outcome = "failed"
            else:
                rec.outcome = "server_error" if resp.status_code >= 500 else "accepted"
            rec.error = f"{method} {path} {str(body)[:80]} -> {resp.status_code} {resp.text[:120]}"
        except (httpx.HTTPError, ValueError) as e:
            rec.outcome, rec.error = "server_error", f"{method} {path}: {type(e).__name__}: {e}"
        rec.ended = time.monotonic()
        return rec

    reqs = malformed_requests(model) * repeat
    async with httpx.AsyncClient(timeout=30) as http:
        return list(await asyncio.gather(*(one(http, *r) for r in reqs)))


# -- the cluster and the scenarios ---------------------------------------------


@dataclass
class Result:
    scenario: str
    requests: int = 0
    ok: int = 0
    wrong: int = 0
    failed: int = 0
    rejected: int = 0
    disconnected: int = 0
    hung: int = 0
    leaked_pages: int = 0
    stuck: int = 0
    """Requests still in a worker or the gateway after quiescence."""
    server_errors: int = 0
    accepted: int = 0
    """Malformed requests that got no 4xx (nor a 5xx)."""
    failover_s: float | None = None
    recovery_s: float | None = None
    share_after: float | None = None
    """The restarted (resumed, re-added) worker's share of its role's
    transfers during the after-phase: ~1/N when routing gives it its share."""
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    examples: list[str] = field(default_factory=list)

    @property
    def bad(self) -> bool:
        nothing = self.ok == 0 and self.scenario != "malformed"
        return bool(
            self.wrong
            or self.hung
            or self.leaked_pages
            or self.stuck
            or self.server_errors
            or self.accepted
        ) or (nothing and self.requests > 0)


class Matrix:
    def __init__(self, cfg: MatrixConfig, log_dir: Path) -> None:
        self.cfg = cfg
        self.log_dir = log_dir
        self.token = secrets.token_hex(16)
        self.admin_key = secrets.token_hex(16)
        self.fault_file = log_dir / "kv-fault"
        self.fault_file.write_text("off")
        env = {CLUSTER_TOKEN_ENV: self.token, "OMP_NUM_THREADS": str(cfg.threads)}
        settings = {
            **ENGINE,
            "transfer_backend": cfg.backend,
            "transfer_timeout_s": cfg.transfer_timeout_s,
        }
        prefill_env = {**env, FAULT_FILE_ENV: str(self.fault_file)}
        self.prefill = [
            Worker.make(
                f"prefill-{i}", "prefill", log_dir, model=cfg.model, env=prefill_env, **settings
            )
            for i in range(cfg.prefill)
        ]
        self.decode = [
            Worker.make(f"decode-{i}", "decode", log_dir, model=cfg.model, env=env, **settings)
            for i in range(cfg.decode)
        ]
        self.gateways = [
            Gateway.make(
                log_dir / f"gateway-{i}.log",
                self._gateway_args(cfg),
                env={CLUSTER_TOKEN_ENV: self.token},
                admin_key=self.admin_key,
                name=f"gateway-{i}",
            )
            for i in range(cfg.gateways)
        ]
        for g in self.gateways:  # replicas: admin changes reach every one
            others = [o.url for o in self.gateways if o is not g]
            if others:
                g.cmd += ["--peers", *others]
        self.gateway = self.gateways[0]
        self.prompts: list[Prompt] = []
        self.model_name = ""

    def _gateway_args(self, cfg: MatrixConfig) -> list[str]:
        return [
            "--prefill",
            *(w.url for w in self.prefill),
            "--decode",
            *(w.url for w in self.decode),
            "--health-interval-s",
            "1",
            "--worker-timeout-s",
            "20",
            "--request-timeout-s",
            "60",
            "--max-concurrent-requests",
            str(2 * cfg.clients),
            "--max-queued-tokens",
            "800",
            "--max-queue-wait-s",
            "5",
            "--log-level",
            "info",
        ]

    @property
    def workers(self) -> list[Worker]:
        return [*self.prefill, *self.decode]

    def start(self) -> None:
        for w in self.workers:
            w.start()
        prompts = make_prompts(self.cfg.prompts, _vocab(self.cfg.model), self.cfg.seed)
        self.prompts = reference(self.cfg.model, prompts)  # while the workers load
        for w in self.workers:
            w.wait_healthy()
        for g in self.gateways:
            g.start()
        for g in self.gateways:
            g.wait_http()
        models = httpx.get(f"{self.gateway.url}/v1/models", timeout=10).json()
        self.model_name = models["data"][0]["id"]
        # Every worker must be in routing before the first scenario.
        ok = wait_until(lambda: self._all_available(), 30)
        if not ok:
            raise RuntimeError(f"workers not all available: {self.gateway.workers()}")

    def _all_available(self) -> bool:
        for g in self.gateways:
            ws = g.workers()
            if not all(
                ws.get(w.url, {}).get("healthy") and ws[w.url]["breaker"] == "closed"
                for w in self.workers
            ):
                return False
        return True

    def stop(self) -> None:
        stop_all([*self.gateways, *self.workers])

    # -- running one scenario ----------------------------------------------------

    async def run(self, name: str) -> Result:
        result = Result(name)
        if name in KV_FAULTS and self.cfg.backend not in KV_FAULT_BACKENDS:
            result.notes.append(f"{' and '.join(KV_FAULT_BACKENDS)} only")
            return result
        if name == "kill-gateway" and len(self.gateways) < 2:
            result.notes.append("needs two gateway replicas (--gateways 2)")
            return result
        t0 = time.monotonic()
        load = Load(
            [g.url for g in self.gateways],
            self.model_name,
            self.prompts,
            self.cfg.clients,
            self.cfg.hang_s,
            hang_up=name == "disconnect",
        )
        load.start()
        extra: list[Record] = []
        fault_at: float | None = None
        try:
            await asyncio.sleep(self.cfg.before_s)
            action = getattr(self, "_" + name.replace("-", "_"))
            fault_at = await action(result, extra)
        finally:
            await load.stop()
        records = load.records + extra
        if name == "kill-gateway":
            records = self._killed_replica_records(result, records)
        self._count(result, records, fault_at)
        await asyncio.to_thread(self._quiesce, result)
        result.seconds = round(time.monotonic() - t0, 1)
        return result

    async def _kill_gateway(self, result: Result, extra: list[Record]) -> float:
        """SIGKILL the last replica under load, restart it after the fault."""
        g = self.gateways[-1]
        at = time.monotonic()
        await asyncio.to_thread(g.kill)
        await asyncio.sleep(self.cfg.fault_s)
        g.start()
        await asyncio.to_thread(g.wait_http)
        await asyncio.to_thread(wait_until, self._all_available, 30)
        await asyncio.sleep(self.cfg.after_s)
        return at

    def _killed_replica_records(self, result: Result, records: list[Record]) -> list[Record]:
        """The killed replica's clients may see their streams cut and their
        connections refused: counted as failed with that reason, not as 5xx.
        The other replicas' clients must see nothing of it."""
        killed = len(self.gateways) - 1
        out = []
        for r in records:
            if r.via == killed and r.outcome == "server_error":
                r.outcome = "failed"
                r.error = f"its gateway replica was killed: {r.error}"
            out.append(r)
        survivors = [r for r in records if r.via != killed and r.outcome not in ("ok", "rejected")]
        if survivors:
            result.notes.append(
                f"{len(survivors)} requests through the surviving replica did not succeed"
            )
            for r in survivors:
                if r.outcome == "failed":
                    r.outcome = "server_error"
        return out

    async def _baseline(self, result: Result, extra: list[Record]) -> float | None:
        await asyncio.sleep(self.cfg.fault_s + self.cfg.after_s)
        return None

    async def _kill(self, w: Worker, result: Result) -> float:
        at = time.monotonic()
        await asyncio.to_thread(w.kill)
        await asyncio.sleep(self.cfg.fault_s)
        w.start()
        await asyncio.to_thread(w.wait_healthy)
        await self._recovery(w, result, baseline=0)
        return at

    async def _kill_prefill(self, result: Result, extra: list[Record]) -> float:
        return await self._kill(self.prefill[0], result)

    async def _kill_decode(self, result: Result, extra: list[Record]) -> float:
        return await self._kill(self.decode[0], result)

    async def _pause(self, w: Worker, result: Result) -> float:
        at = time.monotonic()
        w.pause()
        await asyncio.sleep(self.cfg.fault_s)
        w.resume()
        await asyncio.to_thread(wait_until, lambda: httpx.get(f"{w.url}/health").is_success, 30)
        baseline = (await asyncio.to_thread(w.stats))["transfers_ok"]
        await self._recovery(w, result, baseline)
        return at

    async def _pause_prefill(self, result: Result, extra: list[Record]) -> float:
        return await self._pause(self.prefill[0], result)

    async def _pause_decode(self, result: Result, extra: list[Record]) -> float:
        return await self._pause(self.decode[0], result)

    async def _recovery(self, w: Worker, result: Result, baseline: int) -> None:
        """Time from ``w`` answering health to its first transferred request
        (load keeps running); then the after-phase."""
        t = time.monotonic()
        limit = 3 * LIMITS["recovery"]
        served = await asyncio.to_thread(
            wait_until, lambda: w.stats()["transfers_ok"] > baseline, limit
        )
        if served:
            result.recovery_s = round(time.monotonic() - t, 2)
        else:
            result.notes.append(f"{w.name} got no traffic within {limit:g}s of answering health")
        peers = self.prefill if w in self.prefill else self.decode
        before = await asyncio.to_thread(lambda: [p.stats()["transfers_ok"] for p in peers])
        await asyncio.sleep(self.cfg.after_s)
        after = await asyncio.to_thread(lambda: [p.stats()["transfers_ok"] for p in peers])
        moved = [a - b for a, b in zip(after, before)]
        if sum(moved):
            result.share_after = round(moved[peers.index(w)] / sum(moved), 2)

    async def _kv(self, command: str, hold_s: float) -> float:
        at = time.monotonic()
        self.fault_file.write_text(command)
        await asyncio.sleep(hold_s)
        self.fault_file.write_text("off")
        return at

    async def _kv_drop(self, result: Result, extra: list[Record]) -> float | None:
        await self._kv("drop 1", self.cfg.transfer_timeout_s + self.cfg.fault_s)
        await asyncio.sleep(self.cfg.after_s)
        return None

    async def _kv_delay(self, result: Result, extra: list[Record]) -> float | None:
        await self._kv("delay 0.3", self.cfg.fault_s)
        await asyncio.sleep(self.cfg.after_s)
        return None

    async def _disconnect(self, result: Result, extra: list[Record]) -> float | None:
        await asyncio.sleep(self.cfg.fault_s + self.cfg.after_s)
        return None

    async def _admin_readd(self, result: Result, extra: list[Record]) -> float:
        w = self.decode[0]
        at = time.monotonic()
        resp = await asyncio.to_thread(self.gateway.admin, "DELETE", f"/admin/workers?url={w.url}")
        if resp.status_code != 200:
            result.notes.append(f"removal answered {resp.status_code}: {resp.text[:200]}")
        await asyncio.sleep(self.cfg.fault_s)
        # Drained by now: a removed worker must get no new request.
        before = (await asyncio.to_thread(w.stats))["transfers_ok"]
        await asyncio.sleep(1.0)
        baseline = (await asyncio.to_thread(w.stats))["transfers_ok"]
        if baseline != before:
            result.notes.append(f"{w.name} still got traffic after its removal")
            result.server_errors += 1
        resp = await asyncio.to_thread(
            self.gateway.admin, "POST", "/admin/workers", json={"url": w.url, "role": "decode"}
        )
        if resp.status_code != 200:
            result.notes.append(f"re-adding answered {resp.status_code}: {resp.text[:200]}")
        await self._recovery(w, result, baseline)
        return at

    async def _malformed(self, result: Result, extra: list[Record]) -> float | None:
        for _ in range(3):
            extra += await send_malformed(self.gateway.url, self.admin_key, self.model_name, 2)
            await asyncio.sleep(self.cfg.fault_s / 3)
        await asyncio.sleep(self.cfg.after_s)
        return None

    async def _overload(self, result: Result, extra: list[Record]) -> float | None:
        burst = Load(
            self.gateway.url, self.model_name, self.prompts, 8 * self.cfg.clients, self.cfg.hang_s
        )
        burst.start()
        await asyncio.sleep(self.cfg.fault_s)
        await burst.stop()
        extra += burst.records
        if not any(r.outcome == "rejected" for r in burst.records):
            result.notes.append("no 429 under overload")
        await asyncio.sleep(self.cfg.after_s)
        return None

    # -- accounting --------------------------------------------------------------

    def _count(self, result: Result, records: list[Record], fault_at: float | None) -> None:
        result.requests = len(records)
        for r in records:
            if r.outcome == "server_error":
                result.server_errors += 1
            elif r.outcome in (
                "ok",
                "wrong",
                "failed",
                "rejected",
                "disconnected",
                "hung",
                "accepted",
            ):
                setattr(result, r.outcome, getattr(result, r.outcome) + 1)
        if result.accepted:
            result.notes.append(f"{result.accepted} malformed requests got no 4xx")
        # The worst outcomes first, a few of each.
        for kind in ("wrong", "server_error", "hung", "accepted", "failed"):
            shown = [r for r in records if r.outcome == kind][:3]
            result.examples += [f"{kind}: {r.error[:1500]}" for r in shown]
        if fault_at is not None:
            served = [
                r.first_token
                for r in records
                if r.started >= fault_at and r.outcome == "ok" and r.first_token is not None
            ]
            if served:
                result.failover_s = round(min(served) - fault_at, 2)

    def _quiesce(self, result: Result) -> None:
        """Every live worker idle with its starting pool, nothing outstanding in
        the gateway; what is not is reported as leaked or stuck."""
        live = [w for w in self.workers if w.alive]

        def pending() -> tuple[int, int, list[str]]:
            leaked = stuck = 0
            why = []
            for w in live:
                s, start = w.stats(), w.start_stats
                busy = sum(
                    s.get(k, 0)
                    for k in (
                        "running",
                        "waiting",
                        "in_flight",
                        "rooms",
                        "prealloc",
                        "transferring",
                    )
                )
                lost = start["available_pages"] - s["available_pages"]
                if busy or lost:
                    why.append(f"{w.name}: {busy} busy, {lost} pages short")
                stuck += busy
                leaked += max(0, lost)
            for gw in self.gateways:
                if not gw.alive:
                    continue
                for url, g in gw.workers().items():
                    if g["outstanding_requests"]:
                        stuck += g["outstanding_requests"]
                        why.append(f"{gw.name}: {g['outstanding_requests']} outstanding on {url}")
            return leaked, stuck, why

        last: tuple[int, int, list[str]] = (0, 0, [])

        def idle() -> bool:
            nonlocal last
            last = pending()
            return not last[0] and not last[1]

        if not wait_until(idle, self.cfg.quiesce_s, poll_s=0.1):
            result.leaked_pages, result.stuck = last[0], last[1]
            result.notes += last[2]


def _vocab(model: str | None) -> int:
    if model is None:
        from engine.tiny import VOCAB_SIZE

        return VOCAB_SIZE
    cfg = json.loads((Path(model) / "config.json").read_text())
    return int(cfg["vocab_size"])


async def run_matrix(cfg: MatrixConfig, on_result: Callable[[Result], None]) -> list[Result]:
    log_dir = cfg.log_dir or Path(tempfile.mkdtemp(prefix="fault-matrix-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    matrix = Matrix(cfg, log_dir)
    results: list[Result] = []
    try:
        await asyncio.to_thread(matrix.start)
        for name in cfg.scenarios:
            result = await matrix.run(name)
            results.append(result)
            on_result(result)
            await asyncio.to_thread(_wait_settled, matrix)
    except BaseException:
        for p in [*matrix.workers, *matrix.gateways]:
            print(f"--- {p.name} ---\n{p.log_tail(40)}", file=sys.stderr)
        raise
    finally:
        await asyncio.to_thread(matrix.stop)
    return results


def _wait_settled(matrix: Matrix) -> None:
    """Before the next scenario: every worker back in routing."""
    if not wait_until(matrix._all_available, 30):
        raise RuntimeError(f"workers did not all come back: {matrix.gateway.workers()}")
