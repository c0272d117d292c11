"""Continuous-batching scheduler with chunked prefill under a token budget.

Every request is handled the same way: it has ``fill_ids`` (prompt, then its
output) of which ``num_computed`` already have KV in the pool. A step runs the
next ``n`` of them; when that reaches the end of ``fill_ids`` the request gets
logits and a new token. Decode is simply ``n == 1``; a retracted request comes
back with its output in ``fill_ids`` and is recomputed by the same path.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from engine.config import EngineConfig
from engine.forward_batch import ExtendSpec, ForwardBatch, build_forward_batch
from engine.kvcache.pool import KVPool
from engine.kvcache.radix import RadixCache
from engine.logit_adjust import TokenCounts
from engine.model_config import ModelConfig
from engine.prompt_logprobs import PromptScoring, chunk_limit, logits_mode
from engine.request import Request, StepOutput
from engine.runner import ForwardOutput
from engine.sampling import SamplingBatch
from protocol.finish import FinishReason


class ScheduledBatch(NamedTuple):
    requests: list[Request]
    extend_lens: list[int]
    forward: ForwardBatch
    sample_requests: list[Request]
    """Requests that get a token this step, in logits order."""
    sampling: SamplingBatch | None
    future_rows: list[int]
    """Rows of ``forward.input_ids`` whose token is still being sampled by the
    in-flight batch; ``future_src`` gives its index in that batch's output."""
    future_src: list[int]
    top_logprobs: int
    """Largest ``top_logprobs`` asked for by a sampled request (0: none)."""
    scoring: PromptScoring | None = None
    """Rows that score prompt tokens, when a request asked for prompt logprobs."""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    share_chunks = True
    """Insert each computed prefill chunk into the prefix cache right away."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, pool: KVPool) -> None:
        self.config = config
        self.model_config = model_config
        self.pool = pool
        self.page_size = pool.page_size
        self.allocator = pool.allocator
        self.cache = (
            RadixCache(self.allocator, self.page_size) if config.enable_prefix_cache else None
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        """Admitted requests (they hold pages), oldest first."""
        self.num_retracted = 0
        self._retracted_now: set[int] = set()
        """Requests retracted during the schedule being built (skipped by it)."""
        self.starved = False
        """The last overlapped ``schedule`` left a request without pages."""
        self.token_counts = TokenCounts(model_config.vocab_size, pool.kv.device)
        """Device counts of the tokens of penalized requests (``engine.logit_adjust``)."""

    # -- bookkeeping -------------------------------------------------------

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit_prefilled(self, req: Request) -> None:
        """``req`` joins the running batch without being prefilled here: its
        pages (from ``reserve_prompt``) hold the whole prompt's KV, written by
        another engine, and its first token is already in ``fill_ids``."""
        assert req.num_computed == len(req.fill_ids) - 1, "the prompt's KV must be complete"
        self.running.append(req)

    def detach(self, req: Request) -> bool:
        """Take ``req`` out of the waiting queue or the running batch without
        finishing it: it keeps its pages (someone may still read them) until
        ``release``. False if the scheduler did not hold it."""
        if req in self.waiting:
            self.waiting.remove(req)
        elif req in self.running:
            self.running.remove(req)
        else:
            return False
        return True

    def abort(self, rid: str) -> Request | None:
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                return req
        for req in self.running:
            if req.rid == rid:
                self.running.remove(req)
                self._release(req)
                req.finish_reason = FinishReason.ABORT
                return req
        return None

    @property
    def num_free_pages(self) -> int:
        """Free pages, counting those only held by the prefix cache as free."""
        cached = self.cache.evictable_pages if self.cache is not None else 0
        return self.allocator.num_free + cached

    # -- scheduling --------------------------------------------------------

    def schedule(self, inflight: ScheduledBatch | None = None) -> ScheduledBatch | None:
        """The next batch. With ``inflight`` (overlap), it is built while that
        batch runs: its sampled tokens feed this one on the device, and nothing
        is retracted (the in-flight batch may still touch any page); a request
        that cannot get pages is skipped and ``starved`` is set, so the caller
        runs one step without overlap."""
        self.starved = False
        self._retracted_now: set[int] = set()
        budget = self.config.token_budget
        chunk = self.config.effective_chunk_size
        chosen: list[tuple[Request, int]] = []
        taken: set[int] = set()
        # Requests about to decode go before running prefills so a long prompt
        # cannot stall every stream; both go before new admissions.
        order = sorted(self.running, key=lambda r: r.remaining > 1)
        prefill_left = self.config.prefill_cap(
            sum(1 for r in order if r.remaining == 1), len(order) + len(self.waiting)
        )
        for req in order:
            if budget == 0:
                break
            if id(req) in self._retracted_now:  # made room for an older one
                continue
            if req.will_finish:
                continue
            prefilling = req.remaining > 1
            n = min(req.remaining, budget, chunk, chunk_limit(req))
            if prefilling:
                n = min(n, prefill_left)
                if n == 0:
                    continue
            if self._reserve(req, n, None if inflight is not None else taken):
                chosen.append((req, n))
                taken.add(id(req))
                budget -= n
                if prefilling:
                    prefill_left -= n
            elif inflight is not None:
                self.starved = True
        while (
            self.waiting
            and min(budget, prefill_left) > 0
            and len(self.running) < self.config.max_running_requests
        ):
            req = self.waiting[0]
            self._admit_prefix(req)
            n = min(req.remaining, budget, chunk, chunk_limit(req), prefill_left)
            if not self._reserve(req, n, None):
                self._release(req)
                break
            self.waiting.popleft()
            self.running.append(req)
            chosen.append((req, n))
            taken.add(id(req))
            budget -= n
            prefill_left -= n
        if not chosen:
            return None
        return self._build(chosen, inflight)

    def _admit_prefix(self, req: Request) -> None:
        """Point the request at its longest cached prefix (at least one token is left
        to compute, since sampling needs that token's logits)."""
        first = req.num_cached_tokens < 0
        if self.cache is None or req.scores_prompt:  # a cached prefix has no logits
            req.num_cached_tokens = max(req.num_cached_tokens, 0)
            return
        m = self.cache.match_prefix(req.fill_ids, max_tokens=len(req.fill_ids) - 1, record=first)
        self.cache.lock(m.node)
        req.cache_node = m.node
        req.page_table = list(m.pages)
        req.num_computed = m.num_tokens
        if first:
            req.num_cached_tokens = m.num_tokens

    def _reserve(self, req: Request, n: int, taken: set[int] | None) -> bool:
        """Give ``req`` the pages for ``n`` more tokens. When the pool is dry, evict
        unreferenced cache pages, then (if ``taken`` is given) retract the newest
        running requests not yet in this batch, ``req`` itself last."""
        need = _ceil_div(self._reserve_target(req, n), self.page_size) - len(req.page_table)
        if need <= 0:  # most decode steps: the last page has room
            return True
        while True:
            pages = self._alloc(need)
            if pages is not None:
                req.page_table.extend(pages)
                return True
            if taken is None:
                return False
            victim = next(
                (r for r in reversed(self.running) if id(r) not in taken and r is not req), req
            )
            self._retract(victim)
            if victim is req:
                return False

    def _reserve_target(self, req: Request, n: int) -> int:
        """Tokens the request must have pages for before running ``n`` more."""
        return req.num_computed + n

    def _alloc(self, n: int) -> list[int] | None:
        pages = self.allocator.alloc(n)
        if pages is None and self.cache is not None:
            self.cache.evict(n - self.allocator.num_free)
            pages = self.allocator.alloc(n)
        return pages

    def _retract(self, req: Request) -> None:
        self._retracted_now.add(id(req))
        self.running.remove(req)
        self._release(req)
        self.waiting.appendleft(req)
        self.num_retracted += 1

    def _build(
        self, chosen: list[tuple[Request, int]], inflight: ScheduledBatch | None
    ) -> ScheduledBatch:
        specs = []
        sample_reqs: list[Request] = []
        future_rows: list[int] = []
        future_src: list[int] = []
        in_flight_index = (
            {id(r): i for i, r in enumerate(inflight.sample_requests)} if inflight else {}
        )
        chunks: list[tuple[Request, int, int, str, bool]] = []
        scored = False
        row = 0
        for req, n in chosen:
            end = req.num_computed + n
            last = end == len(req.fill_ids) + req.pending
            if last:
                sample_reqs.append(req)
            new_ids = req.fill_ids[req.num_computed : end]
            if req.pending:
                # Only a decoding request has a token in flight, and it is the
                # one token this step feeds; it is filled in on the device.
                assert n == 1 and not new_ids, "a pending token must be the only new one"
                new_ids = [0]
                future_rows.append(row)
                future_src.append(in_flight_index[id(req)])
            mode = logits_mode(req, req.num_computed, last)
            chunks.append((req, req.num_computed, n, mode, last))
            scored |= mode == "all"
            specs.append(ExtendSpec(new_ids, req.num_computed, req.page_table, mode))
            # Counted at launch: a later overlapped schedule must see these
            # positions as taken, and the device runs batches in order.
            req.num_computed = end
            row += n
        device = self.pool.kv.device
        fb = build_forward_batch(specs, self.page_size, device)
        sampling = None
        if sample_reqs:
            sampling = SamplingBatch.build(
                [r.params for r in sample_reqs],
                [r.seed for r in sample_reqs],
                [r.num_output + r.pending for r in sample_reqs],
                self.model_config.vocab_size,
                device,
            )
        for r in sample_reqs:
            r.pending += 1
        return ScheduledBatch(
            [r for r, _ in chosen],
            [n for _, n in chosen],
            fb,
            sample_reqs,
            sampling,
            future_rows,
            future_src,
            max((r.params.top_logprobs for r in sample_reqs), default=0),
            PromptScoring.build(chunks, device) if scored else None,
        )

    # -- results -----------------------------------------------------------

    def process(self, batch: ScheduledBatch, out: ForwardOutput) -> list[StepOutput]:
        """Apply a finished forward. Requests that ended (or were aborted) after
        this batch was launched drop its results: their pages are already back,
        and any later batch that reuses them runs after this one."""
        tokens, logprobs, top_ids, top_lps = out.to_host()
        results: list[StepOutput] = []
        sampled = {id(r) for r in batch.sample_requests}
        for row, (req, tok, lp) in enumerate(zip(batch.sample_requests, tokens, logprobs)):
            req.pending -= 1
            if req.finish_reason is not None:
                continue
            req.fill_ids.append(tok)
            req.output_logprobs.append(lp)
            req.finish_reason = self._finish_reason(req, tok)
            if req.finish_reason is not None:
                self.running.remove(req)
                self._on_finish(req)
            top = None
            if req.params.top_logprobs and top_ids is not None and top_lps is not None:
                k = req.params.top_logprobs
                top = list(zip(top_ids[row][:k], top_lps[row][:k]))
            results.append(
                StepOutput(req.rid, tok, lp, req.finish_reason, req.num_cached_tokens, top)
            )
        if self.cache is not None and self.share_chunks:
            # Share finished prefill chunks at once, so concurrent requests with
            # the same prefix (and a later retraction) reuse them.
            for req, n in zip(batch.requests, batch.extend_lens):
                if n > 1 and id(req) not in sampled:
                    self._cache_computed(req)
        return results

    def _on_finish(self, req: Request) -> None:
        self._release(req)

    def reserve_prompt(self, req: Request) -> bool:
        """Match the prefix cache and allocate pages for all of ``fill_ids``
        without scheduling it (KV will be written by someone else). On failure
        nothing is held."""
        self._admit_prefix(req)
        if self._reserve(req, len(req.fill_ids) - req.num_computed, None):
            return True
        self._release(req)
        return False

    def release(self, req: Request) -> None:
        """Give back the pages of a request this scheduler no longer tracks."""
        self._release(req)

    def _finish_reason(self, req: Request, tok: int) -> FinishReason | None:
        p = req.params
        if (not p.ignore_eos and tok in self.model_config.eos_token_ids) or tok in p.stop_token_ids:
            return FinishReason.STOP
        if req.num_output >= p.max_tokens or len(req.fill_ids) >= req.max_total_len:
            return FinishReason.LENGTH
        return None

    def _cache_computed(self, req: Request) -> None:
        """Insert the request's full computed pages into the prefix cache and hold
        the node that now ends its cached prefix."""
        assert self.cache is not None
        full = req.num_computed // self.page_size
        if full == 0:
            return
        res = self.cache.insert(req.fill_ids[: full * self.page_size], req.page_table[:full])
        req.page_table[:full] = res.pages
        self.cache.lock(res.node)
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        req.cache_node = res.node

    def _release(self, req: Request) -> None:
        """Give back the request's pages: full computed pages go to the prefix
        cache (unlocked, so evictable), the rest to the free list."""
        self.token_counts.release(req)
        kept = 0
        if self.cache is not None:
            self._cache_computed(req)
            kept = req.num_computed // self.page_size
            if req.cache_node is not None:
                self.cache.unlock(req.cache_node)
        self.allocator.free(req.page_table[kept:])
        req.page_table = []
        req.cache_node = None
        req.num_computed = 0
