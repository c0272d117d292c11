"""Logit bias and the presence, frequency and repetition penalties, applied to
a batch's logits on the sampling device before temperature and the filters.

Penalties need the tokens a request has seen. They are kept on the device, one
row of counts per penalized request (``TokenCounts``), and each sampled token
is added to its row by the sampler itself, right behind the draw: with the
overlap loop the next step is built before the host knows this step's token,
so a host-side count would always be one token behind.

What counts (stated choices):

- ``presence_penalty`` and ``frequency_penalty`` count generated tokens only,
  as OpenAI defines them: ``logit - frequency * count - presence * (count > 0)``;
- ``repetition_penalty`` (an extension) covers prompt and generated tokens, as
  HF transformers and vLLM do: a seen token's logit is divided by the penalty
  when positive and multiplied by it when negative;
- the penalties apply first, then ``logit_bias`` is added, so a bias of +-100
  dominates whatever the penalties did.

A row is filled from the host's view of the request (prompt and output ids)
when the request is first sampled with penalties (or after a retraction, which
gives its row back): a decode worker thus counts the first token that the
prefill worker sampled. Logprobs stay those of the model's raw logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from engine.host_copy import to_device
from engine.request import Request

COUNT_MASK = (1 << 30) - 1
"""Low bits of a count cell: how often the token was generated."""
PROMPT_FLAG = 1 << 30
"""High bit of a count cell: the token is in the prompt (repetition penalty)."""


class LogitAdjust(NamedTuple):
    """One batch's bias and penalties, as tensors on the sampling device."""

    bias_rows: torch.Tensor | None
    """[N] int64: batch row of each bias entry."""
    bias_ids: torch.Tensor | None
    """[N] int64: its token id."""
    bias_values: torch.Tensor | None
    """[N] float32: what is added to that logit."""
    penalty_rows: torch.Tensor | None
    """[P] int64: batch rows with a penalty."""
    penalty_slots: torch.Tensor | None
    """[P] int64: their rows in ``counts``."""
    penalties: torch.Tensor | None
    """[3, P] float32: presence, frequency and repetition penalty of each."""
    counts: torch.Tensor | None
    """``TokenCounts.counts`` at build time (updated in place by ``record``)."""
    repetition: bool
    """Some row has a repetition penalty (the seen-token mask is needed)."""

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A float32 copy of ``logits`` ([B, V]) with the penalties and bias applied."""
        x = logits.to(torch.float32, copy=True)
        if self.penalty_rows is not None:
            assert self.counts is not None and self.penalty_slots is not None
            assert self.penalties is not None
            cells = self.counts.index_select(0, self.penalty_slots)
            generated = (cells & COUNT_MASK).to(torch.float32)
            rows = x.index_select(0, self.penalty_rows)
            presence, frequency, repetition = self.penalties[:, :, None].unbind(0)
            if self.repetition:
                penalized = torch.where(rows > 0, rows / repetition, rows * repetition)
                rows = torch.where(cells != 0, penalized, rows)
            rows = rows - frequency * generated - presence * (generated > 0)
            x.index_copy_(0, self.penalty_rows, rows)
        if self.bias_rows is not None:
            assert self.bias_ids is not None and self.bias_values is not None
            x.index_put_((self.bias_rows, self.bias_ids), self.bias_values, accumulate=True)
        return x

    def record(self, token_ids: torch.Tensor) -> None:
        """Count the tokens just sampled ([B]) in the penalized rows' counts."""
        if self.penalty_rows is None:
            return
        assert self.counts is not None and self.penalty_slots is not None
        sampled = token_ids.index_select(0, self.penalty_rows)
        ones = torch.ones_like(sampled, dtype=self.counts.dtype)
        self.counts.index_put_((self.penalty_slots, sampled), ones, accumulate=True)


