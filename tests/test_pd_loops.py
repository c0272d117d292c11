"""Prefill and decode engine loops driven in one process over a real KV plane
(ZMQ sockets plus the transfer backend), against the colocated engine."""

from __future__ import annotations

import dataclasses
import random
import time

import pytest

from decode_server.loop import DecodeLoop
from engine.llm import LLM
from engine.tiny import ensure_tiny_model
from prefill_server.loop import PrefillLoop
from prefill_server.scheduler import PREFILL_DONE
from protocol.sampling import SamplingParams
from protocol.to_gateway import TokenDelta
from protocol.to_worker import Generate, Prefill
from worker.config import WorkerConfig

GW = b"gateway"


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(ensure_tiny_model())


def worker_config(model: str, role: str, **kw) -> WorkerConfig:
    base = dict(
        role=role,
        model=model,
        host="127.0.0.1",
        bootstrap_port=0,
        page_size=4,
        num_pages=256,
        max_num_batched_tokens=64,
        chunk_size=24,
        transfer_backend="tcp",
        cluster_token="secret",
        transfer_timeout_s=5.0,
    )
    base.update(kw)
    return WorkerConfig(**base)


def prompts_with_shared_prefixes(n: int, seed: int = 0) -> list[list[int]]:
    g = random.Random(seed)
    prefixes = [[g.randrange(3, 512) for _ in range(g.randrange(8, 40))] for _ in range(3)]
    return [
        prefixes[i % 3] + [g.randrange(3, 512) for _ in range(g.randrange(1, 30))] for i in range(n)
    ]


class Harness:
    def __init__(self, prefill: PrefillLoop, decode: DecodeLoop) -> None:
        self.p, self.d = prefill, decode
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, TokenDelta] = {}
        self.p_final: dict[str, TokenDelta] = {}

    def submit(
        self, rid: str, prompt: list[int], spec: SamplingParams, room: str | None = None
    ) -> None:
        room = room or f"room-{rid}"
        self.tokens[rid] = []
        self.d.submit(Generate(rid, prompt, spec, room, self.p.bootstrap_endpoint), GW)
        self.p.submit(Prefill(rid, prompt, spec, room, self.d.bootstrap_endpoint), GW)

    def run(self, deadline_s: float = 60.0) -> None:
        end = time.monotonic() + deadline_s
        while self.p.has_work() or self.d.has_work():
            assert time.monotonic() < end, "P/D loops did not drain"
            for client, delta in self.p.step():
                assert client == GW
                self.tokens[delta.rid][:0] = delta.token_ids  # first token goes first
                self.p_final[delta.rid] = delta
            for client, delta in self.d.step():
                assert client == GW
                self.tokens[delta.rid].extend(delta.token_ids)
                if delta.finish_reason is not None:
                    self.finish[delta.rid] = delta


def assert_pools_idle(loop) -> None:
    s = loop.stats()
    assert s["running"] == 0 and s["waiting"] == 0
    assert s["available_pages"] == s["total_pages"], s


def _nixl_available() -> bool:
    try:
        import nixl._api  # noqa: F401
    except ImportError:
        return False
    return True


