"""Tests for the page-granular radix prefix cache (engine/kvcache/radix.py)."""

from __future__ import annotations

import random

import pytest

from engine.kvcache.pool import PageAllocator
from engine.kvcache.radix import RadixCache, RadixNode


def make(page_size: int, num_pages: int = 64) -> tuple[PageAllocator, RadixCache]:
    alloc = PageAllocator(num_pages)
    return alloc, RadixCache(alloc, page_size)


def alloc_n(alloc: PageAllocator, n: int) -> list[int]:
    pages = alloc.alloc(n)
    assert pages is not None
    return pages


def insert_fresh(cache: RadixCache, tokens: list[int]) -> list[int]:
    """Insert ``tokens`` with freshly allocated pages; return the canonical pages."""
    pages = alloc_n(cache.allocator, len(tokens) // cache.page_size)
    return cache.insert(tokens, pages).pages


def node_prefix(node: RadixNode) -> tuple[int, ...]:
    """Token ids spelled by the path from the root to ``node``."""
    parts = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return tuple(t for key in reversed(parts) for t in key)


def tree_prefixes(cache: RadixCache) -> dict[tuple[int, ...], int]:
    """Every cached page-aligned prefix -> page id of its last page; checks structure."""
    ps = cache.page_size
    out: dict[tuple[int, ...], int] = {}
    stack: list[tuple[RadixNode, tuple[int, ...]]] = [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        for first, child in node.children.items():
            assert child.parent is node
            assert child.key[:ps] == first
            assert len(child.pages) >= 1 and len(child.key) == len(child.pages) * ps
            assert node is cache.root or node.ref >= child.ref
            for i, page in enumerate(child.pages):
                out[prefix + child.key[: (i + 1) * ps]] = page
            stack.append((child, prefix + child.key))
    return out


@pytest.mark.parametrize("ps", [1, 4])
def test_insert_then_match(ps: int) -> None:
    alloc, cache = make(ps)
    tokens = list(range(100, 100 + 3 * ps))
    pages = alloc_n(alloc, 3)
    res = cache.insert(tokens, pages)
    assert res.pages == pages
    assert node_prefix(res.node) == tuple(tokens)
    assert cache.cached_pages == 3

    m = cache.match_prefix(tokens)
    assert (m.pages, m.num_tokens, m.node) == (pages, 3 * ps, res.node)
    # Extra tokens beyond the cached ones (including a partial page) do not match.
    m = cache.match_prefix(tokens + [7] * (ps + ps // 2))
    assert (m.pages, m.num_tokens) == (pages, 3 * ps)
    m = cache.match_prefix([1, 2, 3, 4, 5])
    assert (m.pages, m.num_tokens, m.node) == ([], 0, cache.root)
    assert cache.match_prefix([]).num_tokens == 0


def test_match_rounds_down_to_page() -> None:
    alloc, cache = make(4)
    tokens = list(range(12))
    pages = insert_fresh(cache, tokens)
    # 6 tokens -> only one full page.
    m = cache.match_prefix(tokens[:6])
    assert (m.pages, m.num_tokens) == (pages[:1], 4)
    # Divergence in the middle of the second page -> only the first page.
    m = cache.match_prefix(tokens[:5] + [99, 99, 99, 99])
    assert (m.pages, m.num_tokens) == (pages[:1], 4)
    # Divergence in the first page -> nothing.
    assert cache.match_prefix([0, 1, 2, 99, 4, 5, 6, 7]).num_tokens == 0


@pytest.mark.parametrize("ps", [1, 4])
def test_match_splits_node(ps: int) -> None:
    alloc, cache = make(ps)
    tokens = list(range(4 * ps))
    pages = insert_fresh(cache, tokens)
    assert len(cache.root.children) == 1

    m = cache.match_prefix(tokens[: 2 * ps] + [-1] * ps)
    assert m.num_tokens == 2 * ps and m.pages == pages[:2]
    assert m.node.key == tuple(tokens[: 2 * ps]) and m.node.pages == pages[:2]
    (tail,) = m.node.children.values()
    assert tail.key == tuple(tokens[2 * ps :]) and tail.pages == pages[2:]
    assert tail.parent is m.node and m.node.parent is cache.root
    assert cache.cached_pages == 4
    # The full sequence still matches across the split.
    full = cache.match_prefix(tokens)
    assert full.pages == pages and full.node is tail


@pytest.mark.parametrize("ps", [1, 4])
def test_insert_divergent_branch(ps: int) -> None:
    alloc, cache = make(ps)
    a = list(range(4 * ps))
    b = a[: 2 * ps] + [-t - 1 for t in range(2 * ps)]
    pages_a = insert_fresh(cache, a)
    free_before = alloc.num_free
    pages_b = alloc_n(alloc, 4)
    res = cache.insert(b, pages_b)
    # Shared prefix uses a's pages; b's own first two pages were duplicates and freed.
    assert res.pages == pages_a[:2] + pages_b[2:]
    assert alloc.num_free == free_before - 2
    assert cache.cached_pages == 6
    (shared,) = cache.root.children.values()
    assert shared.pages == pages_a[:2] and len(shared.children) == 2
    assert cache.match_prefix(a).pages == pages_a
    assert cache.match_prefix(b).pages == res.pages
    assert node_prefix(res.node) == tuple(b)


def test_insert_returns_canonical_pages_and_frees_duplicates() -> None:
    alloc, cache = make(2)
    tokens = list(range(6))
    first = insert_fresh(cache, tokens)
    start = alloc.num_free

    # Same key, different pages: all three are duplicates.
    dup = alloc_n(alloc, 3)
    res = cache.insert(tokens, dup)
    assert res.pages == first
    assert alloc.num_free == start
    assert cache.cached_pages == 3

    # Typical request flow: matched pages + new pages for the suffix. Nothing is freed.
    m = cache.match_prefix(tokens + [50, 51, 52])
    own = alloc_n(alloc, 1)
    res = cache.insert(tokens + [50, 51], m.pages + own)
    assert res.pages == first + own
    assert alloc.num_free == start - 1
    assert cache.cached_pages == 4

    # Inserting a prefix of a cached key adds nothing and ends at a split node.
    dup = alloc_n(alloc, 2)
    res = cache.insert(tokens[:4], dup)
    assert res.pages == first[:2] and node_prefix(res.node) == tuple(tokens[:4])
    assert alloc.num_free == start - 1
    assert cache.cached_pages == 4


def test_insert_length_mismatch() -> None:
    _, cache = make(4)
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3, 4, 5], [1])
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], [1])
    with pytest.raises(ValueError):
        make(0)


