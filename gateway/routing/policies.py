"""Routing policies: how one worker is picked from a pool's available workers,
and the registries of policy names per pool (which also feed the command
line's choices)."""

from __future__ import annotations

import random
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from gateway.routing.prefix_tree import ApproxPrefixTree, block_keys
from gateway.routing.workers import WorkerInfo
from protocol.kv_events import KvEvents, block_hashes

if TYPE_CHECKING:
    from gateway.routing.config import RouterConfig


class Policy(ABC):
    """Picks one of the candidate workers (all available: healthy, not
    draining, breaker allowing). Subclasses set ``name`` and implement ``pick``."""

    name: ClassVar[str] = ""

    def __init__(self, config: RouterConfig, rng: random.Random) -> None:
        self.config = config
        self.rng = rng

    @abstractmethod
    def pick(self, workers: Sequence[WorkerInfo], token_ids: Sequence[int]) -> WorkerInfo | None:
        """One of ``workers`` for the prompt ``token_ids`` (None when there is none)."""

    def forget(self, url: str) -> None:  # noqa: B027 (a stateless policy keeps nothing)
        """The worker at ``url`` left the pool (or restarted): drop its state."""

    def routed(self, worker: WorkerInfo, token_ids: Sequence[int]) -> None:  # noqa: B027
        """``worker`` was given the prompt by someone else (a breaker's trial)."""

    def kv_events(self, url: str, batch: KvEvents | None) -> None:  # noqa: B027
        """A batch of the KV events of the worker at ``url`` (None: its view
        was lost until a snapshot comes); see ``protocol.kv_events``."""

    def describe(self, url: str) -> dict[str, Any]:
        """What this policy keeps about the worker at ``url`` (for the admin API)."""
        return {}


def least_loaded(workers: Iterable[WorkerInfo]) -> WorkerInfo | None:
    """Fewest outstanding tokens, then fewest outstanding requests, then first."""
    return min(workers, key=lambda w: w.load, default=None)


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self, config: RouterConfig, rng: random.Random) -> None:
        super().__init__(config, rng)
        self._last: str | None = None

    def pick(self, workers: Sequence[WorkerInfo], token_ids: Sequence[int]) -> WorkerInfo | None:
        if not workers:
            return None
        # The first candidate after the last one picked, in URL order, so the
        # rotation survives candidates leaving, failing and coming back.
        ordered = sorted(workers, key=lambda w: w.url)
        chosen = ordered[0]
        if self._last is not None:
            for w in ordered:
                if w.url > self._last:
                    chosen = w
                    break
        self._last = chosen.url
        return chosen


class LeastLoadPolicy(Policy):
    name = "least_load"

    def pick(self, workers: Sequence[WorkerInfo], token_ids: Sequence[int]) -> WorkerInfo | None:
        return least_loaded(workers)


class PowerOfTwoPolicy(Policy):
    """Two distinct workers at random; the less loaded one (the first drawn on a tie)."""

    name = "power_of_two"

    def pick(self, workers: Sequence[WorkerInfo], token_ids: Sequence[int]) -> WorkerInfo | None:
        if len(workers) <= 1:
            return workers[0] if workers else None
        a, b = self.rng.sample(list(workers), 2)
        return b if b.load < a.load else a


