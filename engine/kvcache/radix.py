"""Page-granular radix prefix cache over KV pages.

Every non-root node owns a run of whole pages: ``key`` holds ``len(pages) * page_size``
token ids and ``pages[i]`` stores the KV of ``key[i * page_size:(i + 1) * page_size]``.
The keys along a path from the root spell a cached prefix, and the concatenated pages
along that path are the prefix's page table. Partial pages are never cached.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from engine.kvcache.pool import PageAllocator
from protocol.kv_events import NO_PARENT, chain


class RadixNode:
    """A run of cached pages; ``children`` is keyed by each child's first page of ids."""

    __slots__ = ("key", "pages", "children", "parent", "ref", "last_access", "hashes")

    def __init__(
        self,
        key: tuple[int, ...] = (),
        pages: list[int] | None = None,
        parent: RadixNode | None = None,
        last_access: int = 0,
    ) -> None:
        self.key = key
        self.pages: list[int] = [] if pages is None else pages
        self.children: dict[tuple[int, ...], RadixNode] = {}
        # None for the root and for nodes that were evicted (or dropped by reset).
        self.parent = parent
        # Locks held on this node or any descendant, so ref(parent) >= ref(child):
        # an unlocked node's whole subtree is unlocked, hence evictable.
        self.ref = 0
        self.last_access = last_access
        # With KV events on: the chained block hash of each page (protocol.kv_events).
        self.hashes: list[int] = []

    def __repr__(self) -> str:
        return f"RadixNode(tokens={len(self.key)}, pages={self.pages}, ref={self.ref})"


class PrefixMatch(NamedTuple):
    pages: list[int]  # cached page ids covering the first num_tokens tokens
    num_tokens: int  # multiple of page_size
    node: RadixNode  # deepest matched node (root if nothing); pass to lock/unlock


class InsertResult(NamedTuple):
    pages: list[int]  # the tree's (canonical) page ids for the whole inserted key
    node: RadixNode  # node that ends exactly at the end of the key