def test_lock_prevents_eviction() -> None:
    alloc, cache = make(2)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    pages_a = insert_fresh(cache, a)
    insert_fresh(cache, b)
    m = cache.match_prefix(a)
    cache.lock(m.node)
    assert (cache.locked_pages, cache.evictable_pages) == (2, 2)

    assert cache.evict(100) == 2
    assert cache.match_prefix(b).num_tokens == 0
    assert cache.match_prefix(a).pages == pages_a
    assert cache.evict(100) == 0

    cache.unlock(m.node)
    assert cache.locked_pages == 0
    with pytest.raises(RuntimeError):
        cache.unlock(m.node)
    assert cache.evict(100) == 2
    assert cache.cached_pages == 0
    with pytest.raises(ValueError):
        cache.lock(m.node)  # evicted


def test_lock_covers_ancestors_and_survives_split() -> None:
    alloc, cache = make(1)
    insert_fresh(cache, [1, 2])
    res = cache.insert([1, 2, 3, 4], [*cache.match_prefix([1, 2]).pages, *alloc_n(alloc, 2)])
    cache.lock(res.node)
    assert cache.locked_pages == 4
    # Splitting the locked path (new branch after token 3) keeps everything locked.
    insert_fresh(cache, [1, 2, 3, 9])
    assert cache.locked_pages == 4 and cache.cached_pages == 5
    assert cache.evict(100) == 1
    assert cache.match_prefix([1, 2, 3, 4]).num_tokens == 4
    cache.lock(cache.root)  # ignored
    cache.unlock(cache.root)
    cache.unlock(res.node)
    assert cache.locked_pages == 0 and cache.evictable_pages == 4
    assert cache.evict(100) == 4


def test_eviction_is_lru() -> None:
    alloc, cache = make(2)
    x, y, z = [1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]
    for seq in (x, y, z):
        insert_fresh(cache, seq)
    cache.match_prefix(x)  # x is now the most recent; y is the oldest
    assert cache.evict(1) == 2  # whole node freed even though 1 page was asked
    assert cache.match_prefix(y).num_tokens == 0
    assert cache.evict(1) == 2
    assert cache.match_prefix(z).num_tokens == 0
    assert cache.match_prefix(x).num_tokens == 4
    # Evicting zero pages is a no-op.
    assert cache.evict(0) == 0 and cache.cached_pages == 2


def test_eviction_only_removes_leaves() -> None:
    alloc, cache = make(1)
    insert_fresh(cache, [1, 2, 3, 4])  # t1: one node
    insert_fresh(cache, [7])  # t2
    # Touch [1, 2] only: splits into upper (t3) and tail [3, 4] (still t1).
    upper = cache.match_prefix([1, 2]).node
    assert upper.key == (1, 2)

    assert cache.evict(1) == 2  # the tail [3, 4]: oldest leaf
    assert cache.match_prefix([1, 2, 3, 4]).num_tokens == 2
    assert cache.evict(1) == 1  # [7]: older than [1, 2], which only now became a leaf
    assert cache.match_prefix([7]).num_tokens == 0
    assert cache.evict(1) == 2
    assert alloc.num_free == alloc.capacity


