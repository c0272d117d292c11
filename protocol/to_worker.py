"""Messages a worker's engine process receives on its request plane (ROUTER)."""

from __future__ import annotations

import msgspec

from protocol.sampling import SamplingParams


class Generate(msgspec.Struct, tag="generate", frozen=True):
    """Run a request to completion on this worker and stream its tokens.

    On a decode worker with ``prefill_bootstrap`` set, the prompt's KV comes
    from that prefill worker under ``room`` and the first token arrives with
    it; without it the worker prefills locally (colocated or conditional
    disaggregation).
    """

    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    room: str | None = None
    prefill_bootstrap: str | None = None


class Prefill(msgspec.Struct, tag="prefill", frozen=True):
    """Prefill ``prompt_ids`` into the decode worker at ``decode_bootstrap`` under
    ``room``; reply with the first token only."""

    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    room: str
    decode_bootstrap: str


class Abort(msgspec.Struct, tag="abort", frozen=True):
    rid: str


class Heartbeat(msgspec.Struct, tag="heartbeat", frozen=True):
    """The requester is alive. A requester that sent one is expected to keep
    sending them: when it falls silent for the worker's ``requester_timeout_s``
    (killed, paused, cut off), the worker aborts its requests. Requesters that
    never send one are not watched."""

    kv_epoch: str = ""
    kv_seq: int | None = None
    """Subscribes to the worker's KV events (``protocol.kv_events``): the last
    batch the requester applied (of ``kv_epoch``), or ``SNAPSHOT_PLEASE``.
    None: no events (a requester that does not route by them)."""


ToWorker = Generate | Prefill | Abort | Heartbeat
decoder = msgspec.msgpack.Decoder(ToWorker)
encoder = msgspec.msgpack.Encoder()
