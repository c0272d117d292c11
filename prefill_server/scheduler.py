"""Prefill-side scheduling rules on top of the engine's scheduler."""

from __future__ import annotations

from engine.request import Request
from engine.scheduler import Scheduler
from protocol.finish import FinishReason


class PrefillScheduler(Scheduler):
    """Runs each request up to its first token and then holds its pages until
    the KV transfer is confirmed (``release``).

    Pages must not move while a transfer may still read them, so: computed
    chunks are not shared mid-prefill (sharing may free a duplicate page that a
    write is reading), and a request gets pages for its whole prompt at
    admission, so a running prefill never needs more and nothing is retracted.
    """

    share_chunks = False

    def _reserve_target(self, req: Request, n: int) -> int:
        return len(req.fill_ids)

    def _reserve(self, req: Request, n: int, taken: set[int] | None) -> bool:
        # Never retract: a retracted request's pages could be under a write.
        return super()._reserve(req, n, None)

    def _on_finish(self, req: Request) -> None:
        pass  # the prefill loop releases after the transfer

    def _finish_reason(self, req: Request, tok: int) -> FinishReason | None:
        # PREFILL_DONE: the first token is out; decoding goes on elsewhere.
        return super()._finish_reason(req, tok) or FinishReason.PREFILL_DONE