def test_evict_cascades_to_parents_in_one_call() -> None:
    alloc, cache = make(1)
    start = alloc.num_free
    insert_fresh(cache, [1, 2, 3])
    insert_fresh(cache, [1, 2, 4])
    insert_fresh(cache, [1, 5])
    assert cache.cached_pages == 5
    assert cache.evict(5) == 5
    assert cache.cached_pages == 0 and alloc.num_free == start
    assert cache.root.children == {}


@pytest.mark.parametrize("ps", [1, 4])
def test_no_leak_after_evicting_everything(ps: int) -> None:
    alloc, cache = make(ps, num_pages=128)
    start = alloc.num_free
    rng = random.Random(0)
    base = [rng.randrange(3) for _ in range(16 * ps)]
    for i in range(20):
        cut = rng.randrange(0, 8) * ps
        tail = [rng.randrange(3) for _ in range(rng.randrange(1, 8) * ps)]
        insert_fresh(cache, base[:cut] + tail)
        if i % 5 == 0:
            cache.match_prefix(base[: rng.randrange(16 * ps)])
    cached = cache.cached_pages
    assert cached > 0 and alloc.num_free == start - cached
    assert cache.evict(10**9) == cached
    assert cache.cached_pages == 0 and alloc.num_free == start


@pytest.mark.parametrize("ps", [1, 4])
def test_max_tokens(ps: int) -> None:
    alloc, cache = make(ps)
    tokens = list(range(3 * ps))
    pages = insert_fresh(cache, tokens)
    m = cache.match_prefix(tokens, max_tokens=2 * ps + ps // 2)
    assert (m.pages, m.num_tokens) == (pages[:2], 2 * ps)
    assert node_prefix(m.node) == tuple(tokens[: 2 * ps])
    assert cache.match_prefix(tokens, max_tokens=0) == ([], 0, cache.root)
    assert cache.match_prefix(tokens, max_tokens=-5).num_tokens == 0
    assert cache.match_prefix(tokens, max_tokens=100 * ps).pages == pages
    assert cache.match_prefix(tokens, max_tokens=ps - 1).num_tokens == 0


def test_stats() -> None:
    alloc, cache = make(2)
    s = cache.stats()
    assert s == (0, 0, 0, 0, 0) and s.hit_rate == 0.0
    insert_fresh(cache, [1, 2, 3, 4])
    cache.match_prefix([1, 2, 3, 4, 5, 6], record=True)  # 4 of 6
    cache.match_prefix([9, 9], record=True)  # 0 of 2
    cache.match_prefix([1, 2], record=False)  # not counted
    cache.match_prefix([1, 2, 3, 4], max_tokens=2, record=True)  # 2 of 4
    m = cache.match_prefix([1, 2])
    cache.lock(m.node)
    s = cache.stats()
    assert (s.query_tokens, s.hit_tokens) == (12, 6)
    assert s.hit_rate == pytest.approx(0.5)
    assert (s.cached_pages, s.evictable_pages, s.locked_pages) == (2, 1, 1)
    cache.unlock(m.node)
    assert cache.stats().locked_pages == 0


def test_reset() -> None:
    alloc, cache = make(2)
    start = alloc.num_free
    insert_fresh(cache, [1, 2, 3, 4])
    insert_fresh(cache, [1, 2, 5, 6])
    cache.match_prefix([1, 2], record=True)
    node = cache.match_prefix([1, 2, 3, 4]).node
    cache.lock(node)
    with pytest.raises(RuntimeError):
        cache.reset()
    assert cache.cached_pages == 3  # nothing was freed by the failed reset
    cache.unlock(node)
    cache.reset()
    assert alloc.num_free == start
    assert cache.cached_pages == 0 and cache.root.children == {}
    assert cache.stats() == (0, 0, 0, 0, 0)
    assert cache.match_prefix([1, 2, 3, 4]).num_tokens == 0
    with pytest.raises(ValueError):
        cache.lock(node)
    # The cache is usable again afterwards.
    pages = insert_fresh(cache, [1, 2, 3, 4])
    assert cache.match_prefix([1, 2, 3, 4]).pages == pages


@pytest.mark.parametrize("ps", [1, 2, 4])
@pytest.mark.parametrize("seed", range(6))
def test_random_against_reference(ps: int, seed: int) -> None:
    """Random requests/inserts/matches/evictions checked against a brute-force model.

    The model is ``ref``: every cached page-aligned prefix -> the page holding its last
    page. It is updated independently of the tree on insert; after an eviction it is
    re-read from the tree and checked to be a subset of what was there before.
    """
    rng = random.Random(seed * 100 + ps)
    alloc, cache = make(ps, num_pages=80)
    ref: dict[tuple[int, ...], int] = {}
    # Running requests: (tokens, pages of the matched prefix, own pages, locked node).
    running: list[tuple[list[int], list[int], list[int], RadixNode]] = []
    bases = [[rng.randrange(3) for _ in range(12 * ps)] for _ in range(3)]

    def rand_seq(aligned: bool) -> list[int]:
        base = rng.choice(bases)
        seq = base[: rng.randrange(len(base) + 1)] + [
            rng.randrange(3) for _ in range(rng.randrange(4 * ps))
        ]
        return seq[: len(seq) - len(seq) % ps] if aligned else seq

    def expected_len(tokens: list[int], limit: int) -> int:
        n = 0
        while n + ps <= limit and tuple(tokens[: n + ps]) in ref:
            n += ps
        return n

    def held() -> int:
        return sum(len(own) for _, _, own, _ in running)

    def locked_prefixes() -> set[tuple[int, ...]]:
        return {
            tuple(tokens[: (i + 1) * ps])
            for tokens, matched, _, _ in running
            for i in range(len(matched))
        }

    def evict_and_sync(n: int) -> int:
        before, free_before, evictable = dict(ref), alloc.num_free, cache.evictable_pages
        freed = cache.evict(n)
        after = tree_prefixes(cache)
        assert all(before.get(k) == v for k, v in after.items())
        removed = before.keys() - after.keys()
        assert freed == len(removed) == alloc.num_free - free_before
        assert (freed >= min(n, evictable)) if n > 0 else (freed == 0)
        assert not removed & locked_prefixes()
        ref.clear()
        ref.update(after)
        return freed

    def alloc_or_evict(n: int) -> list[int] | None:
        if alloc.num_free < n:
            evict_and_sync(n - alloc.num_free)
        return alloc.alloc(n)

    def insert_and_check(tokens: list[int], pages: list[int]) -> list[int]:
        keys = [tuple(tokens[: (i + 1) * ps]) for i in range(len(pages))]
        expected = [ref.get(k, p) for k, p in zip(keys, pages, strict=True)]
        dupes = sum(p != e for p, e in zip(pages, expected, strict=True))
        free_before = alloc.num_free
        res = cache.insert(tokens, pages)
        assert res.pages == expected
        assert alloc.num_free == free_before + dupes
        assert node_prefix(res.node) == tuple(tokens)
        ref.update(zip(keys, expected, strict=True))
        return res.pages

    for _ in range(250):
        op = rng.random()
        if op < 0.3:  # match
            q = rand_seq(aligned=False)
            max_tokens = rng.choice([None, rng.randrange(-1, len(q) + 3)])
            limit = len(q) if max_tokens is None else max(0, min(max_tokens, len(q)))
            m = cache.match_prefix(q, max_tokens, record=rng.random() < 0.5)
            n = expected_len(q, limit)
            assert m.num_tokens == n
            assert m.pages == [ref[tuple(q[: (i + 1) * ps])] for i in range(n // ps)]
            assert node_prefix(m.node) == tuple(q[:n])
        elif op < 0.5:  # a request starts: lock the matched prefix, allocate the rest
            q = rand_seq(aligned=True)
            m = cache.match_prefix(q)
            cache.lock(m.node)
            own = alloc_or_evict(len(q) // ps - len(m.pages))
            if own is None:
                cache.unlock(m.node)
            else:
                running.append((q, m.pages, own, m.node))
        elif op < 0.7 and running:  # a request finishes: insert its pages, drop the lock
            q, matched, own, node = running.pop(rng.randrange(len(running)))
            pages = insert_and_check(q, matched + own)
            assert pages[: len(matched)] == matched
            cache.unlock(node)
        elif op < 0.85:  # insert with entirely fresh pages (duplicates get freed)
            q = rand_seq(aligned=True)
            pages = alloc_or_evict(len(q) // ps)
            if pages is not None:
                insert_and_check(q, pages)
        else:
            evict_and_sync(rng.randrange(0, 12))

        assert tree_prefixes(cache) == ref
        assert cache.cached_pages == len(ref)
        assert alloc.num_free + cache.cached_pages + held() == alloc.capacity
        assert cache.locked_pages == len(locked_prefixes())
        assert cache.evictable_pages == cache.cached_pages - cache.locked_pages

    for _, _, own, node in running:
        cache.unlock(node)
        alloc.free(own)
    running.clear()
    assert cache.locked_pages == 0
    evict_and_sync(10**9)
    assert cache.cached_pages == 0 and alloc.num_free == alloc.capacity
