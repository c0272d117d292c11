"""KV events (``protocol.kv_events``): the radix cache's block hashes against
the one definition, the worker's batches, gap repair and snapshots, the
request-plane client's ordering, and cache-aware routing on the blocks a
worker really holds."""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

from engine.kvcache.pool import PageAllocator
from engine.kvcache.radix import RadixCache
from gateway.routing.config import RouterConfig
from gateway.routing.policies import CacheAwarePolicy
from gateway.routing.workers import WorkerInfo
from protocol.client import WorkerClient
from protocol.kv_events import SNAPSHOT_PLEASE, KvEvents, block_hashes
from protocol.to_worker import Heartbeat
from worker.kv_publisher import RING_BATCHES, KvPublisher

PAGE = 4


def _cache(pages: int = 64) -> RadixCache:
    return RadixCache(PageAllocator(pages), PAGE, events=True)


def _insert(cache: RadixCache, tokens: list[int]) -> list[int]:
    n = len(tokens) // PAGE
    pages = cache.allocator.alloc(n)
    return cache.insert(tokens[: n * PAGE], pages).pages


def _held(cache: RadixCache) -> set[int]:
    return set(cache.block_hashes())


def test_radix_hashes_follow_the_shared_definition_through_splits_and_evictions() -> None:
    cache = _cache()
    a = list(range(1, 17))  # 4 pages
    b = a[:8] + [99, 98, 97, 96]  # shares 2 pages, then splits a's node
    _insert(cache, a)
    stored, removed = cache.drain_events()
    assert stored == block_hashes(a, PAGE) and removed == []
    _insert(cache, b)
    stored, removed = cache.drain_events()
    assert stored == block_hashes(b, PAGE)[2:], "only the new page is stored"
    assert _held(cache) == set(block_hashes(a, PAGE)) | set(block_hashes(b, PAGE))
    # Evict everything: the removed hashes are exactly what was held.
    held = _held(cache)
    cache.evict(100)
    stored, removed = cache.drain_events()
    assert stored == [] and set(removed) == held
    assert cache.block_hashes() == []


def test_drained_events_are_net_of_what_happened_in_between() -> None:
    cache = _cache(8)
    a = list(range(1, 9))
    _insert(cache, a)
    cache.evict(100)  # stored then removed before any drain: removed only
    stored, removed = cache.drain_events()
    assert stored == [] and set(removed) == set(block_hashes(a, PAGE))
    _insert(cache, a)
    cache.drain_events()
    cache.evict(100)
    _insert(cache, a)  # removed then stored again: stored only
    stored, removed = cache.drain_events()
    seen: set[int] = set(block_hashes(a, PAGE))  # the reader's view before
    seen |= set(stored)
    seen -= set(removed)
    assert seen == _held(cache)


def test_events_off_costs_nothing_and_records_nothing() -> None:
    cache = RadixCache(PageAllocator(16), PAGE)
    _insert(cache, list(range(1, 9)))
    assert cache.drain_events() == ([], []) and cache.block_hashes() == []


class Sent:
    def __init__(self) -> None:
        self.batches: list[tuple[bytes, KvEvents]] = []

    def __call__(self, client: bytes, batch: KvEvents) -> None:
        self.batches.append((client, batch))

    def take(self) -> list[KvEvents]:
        out = [b for _, b in self.batches]
        self.batches.clear()
        return out


def test_publisher_snapshot_batches_and_gap_repair() -> None:
    cache = _cache(256)
    sent = Sent()
    pub = KvPublisher(cache, sent)
    _insert(cache, list(range(1, 9)))  # before anyone subscribed
    pub.on_heartbeat(b"gw", "", SNAPSHOT_PLEASE)
    (snap,) = sent.take()
    assert snap.snapshot and set(snap.stored) == _held(cache) and snap.seq == pub.seq
    _insert(cache, list(range(20, 28)))
    pub.publish()
    (batch,) = sent.take()
    assert not batch.snapshot and batch.seq == snap.seq + 1
    assert batch.stored == block_hashes(list(range(20, 28)), PAGE)
    pub.publish()  # nothing new: no batch
    assert sent.take() == []
    # A subscriber that missed one batch gets it again, not a snapshot.
    pub.on_heartbeat(b"gw", pub.epoch, batch.seq - 1)
    assert [b.seq for b in sent.take()] == [batch.seq]
    # Up to date: nothing. Another epoch (it saw an older worker): a snapshot.
    pub.on_heartbeat(b"gw", pub.epoch, pub.seq)
    assert sent.take() == []
    pub.on_heartbeat(b"gw", "old-epoch", 3)
    (again,) = sent.take()
    assert again.snapshot and set(again.stored) == _held(cache)
    # Too far behind for the ring: a snapshot.
    for i in range(RING_BATCHES + 2):
        _insert(cache, [1000 + 10 * i + j for j in range(PAGE)])
        pub.publish()
    sent.take()
    pub.on_heartbeat(b"gw", pub.epoch, 1)
    (late,) = sent.take()
    assert late.snapshot
    pub.forget(b"gw")
    _insert(cache, list(range(500, 504)))
    pub.publish()
    assert sent.take() == [], "a forgotten subscriber gets nothing"


