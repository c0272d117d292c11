"""Per-request stage timing, shared by the gateway and the workers. Torch-free.

Each process stamps the stages of a request that it sees with its own
monotonic clock (``StageClock``). Clocks of different processes are not
comparable, so only durations between two stages of the same process are ever
reported (``Interval``); a worker sends its stages to the requester as offsets
from the moment it received the request (``TokenDelta.stages`` of the
request's final delta), and the gateway turns them into durations on the
worker's own clock.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import NamedTuple

# -- stage names -----------------------------------------------------------------
# Gateway (per choice): the request came in, was tokenized, handed to its
# worker(s); the first token's frame was read off the request plane; the first
# SSE chunk with text was written (streamed) or the response was built.
RECEIVED = "received"
TOKENIZED = "tokenized"
DISPATCHED = "dispatched"
FIRST_TOKEN_RECEIVED = "first_token_received"
FIRST_BYTE_WRITTEN = "first_byte_written"
FINISHED = "finished"

# Worker (per request, in its engine process): RECEIVED, then handed to the
# engine's scheduler; the first forward that included it started and finished;
# its first token was sampled, then sent; FINISHED when its final delta left.
ADMITTED = "admitted"
FORWARD_STARTED = "forward_started"
FORWARD_FINISHED = "forward_finished"
FIRST_TOKEN = "first_token"
FIRST_TOKEN_SENT = "first_token_sent"
# The KV path of a disaggregated request. Decode: pages reserved and Reserve
# sent; Done received (every page landed). Prefill: Reserve received; the last
# chunk's pages handed to the transfer backend; every write landed; Done sent.
RESERVE_SENT = "reserve_sent"
DONE_RECEIVED = "done_received"
RESERVE_RECEIVED = "reserve_received"
LAST_CHUNK_PUSHED = "last_chunk_pushed"
WRITES_LANDED = "writes_landed"
DONE_SENT = "done_sent"


class Interval(NamedTuple):
    """A duration reported per request: from stage ``start`` to stage ``end``,
    both stamped by the same process."""

    name: str
    start: str
    end: str


GATEWAY_INTERVALS: tuple[Interval, ...] = (
    Interval("tokenize", RECEIVED, TOKENIZED),
    Interval("route", TOKENIZED, DISPATCHED),
    Interval("dispatch_to_first_token", DISPATCHED, FIRST_TOKEN_RECEIVED),
    Interval("first_token_to_first_byte", FIRST_TOKEN_RECEIVED, FIRST_BYTE_WRITTEN),
    Interval("time_to_first_byte", RECEIVED, FIRST_BYTE_WRITTEN),
    Interval("total", RECEIVED, FINISHED),
)
"""What the gateway reports of its own stages."""

WORKER_INTERVALS: tuple[Interval, ...] = (
    Interval("wait_pages", RECEIVED, RESERVE_SENT),
    Interval("kv_transfer", RESERVE_SENT, DONE_RECEIVED),
    # Decode: the KV has landed, until the first decode step that includes the
    # request is launched (the wait a finished prefill sees on the decode side).
    Interval("done_to_first_step", DONE_RECEIVED, FORWARD_STARTED),
    Interval("wait_reserve", RECEIVED, RESERVE_RECEIVED),
    Interval("admit", RECEIVED, ADMITTED),
    Interval("queue", ADMITTED, FORWARD_STARTED),
    Interval("first_forward", FORWARD_STARTED, FORWARD_FINISHED),
    Interval("to_first_token", FORWARD_FINISHED, FIRST_TOKEN),
    Interval("send_first_token", FIRST_TOKEN, FIRST_TOKEN_SENT),
    Interval("time_to_first_token", RECEIVED, FIRST_TOKEN_SENT),
    Interval("kv_tail", LAST_CHUNK_PUSHED, WRITES_LANDED),
    Interval("send_done", WRITES_LANDED, DONE_SENT),
    Interval("total", RECEIVED, FINISHED),
)
"""What a worker reports of its stages. ``wait_pages`` and ``kv_transfer`` are
the decode side of a disaggregated request (``admit`` then spans both: the
request reaches the scheduler once its KV is in); ``wait_reserve``,
``kv_tail`` and ``send_done`` the prefill side (the reservation overlaps the
prefill's compute, so ``wait_reserve`` reaches the requester only when it
ended before the first token); the rest every role."""


class StageClock:
    """Monotonic stamps of the stages one process saw of one request.

    The first stamp of a stage wins: a stage is the first time something
    happened (the first forward, the first token), and callers may stamp it
    every time it happens without checking."""

    __slots__ = ("stamps",)

    def __init__(self, received: float | None = None) -> None:
        self.stamps: dict[str, float] = {
            RECEIVED: time.monotonic() if received is None else received
        }

    def mark(self, stage: str, at: float | None = None) -> None:
        if stage not in self.stamps:
            self.stamps[stage] = time.monotonic() if at is None else at

    def has(self, stage: str) -> bool:
        return stage in self.stamps

    def offsets(self) -> dict[str, float]:
        """Every stage as seconds after ``RECEIVED`` (what goes on the wire)."""
        base = self.stamps[RECEIVED]
        return {k: round(v - base, 7) for k, v in self.stamps.items()}


def durations(stamps: Mapping[str, float], intervals: Iterable[Interval]) -> dict[str, float]:
    """The ``intervals`` whose two stages are both in ``stamps`` (stamps or
    offsets of one process), in seconds; never negative."""
    out = {}
    for iv in intervals:
        start, end = stamps.get(iv.start), stamps.get(iv.end)
        if start is not None and end is not None:
            out[iv.name] = max(0.0, end - start)
    return out


def format_durations(values: Mapping[str, float]) -> str:
    """``name=1.23ms`` pairs for a log line."""
    return " ".join(f"{k}={v * 1e3:.2f}ms" for k, v in values.items())
