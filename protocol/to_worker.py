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


ToWorker = Generate | Prefill | Abort
decoder = msgspec.msgpack.Decoder(ToWorker)
encoder = msgspec.msgpack.Encoder()