BACKENDS = [
    "tcp",
    pytest.param(
        "nixl", marks=pytest.mark.skipif(not _nixl_available(), reason="nixl not installed")
    ),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("decode_cache", [True, False])
def test_pd_matches_colocated(model_dir: str, decode_cache: bool, backend: str) -> None:
    prompts = prompts_with_shared_prefixes(16)
    spec = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = LLM(model_dir, page_size=4, num_pages=256)
    expected = llm.generate(
        prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    )
    p = PrefillLoop(worker_config(model_dir, "prefill", transfer_backend=backend))
    d = DecodeLoop(
        worker_config(
            model_dir, "decode", enable_prefix_cache=decode_cache, transfer_backend=backend
        )
    )
    try:
        h = Harness(p, d)
        for i, prompt in enumerate(prompts):
            h.submit(f"r{i}", prompt, spec)
        h.run()
        for i, e in enumerate(expected):
            assert h.tokens[f"r{i}"] == e.token_ids, f"request {i}"
            assert h.finish[f"r{i}"].finish_reason == "length"
            assert h.p_final[f"r{i}"].finish_reason == PREFILL_DONE
        # Second wave: the decode-side cache now holds the prefixes, so prefill
        # sends only what decode lacks; tokens must not change.
        for i, prompt in enumerate(prompts):
            h.submit(f"again{i}", prompt, spec)
        h.run()
        for i, e in enumerate(expected):
            assert h.tokens[f"again{i}"] == e.token_ids
        assert p.stats()["transfers_ok"] == 32
        assert_pools_idle(p)
        assert_pools_idle(d)
    finally:
        p.close()
        d.close()


def test_handshake_mismatch_and_token(model_dir: str, tmp_path) -> None:
    p = PrefillLoop(worker_config(model_dir, "prefill"))
    d_bad_token = DecodeLoop(worker_config(model_dir, "decode", cluster_token="wrong"))
    d_bad_page = DecodeLoop(worker_config(model_dir, "decode", page_size=2))
    spec = SamplingParams(max_tokens=4, temperature=0.0)
    try:
        for d, needle in ((d_bad_token, "cluster token"), (d_bad_page, "page_size")):
            h = Harness(p, d)
            h.submit("x", [5, 6, 7, 8, 9], spec)
            h.run(deadline_s=20)
            assert h.finish["x"].finish_reason == "error"
            assert needle in h.finish["x"].error
            assert_pools_idle(d)
        assert_pools_idle(p)
    finally:
        for loop in (p, d_bad_token, d_bad_page):
            loop.close()


def test_duplicate_room_and_abort(model_dir: str) -> None:
    p = PrefillLoop(worker_config(model_dir, "prefill"))
    d = DecodeLoop(worker_config(model_dir, "decode"))
    spec = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    try:
        h = Harness(p, d)
        h.submit("a", list(range(10, 40)), spec, room="same")
        h.submit("b", list(range(10, 30)), spec, room="same")
        # Step until "a" streams from decode, then abort it on both sides.
        end = time.monotonic() + 30
        while len(h.tokens["a"]) < 3:
            assert time.monotonic() < end
            for _, delta in p.step():
                h.tokens[delta.rid][:0] = delta.token_ids
                h.p_final[delta.rid] = delta
            for _, delta in d.step():
                h.tokens[delta.rid].extend(delta.token_ids)
                if delta.finish_reason:
                    h.finish[delta.rid] = delta
        assert h.finish["b"].finish_reason == "error" and "already in use" in h.finish["b"].error
        assert h.p_final["b"].finish_reason == "error"
        d.abort("a")
        p.abort("a")
        h.run()
        assert h.finish["a"].finish_reason == "abort"
        assert_pools_idle(p)
        assert_pools_idle(d)
    finally:
        p.close()
        d.close()


def test_prefill_never_answers(model_dir: str) -> None:
    """Decode reserved pages but the prefill engine got no request: the room
    fails within the transfer timeout and the pages come back."""
    p = PrefillLoop(worker_config(model_dir, "prefill", transfer_timeout_s=1.0))
    d = DecodeLoop(worker_config(model_dir, "decode", transfer_timeout_s=1.0))
    try:
        h = Harness(p, d)
        h.tokens["lonely"] = []
        spec = SamplingParams(max_tokens=4, temperature=0.0)
        d.submit(Generate("lonely", [5, 6, 7, 8, 9], spec, "room-l", p.bootstrap_endpoint), GW)
        t0 = time.monotonic()
        h.run(deadline_s=15)
        assert h.finish["lonely"].finish_reason == "error"
        assert time.monotonic() - t0 < 8
        assert_pools_idle(d)
        assert_pools_idle(p)
    finally:
        p.close()
        d.close()


def test_worker_config_is_frozen(model_dir: str) -> None:
    cfg = worker_config(model_dir, "decode")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.page_size = 8  # type: ignore[misc]
