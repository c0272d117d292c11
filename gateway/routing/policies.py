"""Routing policies: how one worker is picked from a pool's available workers,
and the registries of policy names per pool (which also feed the command
line's choices)."""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, ClassVar

from gateway.routing.prefix_tree import ApproxPrefixTree, block_keys
from gateway.routing.workers import WorkerInfo

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


class CacheAwarePolicy(Policy):
    """The cached prefix counts as work saved, the load as work to wait for.

    Per worker an ``ApproxPrefixTree`` of the prompts routed to it. The pick is
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
            ratios = [(self.tree(w.url).match(keys=keys) / total, w) for w in workers]
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

    def forget(self, url: str) -> None:
        self.trees.pop(url, None)

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
