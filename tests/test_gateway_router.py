"""Unit tests of the gateway's routing layer (gateway/routing/): no real
workers; the health checker and the worker admin talk to a plain http.server
fake worker or to an httpx.MockTransport."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from workers import free_port

from gateway.routing import (
    DECODE_POLICIES,
    PREFILL_POLICIES,
    ApproxPrefixTree,
    CacheAwarePolicy,
    CircuitBreaker,
    HealthChecker,
    Router,
    RouterConfig,
    WorkerAdmin,
    WorkerInfo,
    WorkerPool,
    WorkerRoleMismatch,
    WorkerUnreachable,
)

REPO = Path(__file__).resolve().parents[1]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_router(clock: FakeClock | None = None, **overrides: Any) -> Router:
    return Router(RouterConfig(**overrides), clock=clock or FakeClock(), rng=random.Random(0))


def add(router: Router, url: str, role: str) -> WorkerInfo:
    return router.add(
        WorkerInfo(
            url=url,
            role=role,
            request_endpoint=f"tcp://{url}:1",
            bootstrap_endpoint=None if role == "both" else f"tcp://{url}:2",
        )
    )


# -- config and registries ---------------------------------------------------------


def test_registries_and_config_validation() -> None:
    assert set(PREFILL_POLICIES) == {"round_robin", "least_load", "cache_aware"}
    assert set(DECODE_POLICIES) == {"least_load", "power_of_two"}
    cfg = RouterConfig()
    with pytest.raises(AttributeError):
        cfg.prefill_policy = "least_load"  # type: ignore[misc]
    with pytest.raises(ValueError, match="unknown prefill policy 'fastest'"):
        RouterConfig(prefill_policy="fastest")
    with pytest.raises(ValueError, match="unknown decode policy 'cache_aware'"):
        RouterConfig(decode_policy="cache_aware")
    with pytest.raises(ValueError, match="unhealthy_after"):
        RouterConfig(unhealthy_after=0)
    with pytest.raises(ValueError, match="cache_min_match_ratio"):
        RouterConfig(cache_min_match_ratio=1.5)
    for name in ("prefill", "decode", "both"):
        assert WorkerInfo(url="h:1", role=name).url == "http://h:1"
    with pytest.raises(ValueError, match="unknown worker role"):
        WorkerInfo(url="h:1", role="encode")


# -- prefill policies --------------------------------------------------------------


def test_round_robin_cycles_and_skips_unavailable() -> None:
    r = make_router(prefill_policy="round_robin")
    a, b, c = (add(r, f"http://p{i}", "prefill") for i in range(3))
    picks = [r.pick_prefill([1, 2, 3]) for _ in range(6)]
    assert picks == [a, b, c, a, b, c]
    b.healthy = False
    assert [r.pick_prefill([1]) for _ in range(4)] == [a, c, a, c]
    b.healthy = True
    assert [r.pick_prefill([1]) for _ in range(3)] == [a, b, c]


def test_least_load_by_tokens_then_requests() -> None:
    r = make_router(prefill_policy="least_load", decode_policy="least_load")
    a = add(r, "http://p0", "prefill")
    b = add(r, "http://p1", "prefill")
    r.begin(a, 100)
    assert r.pick_prefill([1]) is b
    r.begin(b, 300)
    assert r.pick_prefill([1]) is a
    r.end(b, 300, ok=True)
    r.begin(b, 100)
    r.begin(b, 0)  # same tokens as a, one request more
    assert (a.outstanding_tokens, b.outstanding_tokens) == (100, 100)
    assert r.pick_prefill([1]) is a
    d0 = add(r, "http://d0", "decode")
    d1 = add(r, "http://d1", "decode")
    r.begin(d0, 50)
    assert r.pick_decode([1]) is d1


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32000) for _ in range(n)]


def test_cache_aware_prefers_the_worker_that_served_the_prefix() -> None:
    r = make_router(prefill_policy="cache_aware", cache_block_tokens=16)
    policy = r.prefill_policy
    assert isinstance(policy, CacheAwarePolicy)
    a = add(r, "http://p0", "prefill")
    b = add(r, "http://p1", "prefill")
    system = prompt(1, 256)

    first = r.pick_prefill(system + prompt(2, 32))
    assert first is a and policy.last_decision == "low_match"
    r.begin(a, 288)  # a is now busier than b, within the balance thresholds
    assert r.pick_prefill(prompt(3, 64)) is b  # unrelated prompt: least load
    assert policy.last_decision == "low_match"
    r.begin(b, 64)

    # Same system prompt, another question: a matched 256 of 288 tokens, so
    # a is done with it first (288 queued + 32 new < 64 queued + 288 new).
    for _ in range(3):
        assert r.pick_prefill(system + prompt(4, 32)) is a
        assert policy.last_decision == "cache"
    # b served prompt(3): a prompt extending it goes to b even though a is
    # the less loaded one now (314 + 16 new < 288 + 80 new).
    r.begin(b, 250)
    assert a.outstanding_tokens < b.outstanding_tokens
    assert r.pick_prefill(prompt(3, 64) + prompt(5, 16)) is b
    assert policy.last_decision == "cache"
    # Once a's queue is longer than what its cache saves, the prompt goes to
    # b although only a has it cached (1288 + 32 > 314 + 288).
    r.begin(a, 1000)
    assert r.pick_prefill(system + prompt(4, 32)) is b
    assert policy.last_decision == "cache"


def test_cache_aware_gives_a_restarted_worker_its_share() -> None:
    """A worker with an empty tree (restarted or new) gets prompts that share
    a prefix with what another worker cached as soon as that worker has a
    queue, instead of never (every prompt matched the busy worker's tree)."""
    r = make_router(prefill_policy="cache_aware", cache_block_tokens=16)
    a = add(r, "http://p0", "prefill")
    system = prompt(1, 256)
    for i in range(4):
        assert r.pick_prefill(system + prompt(100 + i, 32)) is a
    b = add(r, "http://p1", "prefill")
    counts = {a.url: 0, b.url: 0}
    in_flight: list[tuple[WorkerInfo, int]] = []
    for i in range(40):
        ids = system + prompt(200 + i, 32)
        w = r.pick_prefill(ids)
        assert w is not None
        counts[w.url] += 1
        r.begin(w, len(ids))
        in_flight.append((w, len(ids)))
        if len(in_flight) > 4:  # four prefills in flight at a time
            done, n = in_flight.pop(0)
            r.end(done, n, True)
    assert min(counts.values()) >= 10, counts


def test_cache_aware_falls_back_to_least_load_on_a_big_load_gap() -> None:
    r = make_router(
        prefill_policy="cache_aware",
        balance_abs_threshold=1000,
        balance_rel_threshold=2.0,
        cache_min_match_ratio=0.5,
    )
    policy = r.prefill_policy
    a = add(r, "http://p0", "prefill")
    b = add(r, "http://p1", "prefill")
    ids = prompt(7, 512)
    assert r.pick_prefill(ids) is a
    # Gap 400 < 1000 absolute, and a's queue is shorter than the prompt it
    # has cached: still a, by the cache.
    r.begin(a, 400)
    assert r.pick_prefill(ids) is a and policy.last_decision == "cache"
    # Gap 1500 > 1000 and 1500 > 2 * 0: imbalanced, least load wins.
    r.begin(a, 1100)
    assert r.pick_prefill(ids) is b and policy.last_decision == "imbalance"
    # Both busy: gap 1200 but 3000 < 2 * 1800 (relative threshold not met):
    # the cache-aware rule decides again (b's tree reset, so only a has the
    # prefix); b finishes first (1800 + 512 < 3000 + 0).
    policy.forget(b.url)
    r.begin(b, 1800)
    r.begin(a, 1500)
    assert (a.outstanding_tokens, b.outstanding_tokens) == (3000, 1800)
    assert r.pick_prefill(ids) is b and policy.last_decision == "cache"


def test_cache_aware_low_match_uses_least_load() -> None:
    r = make_router(prefill_policy="cache_aware", cache_min_match_ratio=0.5, cache_block_tokens=8)
    policy = r.prefill_policy
    a = add(r, "http://p0", "prefill")
    b = add(r, "http://p1", "prefill")
    shared = prompt(11, 64)
    assert r.pick_prefill(shared + prompt(12, 64)) is a
    r.begin(a, 10)
    # 64 of 256 tokens match on a (25% < 50%): least load (b).
    assert r.pick_prefill(shared + prompt(13, 192)) is b
    assert policy.last_decision == "low_match"
    # An empty prompt never divides by zero.
    assert r.pick_prefill([]) in (a, b)


def test_prefix_tree_matches_by_block_and_evicts_lru() -> None:
    tree = ApproxPrefixTree(block_tokens=4, max_blocks=6)
    p1 = list(range(0, 8))  # 2 blocks
    p2 = list(range(100, 108))
    p3 = list(range(200, 208))
    tree.insert(p1)
    assert tree.match(p1) == 8
    assert tree.match(p1[:4] + [999, 998, 997, 996]) == 4
    assert tree.match([999] + p1) == 0
    assert tree.match(p1 + [5, 6]) == 8  # the stored prefix, not the new tail
    tree.insert(p2)
    tree.insert(p3)
    assert len(tree) == 6
    tree.insert(p1)  # refresh p1: p2 is now the least recently routed
    tree.insert(list(range(300, 304)))  # 1 more block: evicts p2's deepest block
    assert len(tree) == 6
    assert tree.match(p2) == 4 and tree.match(p1) == 8 and tree.match(p3) == 8
    tree.insert(list(range(400, 408)))  # 2 more: p2's root block, then p3's leaf
    assert len(tree) == 6
    assert tree.match(p2) == 0 and tree.match(p3) == 4 and tree.match(p1) == 8
    # A prompt longer than the bound keeps only its first blocks.
    tree.insert(list(range(1000, 1040)))
    assert len(tree) == 6 and tree.match(list(range(1000, 1040))) == 24


def test_cache_aware_tree_is_bounded_per_worker() -> None:
    r = make_router(prefill_policy="cache_aware", cache_block_tokens=16, cache_max_tokens=160)
    policy = r.prefill_policy
    assert isinstance(policy, CacheAwarePolicy)
    a = add(r, "http://p0", "prefill")
    old = prompt(20, 64)
    r.pick_prefill(old)
    for seed in range(21, 40):
        r.pick_prefill(prompt(seed, 64))
    assert len(policy.tree(a.url)) <= 10
    assert policy.tree(a.url).match(old) == 0
    assert policy.tree(a.url).match(prompt(39, 64)) == 64


# -- decode policies ---------------------------------------------------------------


class ScriptedRandom(random.Random):
    """rng.sample answers from a script."""

    def __init__(self, picks: list[tuple[int, int]]) -> None:
        super().__init__(0)
        self.picks = list(picks)

    def sample(self, population, k, **kwargs):  # type: ignore[override]
        i, j = self.picks.pop(0)
        assert k == 2
        return [population[i], population[j]]


def test_power_of_two_picks_the_lesser_of_the_two_sampled() -> None:
    rng = ScriptedRandom([(0, 1), (2, 1), (2, 0), (1, 2)])
    r = Router(RouterConfig(decode_policy="power_of_two"), rng=rng)
    w = [add(r, f"http://d{i}", "decode") for i in range(3)]
    r.begin(w[0], 10)
    r.begin(w[1], 20)
    r.begin(w[2], 5)
    assert r.pick_decode([1]) is w[0]  # 10 vs 20
    assert r.pick_decode([1]) is w[2]  # 5 vs 20
    assert r.pick_decode([1]) is w[2]  # 5 vs 10
    r.begin(w[2], 15)  # 20: tie with w[1] -> the first sampled
    assert r.pick_decode([1]) is w[1]


def test_power_of_two_never_picks_the_most_loaded() -> None:
    r = Router(RouterConfig(decode_policy="power_of_two"), rng=random.Random(1234))
    w = [add(r, f"http://d{i}", "decode") for i in range(4)]
    for i, worker in enumerate(w):
        r.begin(worker, 100 * i)
    picks = [r.pick_decode([1]) for _ in range(200)]
    assert w[3] not in picks
    assert {p.url for p in picks} == {w[0].url, w[1].url, w[2].url}
    only = Router(RouterConfig(decode_policy="power_of_two"))
    assert only.pick_decode([1]) is None
    single = add(only, "http://d9", "decode")
    assert only.pick_decode([1]) is single


# -- circuit breaker ---------------------------------------------------------------


def test_breaker_transitions_with_a_fake_clock() -> None:
    clock = FakeClock()
    br = CircuitBreaker(failure_threshold=3, cooldown_s=10.0, clock=clock)
    assert br.state == "closed" and br.allows()
    br.record(False)
    br.record(False)
    br.record(True)  # a success resets the count
    br.record(False)
    br.record(False)
    assert br.state == "closed" and br.allows()
    br.record(False)
    assert br.state == "open" and not br.allows()
    clock.advance(9.9)
    assert br.state == "open" and not br.allows()
    clock.advance(0.1)
    assert br.state == "half_open" and br.allows()
    br.on_request()  # the one trial
    assert not br.allows()
    br.record(False)  # trial failed: open again, cooldown restarts
    assert br.state == "open" and not br.allows()
    clock.advance(5)
    assert br.state == "open"
    clock.advance(5)
    assert br.state == "half_open" and br.allows()
    br.on_request()
    br.record(True)
    assert br.state == "closed" and br.allows() and br.failures == 0


def test_router_feeds_the_breaker_and_skips_open_workers() -> None:
    clock = FakeClock()
    r = make_router(
        clock, decode_policy="least_load", breaker_failure_threshold=2, breaker_cooldown_s=30
    )
    a = add(r, "http://d0", "decode")
    b = add(r, "http://d1", "decode")
    r.begin(b, 1)  # b busier: a is preferred while it is allowed
    for _ in range(2):
        w = r.pick_decode([1])
        assert w is a
        r.begin(a, 10)
        r.end(a, 10, ok=False, error="boom")
    assert a.breaker.state == "open" and a.last_error == "boom"
    assert r.pick_decode([1]) is b
    clock.advance(30)
    assert r.pick_decode([1]) is a  # half-open: one trial
    r.begin(a, 10)
    assert r.pick_decode([1]) is b  # trial in flight: nobody else gets through
    r.end(a, 10, ok=True)
    assert a.breaker.state == "closed"
    assert r.pick_decode([1]) is a
    assert (a.outstanding_requests, a.outstanding_tokens) == (0, 0)


# -- membership, draining, health -------------------------------------------------


def test_draining_worker_gets_no_traffic_and_is_dropped_after_its_last_request() -> None:
    r = make_router(prefill_policy="cache_aware")
    a = add(r, "http://p0", "prefill")
    b = add(r, "http://p1", "prefill")
    ids = prompt(50, 128)
    assert r.pick_prefill(ids) is a
    r.begin(a, 128)
    r.begin(a, 64)
    assert r.remove("http://p0/") is a
    assert a.draining and r.get("http://p0") is a
    for _ in range(5):
        assert r.pick_prefill(ids) is b  # a holds the prefix but is draining
    r.end(a, 128, ok=True)
    assert r.get("http://p0") is a  # one request still in flight
    r.end(a, 64, ok=False)
    assert r.get("http://p0") is None and a not in r.workers()
    policy = r.prefill_policy
    assert isinstance(policy, CacheAwarePolicy) and a.url not in policy.trees
    # Removing an idle worker drops it at once; unknown URLs are None.
    assert r.remove(b.url) is b and r.get(b.url) is None
    assert r.remove("http://nowhere") is None
    assert r.pick_prefill(ids) is None


def test_readding_a_draining_worker_keeps_its_counters() -> None:
    r = make_router()
    a = add(r, "http://d0", "decode")
    r.begin(a, 7)
    r.remove(a.url)
    again = add(r, "http://d0", "decode")
    assert again is a and not a.draining and a.outstanding_tokens == 7
    assert r.pick_decode([1]) is a
    with pytest.raises(ValueError, match="already registered with role 'decode'"):
        add(r, "http://d0", "prefill")
    pool = WorkerPool("prefill")
    with pytest.raises(ValueError, match="takes roles prefill"):
        pool.add(WorkerInfo(url="http://x", role="decode"))


def test_unhealthy_workers_are_skipped_and_readmitted() -> None:
    r = make_router(prefill_policy="least_load")
    a = add(r, "http://p0", "prefill")
    b = add(r, "http://p1", "prefill")
    d = add(r, "http://d0", "decode")
    a.healthy = False
    assert all(r.pick_prefill([1]) is b for _ in range(3))
    b.healthy = False
    assert r.pick_prefill([1]) is None
    d.healthy = False
    assert r.pick_decode([1]) is None
    a.healthy = True
    d.healthy = True
    assert r.pick_prefill([1]) is a and r.pick_decode([1]) is d


def test_should_skip_prefill() -> None:
    r = make_router(skip_prefill_threshold=0)
    assert not r.should_skip_prefill(10)  # nothing at all
    d = add(r, "http://d0", "decode")
    assert r.should_skip_prefill(10_000)  # decode only: prefill locally
    p = add(r, "http://p0", "prefill")
    assert not r.should_skip_prefill(1)  # threshold 0 disables
    r2 = make_router(skip_prefill_threshold=256)
    add(r2, "http://p0", "prefill")
    add(r2, "http://d0", "decode")
    assert r2.should_skip_prefill(1) and r2.should_skip_prefill(256)
    assert not r2.should_skip_prefill(257)
    p.healthy = False
    assert r.should_skip_prefill(10_000)
    p.healthy = True
    # Only a colocated worker can decode: nobody takes KV from a prefill worker.
    d.healthy = False
    both = add(r, "http://c0", "both")
    assert r.should_skip_prefill(10_000)
    assert r.pick_decode([1], with_prefill=True) is None
    assert r.pick_decode([1]) is both
    d.healthy = True
    assert not r.should_skip_prefill(10_000)
    assert r.pick_decode([1], with_prefill=True) is d


# -- health checker ----------------------------------------------------------------


def server_info(url: str, role: str, started_at: float = 1.0, running: int = 0) -> dict[str, Any]:
    return {
        "role": role,
        "url": url,
        "model": "tiny",
        "request_endpoint": f"tcp://127.0.0.1:{5000 + running}",
        "bootstrap_endpoint": None if role == "both" else "tcp://127.0.0.1:6000",
        "page_size": 16,
        "context_length": 4096,
        "started_at": started_at,
        "stats": {"available_pages": 100 - running, "total_pages": 100, "running": running},
    }


class FakeWorker:
    """A plain http.server answering /health and /server_info like a worker."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.status = 200
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                if fake.status != 200:
                    body = json.dumps({"error": "engine unavailable"}).encode()
                    code = fake.status
                elif self.path == "/health":
                    body, code = b'{"status": "ok"}', 200
                elif self.path == "/server_info":
                    body, code = json.dumps(server_info(fake.url, fake.role)).encode(), 200
                else:
                    body, code = b"{}", 404
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.alive = True

    def kill(self) -> None:
        if self.alive:
            self.alive = False
            self.server.shutdown()
            self.server.server_close()
            self.thread.join(5)


@pytest.fixture
def fake_worker() -> Iterator[FakeWorker]:
    w = FakeWorker("prefill")
    try:
        yield w
    finally:
        w.kill()


def test_add_worker_takes_role_and_endpoints_from_server_info(fake_worker: FakeWorker) -> None:
    async def main() -> WorkerInfo:
        router = make_router()
        async with HealthChecker(router) as hc:
            w = await WorkerAdmin(router, hc.probe).add_worker(fake_worker.url + "/")
            assert router.prefill.get(fake_worker.url) is w
            return w

    w = asyncio.run(main())
    assert w.role == "prefill" and w.url == fake_worker.url
    assert w.request_endpoint == "tcp://127.0.0.1:5000"
    assert w.bootstrap_endpoint == "tcp://127.0.0.1:6000"
    assert (w.page_size, w.context_length) == (16, 4096)
    assert w.stats["total_pages"] == 100 and w.healthy


def test_add_worker_role_mismatch_and_unreachable(fake_worker: FakeWorker) -> None:
    async def main() -> None:
        router = make_router()
        hc = HealthChecker(router, RouterConfig(health_timeout_s=1.0))
        admin = WorkerAdmin(router, hc.probe)
        try:
            with pytest.raises(
                WorkerRoleMismatch, match="added as 'decode'.*reports role 'prefill'"
            ):
                await admin.add_worker(fake_worker.url, role="decode")
            assert router.workers() == []
            assert (await admin.add_worker(fake_worker.url, role="prefill")).role == "prefill"
            # A colocated worker joins the decode pool under role "decode" (--decode URL).
            router.remove(fake_worker.url)
            fake_worker.role = "both"
            w = await admin.add_worker(fake_worker.url, role="decode")
            assert w.role == "both" and router.get(fake_worker.url) in router.decode.list()
            with pytest.raises(WorkerRoleMismatch, match="added as 'prefill'"):
                await admin.add_worker(fake_worker.url, role="prefill")
            router.remove(fake_worker.url)
            fake_worker.role = "prefill"
            dead = f"http://127.0.0.1:{free_port()}"
            with pytest.raises(WorkerUnreachable, match=f"cannot reach worker {dead}"):
                await admin.add_worker(dead)
            fake_worker.status = 503
            router.remove(fake_worker.url)
            with pytest.raises(WorkerUnreachable, match="answered 503"):
                await admin.add_worker(fake_worker.url)
            assert router.workers() == []
            with pytest.raises(ValueError, match="unknown worker role"):
                await admin.add_worker(fake_worker.url, role="encode")
        finally:
            await hc.stop()

    asyncio.run(main())


def test_health_checker_marks_a_dead_worker_unhealthy_within_the_interval(
    fake_worker: FakeWorker,
) -> None:
    cfg = RouterConfig(health_interval_s=0.2, health_timeout_s=0.5, unhealthy_after=2)
    # Worst case: the death lands just after a check, then unhealthy_after
    # more checks (each at most one timeout) one interval apart.
    bound = cfg.unhealthy_after * (cfg.health_interval_s + cfg.health_timeout_s) + 0.5

    async def main() -> tuple[float, float]:
        router = Router(cfg)
        hc = HealthChecker(router)
        w = await WorkerAdmin(router, hc.probe).add_worker(fake_worker.url)
        await hc.start()
        try:
            await asyncio.sleep(0.5)
            assert w.healthy and w.consecutive_failures == 0
            assert router.pick_prefill([1, 2]) is w
            t0 = time.monotonic()
            await asyncio.to_thread(fake_worker.kill)
            while w.healthy and time.monotonic() - t0 < 10:
                await asyncio.sleep(0.02)
            took = time.monotonic() - t0
            assert not w.healthy and w.last_error
            assert w.consecutive_failures >= cfg.unhealthy_after
            assert router.pick_prefill([1, 2]) is None
            return took, bound
        finally:
            await hc.stop()

    took, bound = asyncio.run(main())
    assert took <= bound, f"marked unhealthy after {took:.2f}s, bound {bound:.2f}s"


def test_health_checker_readmits_and_refreshes_with_a_mock_transport() -> None:
    state = {"up": True, "started_at": 1.0, "running": 0, "role": "prefill"}

    def handler(request: httpx.Request) -> httpx.Response:
        if not state["up"]:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        url = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        return httpx.Response(
            200,
            json=server_info(url, state["role"], state["started_at"], state["running"]),
        )

    async def main() -> None:
        cfg = RouterConfig(prefill_policy="cache_aware", health_interval_s=60, unhealthy_after=3)
        router = Router(cfg)
        hc = HealthChecker(router, transport=httpx.MockTransport(handler))
        w = await WorkerAdmin(router, hc.probe).add_worker("http://w0:8000")
        ids = prompt(60, 64)
        assert router.pick_prefill(ids) is w
        policy = router.prefill_policy
        assert isinstance(policy, CacheAwarePolicy)
        assert policy.tree(w.url).match(ids) == 64

        state["up"] = False
        for i in range(1, 3):
            assert not await hc.check_worker(w)
            assert w.healthy and w.consecutive_failures == i  # below unhealthy_after
        await hc.check_all()
        assert not w.healthy and "ConnectError" in (w.last_error or "")
        assert router.pick_prefill(ids) is None

        state.update(up=True, running=3)
        await hc.check_all()
        assert w.healthy and w.consecutive_failures == 0
        assert w.stats["running"] == 3 and w.request_endpoint == "tcp://127.0.0.1:5003"
        assert router.pick_prefill(ids) is w
        assert policy.tree(w.url).match(ids) == 64  # same process: cache kept

        state["started_at"] = 2.0  # the worker restarted: its prefix cache is gone
        await hc.check_all()
        assert policy.tree(w.url).match(ids) == 0

        state["role"] = "decode"  # restarted under another role: not trusted
        for _ in range(3):
            await hc.check_all()
        assert not w.healthy and "reports role 'decode'" in (w.last_error or "")
        await hc.stop()

    asyncio.run(main())


def test_worker_admin_lists_and_drains() -> None:
    """Workers added through the admin are listed (draining ones too) until
    their last request ends; the admin shares the health checker's client."""

    def handler(request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        return httpx.Response(200, json=server_info(url, "decode"))

    async def main() -> None:
        router = make_router()
        hc = HealthChecker(router, transport=httpx.MockTransport(handler))
        admin = WorkerAdmin(router, hc.probe)
        try:
            w = await admin.add_worker("http://d0:9000", role="decode")
            await admin.add_worker("http://d1:9000")
            assert [x["url"] for x in admin.list_workers()] == ["http://d0:9000", "http://d1:9000"]
            router.begin(w, 10)
            assert await admin.remove_worker("http://d0:9000") is w
            listed = {x["url"]: x for x in admin.list_workers()}
            assert listed["http://d0:9000"]["draining"] is True
            assert listed["http://d0:9000"]["outstanding_requests"] == 1
            router.end(w, 10, ok=True)
            assert [x["url"] for x in admin.list_workers()] == ["http://d1:9000"]
            assert await admin.remove_worker("http://nope:1") is None
        finally:
            await hc.stop()

    asyncio.run(main())


def test_health_checker_start_stop_leaves_no_tasks() -> None:
    async def main() -> None:
        router = make_router()
        add(router, "http://w0", "decode")
        transport = httpx.MockTransport(lambda req: httpx.Response(503))
        hc = HealthChecker(router, RouterConfig(health_interval_s=0.01), transport=transport)
        await hc.start()
        await hc.start()  # idempotent
        assert hc.running
        await asyncio.sleep(0.1)
        assert router.decode.get("http://w0").consecutive_failures >= 2  # type: ignore[union-attr]
        await hc.stop()
        await hc.stop()
        assert not hc.running
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        assert others == []

    asyncio.run(main())


def test_router_module_does_not_import_torch() -> None:
    code = (
        "import sys, gateway.routing\n"
        "bad = [m for m in ('torch', 'transformers', 'engine.engine', 'worker') "
        "if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)