class TokenCounts:
    """Rows of token counts on the device, one per penalized request that is
    being sampled; a request holds its row (``Request.count_slot``) until its
    pages are released. The table grows by doubling and is never shrunk."""

    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.counts: torch.Tensor | None = None
        """[capacity, vocab] int32: generated count | ``PROMPT_FLAG``."""
        self._free: list[int] = []

    @property
    def capacity(self) -> int:
        return 0 if self.counts is None else self.counts.shape[0]

    @property
    def in_use(self) -> int:
        return self.capacity - len(self._free)

    def adjust(self, requests: Sequence[Request]) -> LogitAdjust | None:
        """The adjustments of a batch whose row ``i`` samples ``requests[i]``
        (None when no request has any: the sampler then does no extra work)."""
        bias: list[tuple[int, int, float]] = []
        penalized: list[int] = []
        for row, req in enumerate(requests):
            p = req.params
            for token, value in p.logit_bias:
                bias.append((row, token, value))
            if p.penalized:
                penalized.append(row)
        if not bias and not penalized:
            return None
        bias_rows = bias_ids = bias_values = None
        if bias:
            rows, ids, values = zip(*bias)
            index = to_device(torch.tensor([rows, ids], dtype=torch.int64), self.device)
            bias_rows, bias_ids = index[0], index[1]
            bias_values = to_device(torch.tensor(values, dtype=torch.float32), self.device)
        penalty_rows = penalty_slots = penalties = None
        repetition = False
        if penalized:
            reqs = [requests[r] for r in penalized]
            self._assign([r for r in reqs if r.count_slot < 0])
            index = to_device(
                torch.tensor([penalized, [r.count_slot for r in reqs]], dtype=torch.int64),
                self.device,
            )
            penalty_rows, penalty_slots = index[0], index[1]
            penalties = to_device(
                torch.tensor(
                    [
                        [r.params.presence_penalty for r in reqs],
                        [r.params.frequency_penalty for r in reqs],
                        [r.params.repetition_penalty for r in reqs],
                    ],
                    dtype=torch.float32,
                ),
                self.device,
            )
            repetition = any(r.params.repetition_penalty != 1.0 for r in reqs)
        return LogitAdjust(
            bias_rows,
            bias_ids,
            bias_values,
            penalty_rows,
            penalty_slots,
            penalties,
            self.counts,
            repetition,
        )

    def release(self, req: Request) -> None:
        """Give back ``req``'s row. A batch still in flight may write to it;
        the device runs that write before the fill of the row's next owner,
        which is queued later."""
        if req.count_slot >= 0:
            self._free.append(req.count_slot)
            req.count_slot = -1

    def _assign(self, reqs: list[Request]) -> None:
        """Give each of ``reqs`` a row, filled from its prompt and output."""
        if not reqs:
            return
        if len(self._free) < len(reqs):
            self._grow(self.in_use + len(reqs))
        rows: list[int] = []
        cols: list[int] = []
        values: list[int] = []
        for req in reqs:
            slot = self._free.pop()
            req.count_slot = slot
            if req.params.repetition_penalty != 1.0:
                seen = set(req.prompt_ids)
                rows.extend([slot] * len(seen))
                cols.extend(seen)
                values.extend([PROMPT_FLAG] * len(seen))
            out = req.output_ids
            rows.extend([slot] * len(out))
            cols.extend(out)
            values.extend([1] * len(out))
        assert self.counts is not None
        slots = to_device(
            torch.tensor([r.count_slot for r in reqs], dtype=torch.int64), self.device
        )
        self.counts.index_fill_(0, slots, 0)
        if rows:
            cells = to_device(torch.tensor([rows, cols, values], dtype=torch.int64), self.device)
            self.counts.index_put_(
                (cells[0], cells[1]), cells[2].to(self.counts.dtype), accumulate=True
            )

    def _grow(self, need: int) -> None:
        old = self.capacity
        new = max(8, old * 2, need)
        counts = torch.zeros(new, self.vocab_size, dtype=torch.int32, device=self.device)
        if self.counts is not None:
            # Queued after every batch already launched, so rows that one of
            # them is still counting into are copied with those counts.
            counts[:old].copy_(self.counts)
        self.counts = counts
        self._free.extend(range(new - 1, old - 1, -1))