class CachedBlocks:
    """The blocks one worker's prefix cache holds, kept from its KV events."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.epoch = ""
        self.seq = 0
        self.hashes: set[int] = set()
        self.valid = True
        """False from a lost view (a gap) until the snapshot that repairs it."""

    def apply(self, batch: KvEvents) -> None:
        if batch.snapshot:
            self.hashes = set(batch.stored)
            self.block_tokens = batch.block_tokens
        else:
            self.hashes.update(batch.stored)
            self.hashes.difference_update(batch.removed)
        self.epoch, self.seq = batch.epoch, batch.seq
        self.valid = True

    def match(self, hashes: Sequence[int]) -> int:
        """Tokens of the longest prefix (of a prompt's ``block_hashes``) held."""
        n = 0
        for h in hashes:
            if h not in self.hashes:
                break
            n += 1
        return n * self.block_tokens


class CacheAwarePolicy(Policy):
    """The cached prefix counts as work saved, the load as work to wait for.

    A worker's cached prefix is read from its KV events where it publishes
    them (``CachedBlocks``: the blocks its cache really holds, whatever other
    gateways routed there, evictions and restarts included), together with
    the prompts this gateway routed to it in the last ``kv_event_pending_s``
    (their prefill may not have reached its cache yet). For a worker that
    publishes none, or whose event view is being repaired, the prefix is read
    from an ``ApproxPrefixTree`` of the prompts routed to it. The pick is
    the worker where the prompt would finish first: least outstanding tokens
    plus the part of the prompt it has not cached (then fewest outstanding
    requests). An idle worker with nothing cached thus takes a prompt from a
    worker that has it cached once that worker's queue is longer than what the
    cache saves, so a restarted or newly added worker gets its share while
    prompts that share a prefix still stick to one worker under light load.
    If the most and least loaded candidates differ by more than
    ``balance_abs_threshold`` outstanding tokens and by more than
    ``balance_rel_threshold`` times, or the best match covers less than
    ``cache_min_match_ratio`` of the prompt, the least loaded worker is picked.
    Either way the prompt is recorded in the picked worker's tree.
    """

    name = "cache_aware"

    def __init__(self, config: RouterConfig, rng: random.Random) -> None:
        super().__init__(config, rng)
        self.max_blocks = max(1, config.cache_max_tokens // config.cache_block_tokens)
        self.trees: dict[str, ApproxPrefixTree] = {}
        self.blocks: dict[str, CachedBlocks] = {}
        """Workers that publish KV events: what their caches hold."""
        self.last_decision: str = ""
        """"cache", "imbalance" or "low_match": why the last pick was made (for
        logs and tests)."""

    def tree(self, url: str) -> ApproxPrefixTree:
        tree = self.trees.get(url)
        if tree is None:
            tree = self.trees[url] = ApproxPrefixTree(
                self.config.cache_block_tokens, self.max_blocks
            )
        return tree

    def imbalanced(self, workers: Sequence[WorkerInfo]) -> bool:
        loads = [w.outstanding_tokens for w in workers]
        lo, hi = min(loads), max(loads)
        return (
            hi - lo > self.config.balance_abs_threshold
            and hi > self.config.balance_rel_threshold * lo
        )

    def pick(self, workers: Sequence[WorkerInfo], token_ids: Sequence[int]) -> WorkerInfo | None:
        if not workers:
            return None
        keys = block_keys(token_ids, self.config.cache_block_tokens)
        if self.imbalanced(workers):
            chosen = least_loaded(workers)
            self.last_decision = "imbalance"
        else:
            total = max(1, len(token_ids))
            hashes: dict[int, list[int]] = {}
            ratios = [(self.matched(w.url, token_ids, keys, hashes) / total, w) for w in workers]
            best = max(r for r, _ in ratios)
            if not token_ids or best < self.config.cache_min_match_ratio:
                chosen = least_loaded(workers)
                self.last_decision = "low_match"
            else:
                # Work until this prompt is done there: the queue plus the
                # part of the prompt that is not cached.
                _, chosen = min(
                    ratios,
                    key=lambda rw: (
                        rw[1].outstanding_tokens + total * (1.0 - rw[0]),
                        rw[1].outstanding_requests,
                    ),
                )
                self.last_decision = "cache"
        assert chosen is not None
        self.tree(chosen.url).insert(keys=keys)
        return chosen

    def matched(
        self,
        url: str,
        token_ids: Sequence[int],
        keys: list[tuple[int, int]],
        hashes: dict[int, list[int]],
    ) -> int:
        """Tokens of the prompt cached at the worker at ``url``. ``hashes``:
        the prompt's block hashes per block size, filled as needed."""
        tree = self.tree(url)
        blocks = self.blocks.get(url)
        if blocks is None or not blocks.valid or not self.config.kv_events:
            return tree.match(keys=keys)
        bt = blocks.block_tokens
        if bt not in hashes:
            hashes[bt] = block_hashes(token_ids, bt)
        since = time.monotonic() - self.config.kv_event_pending_s
        return max(blocks.match(hashes[bt]), tree.match(keys=keys, routed_since=since))

    def kv_events(self, url: str, batch: KvEvents | None) -> None:
        blocks = self.blocks.get(url)
        if batch is None:
            if blocks is not None:
                blocks.valid = False
            return
        if blocks is None:
            if not batch.snapshot:
                return  # the snapshot asked for on subscribing comes first
            blocks = self.blocks[url] = CachedBlocks(batch.block_tokens)
        blocks.apply(batch)

    def forget(self, url: str) -> None:
        self.trees.pop(url, None)
        self.blocks.pop(url, None)

    def describe(self, url: str) -> dict[str, Any]:
        blocks = self.blocks.get(url)
        tree = self.trees.get(url)
        view: dict[str, Any] = {"routed_blocks": len(tree) if tree is not None else 0}
        if blocks is not None and self.config.kv_events:
            view.update(
                source="kv_events" if blocks.valid else "routed_prompts (KV events resyncing)",
                cached_blocks=len(blocks.hashes),
                block_tokens=blocks.block_tokens,
                epoch=blocks.epoch,
                seq=blocks.seq,
            )
        else:
            view["source"] = "routed_prompts"
        return view

    def routed(self, worker: WorkerInfo, token_ids: Sequence[int]) -> None:
        self.tree(worker.url).insert(keys=block_keys(token_ids, self.config.cache_block_tokens))


PREFILL_POLICIES: dict[str, type[Policy]] = {
    RoundRobinPolicy.name: RoundRobinPolicy,
    LeastLoadPolicy.name: LeastLoadPolicy,
    CacheAwarePolicy.name: CacheAwarePolicy,
}
"""Prefill policy name -> class; ``choices=list(PREFILL_POLICIES)`` in argparse."""
DECODE_POLICIES: dict[str, type[Policy]] = {
    LeastLoadPolicy.name: LeastLoadPolicy,
    PowerOfTwoPolicy.name: PowerOfTwoPolicy,
}
"""Decode policy name -> class; ``choices=list(DECODE_POLICIES)`` in argparse."""