def test_client_applies_in_order_and_asks_for_a_snapshot_on_a_gap() -> None:
    seen: list[KvEvents | None] = []
    client = WorkerClient("tcp://127.0.0.1:1", on_kv_events=seen.append)
    posted: list[Any] = []
    client._post = posted.append  # type: ignore[method-assign]
    assert client._heartbeat_msg() == Heartbeat("", SNAPSHOT_PLEASE)
    client._on_kv(KvEvents("e1", 5, PAGE, [1, 2], [], True))
    client._on_kv(KvEvents("e1", 6, PAGE, [3], [1]))
    client._on_kv(KvEvents("e1", 6, PAGE, [3], [1]))  # a resend: ignored
    assert [b.seq for b in seen if b] == [5, 6]
    assert client._heartbeat_msg() == Heartbeat("e1", 6)
    client._on_kv(KvEvents("e1", 8, PAGE, [9], []))  # 7 is missing
    assert seen[-1] is None, "the view is reported lost"
    assert posted and posted[-1] == Heartbeat("e1", SNAPSHOT_PLEASE)
    client._on_kv(KvEvents("e1", 9, PAGE, [10], []))  # still waiting: dropped
    assert seen[-1] is None
    client._on_kv(KvEvents("e1", 9, PAGE, [1, 3, 9, 10], [], True))
    assert seen[-1] is not None and seen[-1].snapshot
    client._on_kv(KvEvents("e2", 1, PAGE, [], []))  # the worker restarted
    assert seen[-1] is None


def _worker(url: str, outstanding: int = 0) -> WorkerInfo:
    w = WorkerInfo(url=url, role="prefill")
    w.outstanding_tokens = outstanding
    return w


def test_cache_aware_routes_by_the_blocks_a_worker_holds() -> None:
    """A gateway that never routed a prefix still sends it to the worker
    whose events say it holds it; a lost view falls back to the gateway's
    own tree; forgetting a worker drops both."""
    cfg = RouterConfig(kv_event_pending_s=0.0, cache_min_match_ratio=0.5)
    policy = CacheAwarePolicy(cfg, random.Random(0))
    a, b = _worker("http://a"), _worker("http://b")
    prompt = list(range(3, 67))  # 64 tokens
    policy.kv_events("http://b", KvEvents("e", 1, PAGE, block_hashes(prompt, PAGE), [], True))
    assert policy.pick([a, b], prompt + [7, 8]).url == "http://b"
    assert policy.last_decision == "cache"
    # b evicts it: now nobody has it; the least loaded (a, on the tie) gets it.
    policy.kv_events("http://b", KvEvents("e", 2, PAGE, [], block_hashes(prompt, PAGE)))
    a.outstanding_tokens, b.outstanding_tokens = 0, 10
    assert policy.pick([a, b], prompt).url == "http://a"
    # b's view is lost: its routed-prompt tree speaks for it again.
    policy.kv_events("http://b", None)
    policy.tree("http://b").insert(prompt)
    a.outstanding_tokens = b.outstanding_tokens = 0
    assert policy.pick([b, a], prompt).url == "http://b"
    policy.forget("http://b")
    assert "http://b" not in policy.blocks and "http://b" not in policy.trees


def test_recently_routed_prompts_count_until_the_events_catch_up() -> None:
    cfg = RouterConfig(kv_event_pending_s=60.0)
    policy = CacheAwarePolicy(cfg, random.Random(0))
    a, b = _worker("http://a"), _worker("http://b")
    for url in ("http://a", "http://b"):
        policy.kv_events(url, KvEvents("e", 1, PAGE, [], [], True))
    prompt = list(range(100, 164))
    first = policy.pick([a, b], prompt)
    # The second request of the group comes before the first's prefill
    # reached the cache: it still goes to the same worker.
    assert policy.pick([a, b], prompt + [1, 2, 3, 4]).url == first.url
    policy.config = RouterConfig(kv_event_pending_s=0.0)
    time.sleep(0.01)
    # Without the pending window and with no events yet, nothing is cached.
    assert policy.matched(first.url, prompt, [], {}) == 0


@pytest.mark.parametrize("n", [0, 3, 4, 9])
def test_block_hashes_cover_whole_blocks_only(n: int) -> None:
    tokens = list(range(n))
    assert len(block_hashes(tokens, PAGE)) == n // PAGE