class CacheStats(NamedTuple):
    query_tokens: int
    hit_tokens: int
    cached_pages: int
    evictable_pages: int
    locked_pages: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class RadixCache:
    """Prefix cache mapping page-aligned token prefixes to KV pages of ``allocator``.

    Pages handed to :meth:`insert` belong to the tree until evicted; the tree frees them
    back to the allocator on :meth:`evict` and :meth:`reset`.
    """

    def __init__(self, allocator: PageAllocator, page_size: int, events: bool = False) -> None:
        """``events``: record the chained hash of every page stored and removed
        (``protocol.kv_events``), for ``drain_events``."""
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.events = events
        self._stored: list[int] = []
        self._removed: list[int] = []
        self.root = RadixNode()
        self._clock = 0
        self._cached_pages = 0
        self._locked_pages = 0  # pages of nodes with ref > 0
        self._query_tokens = 0
        self._hit_tokens = 0

    # ------------------------------------------------------------------ lookup

    def match_prefix(
        self, token_ids: Sequence[int], max_tokens: int | None = None, record: bool = False
    ) -> PrefixMatch:
        """Longest cached page-aligned prefix of ``token_ids`` (at most ``max_tokens``).

        Marks the matched nodes as recently used. If the match ends inside a node, that
        node is split so ``result.node`` ends exactly at ``result.num_tokens``. With
        ``record`` the query counts towards :meth:`stats`.
        """
        limit = len(token_ids) if max_tokens is None else max(0, min(max_tokens, len(token_ids)))
        limit -= limit % self.page_size
        path = self._walk(tuple(map(int, token_ids[:limit])))
        pages = [p for node in path for p in node.pages]
        num_tokens = len(pages) * self.page_size
        if record:
            self._query_tokens += len(token_ids)
            self._hit_tokens += num_tokens
        return PrefixMatch(pages, num_tokens, path[-1] if path else self.root)

    def insert(self, token_ids: Sequence[int], pages: Sequence[int]) -> InsertResult:
        """Cache ``token_ids`` whose KV lives in ``pages`` (one page per ``page_size`` ids).

        Where the tree already holds the prefix it keeps its own pages, and each caller
        page that differs from the tree's page at that position is freed here. Pages of
        the new suffix are adopted by the tree. The caller must replace its page table
        with ``result.pages``.
        """
        ps = self.page_size
        if len(token_ids) != len(pages) * ps:
            raise ValueError(f"{len(token_ids)} tokens do not fill {len(pages)} pages of size {ps}")
        tokens = tuple(map(int, token_ids))
        path = self._walk(tokens)
        tree_pages = [p for node in path for p in node.pages]
        shared = len(tree_pages)
        duplicates = [p for p, t in zip(pages[:shared], tree_pages, strict=True) if p != t]
        node = path[-1] if path else self.root
        if shared < len(pages):
            leaf = RadixNode(tokens[shared * ps :], list(pages[shared:]), node, self._clock)
            node.children[leaf.key[:ps]] = leaf
            self._cached_pages += len(leaf.pages)
            if self.events:
                h = node.hashes[-1] if node.hashes else NO_PARENT
                for i in range(len(leaf.pages)):
                    h = chain(h, leaf.key[i * ps : (i + 1) * ps])
                    leaf.hashes.append(h)
                self._stored.extend(leaf.hashes)
            tree_pages.extend(leaf.pages)
            node = leaf
        if duplicates:
            self.allocator.free(duplicates)
        return InsertResult(tree_pages, node)

    def _walk(self, tokens: tuple[int, ...]) -> list[RadixNode]:
        """Nodes along the longest cached prefix of ``tokens`` (length a page multiple).

        Splits the last node if the match ends inside it and stamps the path as used.
        """
        ps = self.page_size
        self._clock += 1
        path: list[RadixNode] = []
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos : pos + ps])
            if child is None:
                break
            # The first page matched through the dict key; compare the rest page by page.
            limit = min(len(child.pages), (len(tokens) - pos) // ps)
            m = 1
            while (
                m < limit
                and child.key[m * ps : (m + 1) * ps] == tokens[pos + m * ps : pos + (m + 1) * ps]
            ):
                m += 1
            if m < len(child.pages):
                # After the split the next lookup misses (or tokens are exhausted).
                child = self._split(child, m)
            child.last_access = self._clock
            path.append(child)
            node, pos = child, pos + m * ps
        return path

    def _split(self, node: RadixNode, num_pages: int) -> RadixNode:
        """Cut ``node`` after ``num_pages`` pages; return the new upper part.

        ``node`` keeps the tail, so references to it (e.g. held locks) still end at the
        same token position. The upper part inherits the ref count: every lock that
        passed through ``node`` also passes through it.
        """
        ps = self.page_size
        cut = num_pages * ps
        assert node.parent is not None
        upper = RadixNode(node.key[:cut], node.pages[:num_pages], node.parent, node.last_access)
        upper.ref = node.ref
        # A page's hash depends on the tokens before it only: a split keeps them.
        upper.hashes, node.hashes = node.hashes[:num_pages], node.hashes[num_pages:]
        node.parent.children[node.key[:ps]] = upper
        node.key, node.pages, node.parent = node.key[cut:], node.pages[num_pages:], upper
        upper.children[node.key[:ps]] = node
        return upper

    # ----------------------------------------------------------------- locking

    def lock(self, node: RadixNode) -> None:
        """Pin ``node`` and its ancestors against eviction (the root is ignored)."""
        if node is not self.root and node.parent is None:
            raise ValueError("node is no longer in the cache")
        while node is not self.root:
            if node.ref == 0:
                self._locked_pages += len(node.pages)
            node.ref += 1
            node = node.parent
            assert node is not None

    def unlock(self, node: RadixNode) -> None:
        """Undo one :meth:`lock` of ``node``; raises RuntimeError if it is not locked."""
        if node is self.root:
            return
        if node.ref <= 0:
            raise RuntimeError(f"unlock of an unlocked node {node!r}")
        while node is not self.root:
            node.ref -= 1
            if node.ref == 0:
                self._locked_pages -= len(node.pages)
            node = node.parent
            assert node is not None

    # ---------------------------------------------------------------- eviction

    def evict(self, num_pages: int) -> int:
        """Free at least ``num_pages`` pages if possible, least recently used leaves first.

        Only unlocked leaves are removed, whole nodes at a time, so more pages than asked
        may be freed. Returns the number of pages returned to the allocator.
        """
        if num_pages <= 0:
            return 0
        order = itertools.count()  # tie-breaker so the heap never compares nodes
        heap = [
            (n.last_access, next(order), n) for n in self._nodes() if not n.children and not n.ref
        ]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_pages:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            del parent.children[node.key[: self.page_size]]
            node.parent = None
            self.allocator.free(node.pages)
            self._removed.extend(node.hashes)
            freed += len(node.pages)
            self._cached_pages -= len(node.pages)
            if parent is not self.root and not parent.children and not parent.ref:
                heapq.heappush(heap, (parent.last_access, next(order), parent))
        return freed

    def reset(self) -> None:
        """Free every cached page and clear the hit counters; RuntimeError if any lock."""
        if self._locked_pages:
            raise RuntimeError(f"cannot reset: {self._locked_pages} pages are locked")
        nodes = list(self._nodes())
        pages = [p for n in nodes for p in n.pages]
        for n in nodes:
            n.parent = None
            n.children = {}
        self.root.children = {}
        self.allocator.free(pages)
        for n in nodes:
            self._removed.extend(n.hashes)
        self._cached_pages = 0
        self._query_tokens = self._hit_tokens = 0

    def _nodes(self) -> Iterator[RadixNode]:
        """Every node but the root (iterative DFS)."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # -------------------------------------------------------------- KV events

    def drain_events(self) -> tuple[list[int], list[int]]:
        """Block hashes stored and removed since the last call (both empty
        unless ``events``). A reader adds ``stored``, then discards
        ``removed``; a hash both stored and removed in between is listed on
        the side that leaves it as the tree has it now."""
        stored, removed = self._stored, self._removed
        self._stored, self._removed = [], []
        if stored and removed:
            gone, back = set(removed), set(stored)
            # Net effect: present now iff it is in the tree.
            live = {h for n in self._nodes() for h in n.hashes} if (gone & back) else set()
            stored = [h for h in stored if h not in gone or h in live]
            removed = [h for h in removed if h not in back or h not in live]
        return stored, removed

    def block_hashes(self) -> list[int]:
        """Every cached page's chained hash (a snapshot; empty unless ``events``)."""
        return [h for n in self._nodes() for h in n.hashes]

    # ------------------------------------------------------------------- stats

    @property
    def cached_pages(self) -> int:
        """Pages owned by the tree."""
        return self._cached_pages

    @property
    def locked_pages(self) -> int:
        """Pages pinned by a lock on their node or a descendant."""
        return self._locked_pages

    @property
    def evictable_pages(self) -> int:
        """Pages that :meth:`evict` could free (every unlocked node's subtree is unlocked)."""
        return self._cached_pages - self._locked_pages

    def stats(self) -> CacheStats:
        """Snapshot of hit counters (from ``record=True`` matches) and page counts."""
        return CacheStats(
            self._query_tokens,
            self._hit_tokens,
            self._cached_pages,
            self.evictable_pages,
            self._locked_pages,
        )
