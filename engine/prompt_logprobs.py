"""Prompt logprobs: the logprob of each prompt token given its prefix, for
requests that ask for them (``SamplingParams.prompt_logprobs``).

The logits at position ``p`` predict token ``p + 1``, so a chunk of a prompt
that is being scored asks for logits at every one of its tokens ("all" rows)
instead of only the last; the rows that predict a prompt token are scored here
and the one at the prompt's last token is sampled as usual. Scores are kept on
the request chunk by chunk (``Request.prompt_logprobs``), indexed by position,
so a chunk that runs again after a retraction overwrites its own entries, and
they leave the engine with the request's first token.

Such a request never starts from a cached prefix (a cached prefix has KV but
no logits): the scheduler computes its whole prompt, and its chunks are at most
``SCORE_CHUNK`` tokens so that the logits of a chunk stay small with a large
vocabulary (512 x 128k float32 is 256 MiB).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from engine.host_copy import to_device
from engine.request import PromptLogprobs, Request, StepOutput

SCORE_CHUNK = 512
"""Most prompt tokens of a scored request in one forward."""


def logits_mode(req: Request, start: int, last: bool) -> str:
    """Which logits the chunk of ``req`` that starts at ``start`` needs
    (``engine.forward_batch.ExtendSpec.logits``)."""
    if not req.prompt_scored and start < len(req.prompt_ids) and req.scores_prompt:
        return "all"
    return "last" if last else "none"


def chunk_limit(req: Request) -> int:
    """Most tokens of ``req`` one forward may compute."""
    return 1 << 62 if req.prompt_scored or not req.scores_prompt else SCORE_CHUNK


class PromptScoring(NamedTuple):
    """Which logits rows of a batch score prompt tokens and which are sampled."""

    score_rows: torch.Tensor
    """[R] int64: logits rows that predict a prompt token."""
    targets: torch.Tensor
    """[R] int64: the prompt token each of them predicts."""
    sample_rows: torch.Tensor
    """[S] int64: the logits row of each sampled request, in sampling order."""
    segments: list[tuple[Request, int, int]]
    """(request, index of its first scored entry, number of entries)."""
    top_k: int
    """Alternatives to return per prompt token (the largest asked for)."""

    @classmethod
    def build(
        cls,
        chunks: Sequence[tuple[Request, int, int, str, bool]],
        device: torch.device | str,
    ) -> PromptScoring:
        """``chunks``: (request, first position, tokens, logits mode, sampled)
        of every request of a batch, in batch order."""
        score_rows: list[int] = []
        targets: list[int] = []
        sample_rows: list[int] = []
        segments: list[tuple[Request, int, int]] = []
        top_k = 0
        row = 0
        for req, start, n, mode, sampled in chunks:
            if mode == "last":
                sample_rows.append(row)
                row += 1
            elif mode == "all":
                n_prompt = len(req.prompt_ids)
                # Position p predicts token p + 1: the prompt's last position
                # predicts the first output token, which is sampled instead.
                k = max(0, min(n, n_prompt - 1 - start))
                score_rows.extend(range(row, row + k))
                targets.extend(req.fill_ids[start + 1 : start + 1 + k])
                segments.append((req, start, k))
                top_k = max(top_k, req.params.prompt_logprobs or 0)
                if sampled:
                    sample_rows.append(row + n - 1)
                row += n
        index = to_device(
            torch.tensor([*score_rows, *targets, *sample_rows], dtype=torch.int64), device
        )
        r = len(score_rows)
        return cls(index[:r], index[r : 2 * r], index[2 * r :], segments, top_k)

    def score(self, logits: torch.Tensor) -> PromptScores:
        """The scores of this batch's prompt tokens from its logits (queued on
        the device; read with ``PromptScores.apply``)."""
        lps = logits.index_select(0, self.score_rows).to(torch.float32).log_softmax(-1)
        chosen = lps.gather(-1, self.targets[:, None]).squeeze(-1)
        top_ids = top_lps = None
        if self.top_k and lps.shape[0]:
            top = lps.topk(min(self.top_k, lps.shape[-1]), dim=-1)
            top_ids, top_lps = top.indices, top.values
        values = (chosen, top_ids, top_lps)
        event = None
        if logits.is_cuda:
            # Copied behind the forward; read by waiting on this copy, not on
            # the stream (the overlap loop queues the next forward behind it).
            values = tuple(None if t is None else t.to("cpu", non_blocking=True) for t in values)
            event = torch.cuda.Event()
            event.record()
        return PromptScores(self, values, event)


class PromptScores(NamedTuple):
    scoring: PromptScoring
    values: tuple[torch.Tensor | None, ...]
    """Logprob of each scored token, and the top ids and logprobs (or None)."""
    copied: torch.cuda.Event | None

    def apply(self, results: list[StepOutput]) -> list[StepOutput]:
        """Store the scores on their requests; the first token of a request
        whose prompt is now complete carries its prompt logprobs."""
        if self.copied is not None:
            self.copied.synchronize()
        chosen, top_ids, top_lps = (None if t is None else t.tolist() for t in self.values)
        assert chosen is not None
        done: dict[str, Request] = {}
        offset = 0
        for req, start, k in self.scoring.segments:
            want = req.params.prompt_logprobs or 0
            del req.prompt_logprobs[start:], req.prompt_top_logprobs[start:]
            req.prompt_logprobs.extend(chosen[offset : offset + k])
            if top_ids is not None and top_lps is not None and want:
                req.prompt_top_logprobs.extend(
                    list(zip(ids[:want], lps[:want]))
                    for ids, lps in zip(top_ids[offset : offset + k], top_lps[offset : offset + k])
                )
            else:
                req.prompt_top_logprobs.extend([] for _ in range(k))
            offset += k
            if start + k == len(req.prompt_ids) - 1:
                done[req.rid] = req
        if not done:
            return results
        out = []
        for r in results:
            req = done.get(r.rid)
            if req is not None and req.num_output >= 1:
                req.prompt_scored = True
                r = r._replace(
                    prompt_logprobs=PromptLogprobs(req.prompt_logprobs, req.prompt_top_logprobs)
                )
            out.append(r)
        return out
