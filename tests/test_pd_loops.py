"""Prefill and decode engine loops driven in one process over a real KV plane
(ZMQ sockets plus the transfer backend), against the colocated engine."""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from decode_server.loop import DecodeLoop
from decode_server.room import DecodeState
from decode_server.room import Room as DecodeRoom
from engine.llm import LLM
from engine.request import Request
from kvtransfer.nixl import nixl_available
from prefill_server.loop import PrefillLoop
from prefill_server.room import PrefillState
from prefill_server.room import Room as PrefillRoom
from protocol.finish import FinishReason
from protocol.sampling import SamplingParams
from protocol.to_gateway import TokenDelta
from protocol.to_worker import Generate, Prefill
from worker.config import WorkerConfig

GW = b"gateway"


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
    return WorkerConfig.from_settings(**base)


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
        self.p_deltas: dict[str, list[TokenDelta]] = {}
        """Every delta the prefill loop sent, by request."""

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
            self.step()

    def step(self) -> None:
        self.step_prefill()
        self.step_decode()

    def step_prefill(self) -> None:
        for client, delta in self.p.step():
            assert client == GW
            self.tokens[delta.rid][:0] = delta.token_ids  # first token goes first
            self.p_final[delta.rid] = delta
            self.p_deltas.setdefault(delta.rid, []).append(delta)

    def step_decode(self) -> None:
        for client, delta in self.d.step():
            assert client == GW
            self.tokens[delta.rid].extend(delta.token_ids)
            if delta.finish_reason is not None:
                assert delta.rid not in self.finish, "a second final delta"
                self.finish[delta.rid] = delta

    def step_until(self, cond: Callable[[], bool], deadline_s: float = 20.0) -> None:
        end = time.monotonic() + deadline_s
        while not cond():
            assert time.monotonic() < end, "condition not reached"
            self.step()


@contextlib.contextmanager
def pd_loops(
    model_dir: str, prefill: dict[str, Any] | None = None, decode: dict[str, Any] | None = None
) -> Iterator[tuple[PrefillLoop, DecodeLoop]]:
    """A prefill and a decode loop on the tests' configs (``prefill``, ``decode``:
    settings overridden), both closed at the end."""
    p = PrefillLoop(worker_config(model_dir, "prefill", **(prefill or {})))
    try:
        d = DecodeLoop(worker_config(model_dir, "decode", **(decode or {})))
    except BaseException:
        p.close()
        raise
    try:
        yield p, d
    finally:
        p.close()
        d.close()


def assert_pools_idle(loop) -> None:
    s = loop.stats()
    assert s["running"] == 0 and s["waiting"] == 0
    assert s["available_pages"] == s["total_pages"], s


def assert_pool_back(
    loop: PrefillLoop | DecodeLoop, start: dict[str, Any], cached: bool = False
) -> None:
    """Nothing runs, waits or holds a room, and the pool's free pages are back
    to ``start``; with ``cached``, pages the prefix cache holds unlocked (a
    prefilled prompt) count as free."""
    s = loop.stats()
    assert s["running"] == 0 and s["waiting"] == 0 and len(loop.rooms) == 0, s
    assert s["locked_pages"] == 0, s
    free = s["available_pages"] if cached else s["free_pages"]
    assert free == start["free_pages"], (s, start)


BACKENDS = [
    "tcp",
    pytest.param(
        "nixl", marks=pytest.mark.skipif(not nixl_available()[0], reason="nixl not installed")
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
    with pd_loops(
        model_dir,
        prefill=dict(transfer_backend=backend),
        decode=dict(enable_prefix_cache=decode_cache, transfer_backend=backend),
    ) as (p, d):
        h = Harness(p, d)
        for i, prompt in enumerate(prompts):
            h.submit(f"r{i}", prompt, spec)
        h.run()
        for i, e in enumerate(expected):
            assert h.tokens[f"r{i}"] == e.token_ids, f"request {i}"
            assert h.finish[f"r{i}"].finish_reason == "length"
            assert h.p_final[f"r{i}"].finish_reason == FinishReason.PREFILL_DONE
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


def test_handshake_mismatch_and_token(model_dir: str, tmp_path) -> None:
    p = PrefillLoop(worker_config(model_dir, "prefill"))
    d_bad_token = DecodeLoop(worker_config(model_dir, "decode", cluster_token="wrong"))
    d_bad_page = DecodeLoop(worker_config(model_dir, "decode", page_size=2))
    d_fp8 = DecodeLoop(worker_config(model_dir, "decode", kv_cache_dtype="fp8_e4m3"))
    spec = SamplingParams(max_tokens=4, temperature=0.0)
    try:
        for d, needle in (
            (d_bad_token, "cluster token"),
            (d_bad_page, "page_size"),
            (d_fp8, "kv_dtype (prefill float32, decode float8_e4m3fn)"),
        ):
            h = Harness(p, d)
            h.submit("x", [5, 6, 7, 8, 9], spec)
            h.run(deadline_s=20)
            assert h.finish["x"].finish_reason == "error"
            assert needle in h.finish["x"].error
            assert_pools_idle(d)
        assert_pools_idle(p)
    finally:
        for loop in (p, d_bad_token, d_bad_page, d_fp8):
            loop.close()


def test_pd_with_fp8_kv_matches_colocated_fp8(model_dir: str) -> None:
    """FP8 pages move as bytes: the pair decodes what one FP8 engine does."""
    prompts = prompts_with_shared_prefixes(8, seed=3)
    spec = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    llm = LLM(model_dir, page_size=4, num_pages=256, kv_cache_dtype="fp8_e4m3")
    expected = llm.generate(prompts, spec)
    fp8 = dict(kv_cache_dtype="fp8_e4m3")
    with pd_loops(model_dir, prefill=fp8, decode=fp8) as (p, d):
        for loop in (p, d):
            assert str(loop.engine.runner.pool.kv.dtype) == "torch.float8_e4m3fn"
        h = Harness(p, d)
        for i, prompt in enumerate(prompts):
            h.submit(f"r{i}", prompt, spec)
        h.run()
        for i, e in enumerate(expected):
            assert h.tokens[f"r{i}"] == e.token_ids, f"request {i}"
        assert_pools_idle(p)
        assert_pools_idle(d)


def test_duplicate_room_and_abort(model_dir: str) -> None:
    spec = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    with pd_loops(model_dir) as (p, d):
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


def test_prefill_never_answers(model_dir: str) -> None:
    """Decode reserved pages but the prefill engine got no request: the room
    fails within the transfer timeout and the pages come back."""
    with pd_loops(
        model_dir, prefill=dict(transfer_timeout_s=1.0), decode=dict(transfer_timeout_s=1.0)
    ) as (p, d):
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


def test_worker_config_is_frozen(model_dir: str) -> None:
    cfg = worker_config(model_dir, "decode")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.page_size = 8  # type: ignore[misc]


def test_reserve_before_prefill(model_dir: str) -> None:
    """The decode worker's Reserve overtakes the gateway's Prefill: the prefill
    worker holds it, and the Prefill claims it on arrival and computes at once."""
    prompt = list(range(10, 40))
    spec = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = LLM(model_dir, page_size=4, num_pages=256).generate([prompt], spec)[0]
    with pd_loops(model_dir) as (p, d):
        p_start, d_start = p.stats(), d.stats()
        h = Harness(p, d)
        h.tokens["r"] = []
        d.submit(Generate("r", prompt, spec, "room-r", p.bootstrap_endpoint), GW)
        h.step_until(lambda: "room-r" in p.unclaimed.reserves)
        assert len(p.rooms) == 0 and not p.scheduler.has_work()
        d_room = d.rooms.get("room-r")
        assert d_room is not None and d_room.state is DecodeState.TRANSFERRING
        p.submit(Prefill("r", prompt, spec, "room-r", d.bootstrap_endpoint), GW)
        p_room = p.rooms.get("room-r")
        assert p_room is not None and p_room.state is PrefillState.COMPUTING
        assert p_room.reserve is not None and not p.unclaimed.reserves
        h.run()
        assert h.tokens["r"] == expected.token_ids
        assert h.finish["r"].finish_reason == "length"
        assert [x.finish_reason for x in h.p_deltas["r"]] == [FinishReason.PREFILL_DONE]
        assert p_room.state is PrefillState.DONE and d_room.state is DecodeState.DECODING
        assert p.stats()["transfers_ok"] == d.stats()["transfers_ok"] == 1
        assert_pool_back(p, p_start, cached=True)
        assert_pool_back(d, d_start, cached=True)


def test_prefill_computes_while_its_reservation_is_on_the_way(model_dir: str) -> None:
    """With the decode engine already handshaken, a Prefill computes at once;
    its first token goes out before the Reserve comes, and the KV computed
    meanwhile is pushed when it does. A new peer's first Prefill waits for the
    handshake (and so for its Reserve) instead."""
    prompt = list(range(10, 80))
    spec = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = LLM(model_dir, page_size=4, num_pages=256).generate([prompt], spec)[0]
    with pd_loops(model_dir) as (p, d):
        p_start, d_start = p.stats(), d.stats()
        h = Harness(p, d)
        # A new peer: the Prefill waits for the handshake and the reservation.
        h.tokens["first"] = []
        p.submit(Prefill("first", prompt[:20], spec, "room-first", d.bootstrap_endpoint), GW)
        first_room = p.rooms.get("room-first")
        assert first_room is not None and not first_room.scheduled
        assert not p.scheduler.has_work()
        d.submit(Generate("first", prompt[:20], spec, "room-first", p.bootstrap_endpoint), GW)
        h.run()
        assert p.kv.is_connected(d.bootstrap_endpoint)

        h.tokens["r"] = []
        p.submit(Prefill("r", prompt, spec, "room-r", d.bootstrap_endpoint), GW)
        p_room = p.rooms.get("room-r")
        assert p_room is not None and p_room.scheduled
        h.step_until(lambda: "r" in h.p_final, deadline_s=30)  # prefill alone
        assert p_room.state is PrefillState.AWAITING_RESERVE and p_room.first is not None
        assert p_room.handles == [] and h.p_final["r"].finish_reason == FinishReason.PREFILL_DONE
        d.submit(Generate("r", prompt, spec, "room-r", p.bootstrap_endpoint), GW)
        h.run()
        assert h.tokens["r"] == expected.token_ids
        assert h.finish["r"].finish_reason == "length"
        assert p_room.state is PrefillState.DONE
        assert p.stats()["transfers_ok"] == d.stats()["transfers_ok"] == 2
        assert_pool_back(p, p_start, cached=True)
        assert_pool_back(d, d_start, cached=True)


def test_abort_room_before_prefill(model_dir: str) -> None:
    """The decode worker aborts a room whose Prefill has not reached the
    prefill worker: the held reservation is void, and the late Prefill is
    answered "abort" without computing anything."""
    prompt = list(range(10, 40))
    spec = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with pd_loops(model_dir) as (p, d):
        p_start, d_start = p.stats(), d.stats()
        h = Harness(p, d)
        h.tokens["r"] = []
        d.submit(Generate("r", prompt, spec, "room-r", p.bootstrap_endpoint), GW)
        h.step_until(lambda: "room-r" in p.unclaimed.reserves)
        d_room = d.rooms.get("room-r")
        assert d_room is not None
        d.abort("r")
        # The request ends now; its pages wait for the prefill worker's word.
        assert d_room.state is DecodeState.DRAINING
        assert d.stats()["free_pages"] < d_start["free_pages"]
        h.step_until(lambda: len(d.rooms) == 0)
        assert d_room.state is DecodeState.CLOSED
        assert h.finish["r"].finish_reason == "abort"
        assert "room-r" in p.unclaimed.cancelled and not p.unclaimed.reserves

        p.submit(Prefill("r", prompt, spec, "room-r", d.bootstrap_endpoint), GW)
        assert len(p.rooms) == 0 and not p.scheduler.has_work()
        h.run()
        assert h.p_deltas["r"] == [TokenDelta("r", [], [], "abort", 0)]
        s = p.stats()
        assert s["prefix_cache_query_tokens"] == 0  # never admitted to the scheduler
        assert s["transfers_ok"] == s["transfers_failed"] == 0
        assert_pool_back(p, p_start)
        assert_pool_back(d, d_start)


def test_abort_before_reserve_lands(model_dir: str) -> None:
    """The requester aborts a Prefill whose Reserve is already on its way: the
    late Reserve must not bring the aborted room back to compute."""
    prompt = list(range(10, 40))
    spec = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with pd_loops(model_dir) as (p, d):
        p_start, d_start = p.stats(), d.stats()
        h = Harness(p, d)
        h.tokens["r"] = []
        d.submit(Generate("r", prompt, spec, "room-r", p.bootstrap_endpoint), GW)
        h.step_until(lambda: p.kv.is_connected(d.bootstrap_endpoint))
        end = time.monotonic() + 10
        while not p.kv.has_pending():  # the Reserve waits in the prefill's socket
            assert time.monotonic() < end
            h.step_decode()
        p.submit(Prefill("r", prompt, spec, "room-r", d.bootstrap_endpoint), GW)
        p.abort("r")
        p_room = p.rooms.get("room-r")
        assert p_room is not None and p_room.state is PrefillState.ABORTED
        h.run()
        assert h.p_deltas["r"] == [TokenDelta("r", [], [], "abort", 0)]
        assert h.finish["r"].finish_reason == "abort"
        assert p.stats()["prefix_cache_query_tokens"] == 0
        assert_pool_back(p, p_start)
        assert_pool_back(d, d_start)


def test_decode_drops_dead_prefill(model_dir: str) -> None:
    """The prefill worker disappears mid-transfer. Decode fails the request as
    soon as the KV-plane connection drops, keeps its pages for one more
    timeout (a dropped connection does not prove the engine dead: a write
    could still land), then drops the peer and frees them."""
    timeout = 1.0
    p = PrefillLoop(
        worker_config(model_dir, "prefill", max_num_batched_tokens=8, transfer_timeout_s=timeout)
    )
    d = DecodeLoop(worker_config(model_dir, "decode", transfer_timeout_s=timeout))
    p_start, d_start = p.stats(), d.stats()
    spec = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    try:
        h = Harness(p, d)
        h.submit("r", list(range(10, 74)), spec)  # 64 tokens: 8 chunks

        def mid_transfer() -> bool:
            room = p.rooms.get("room-r")
            return room is not None and room.state is PrefillState.COMPUTING and room.sent_upto > 0

        h.step_until(mid_transfer)
        p_room = p.rooms.get("room-r")
        assert p_room is not None
        p.close()
        d_room = d.rooms.get("room-r")
        assert d_room is not None and d_room.state is DecodeState.TRANSFERRING
        t0 = time.monotonic()
        failed_at = None
        drained_with_pages = False
        while d.has_work():
            assert time.monotonic() - t0 < 4 * timeout + 5
            h.step_decode()
            if "r" in h.finish and d.rooms.get("room-r") is not None:
                failed_at = failed_at or time.monotonic()
                assert d_room.state is DecodeState.DRAINING
                drained_with_pages = d.stats()["free_pages"] < d_start["free_pages"]
        assert failed_at is not None and drained_with_pages
        assert time.monotonic() - failed_at >= 0.9 * timeout
        assert d_room.state is DecodeState.CLOSED
        assert h.finish["r"].finish_reason == "error"
        assert "KV-plane connection" in (h.finish["r"].error or "")
        assert failed_at - t0 < timeout
        assert d.stats()["transfers_failed"] == 1
        assert_pool_back(d, d_start)
        # The dead prefill worker held nothing but its room's pages.
        p_free = p.stats()["free_pages"]
        assert p_free + len(p_room.req.page_table) == p_start["free_pages"]
    finally:
        d.close()


def test_room_moves_are_checked() -> None:
    prefill = PrefillRoom("a", Request("a", [1], SamplingParams(), 0, 8), "d", 0.0)
    prefill.move(PrefillState.COMPUTING)
    prefill.move(PrefillState.SETTLING)
    with pytest.raises(RuntimeError, match="SETTLING to COMPUTING"):
        prefill.move(PrefillState.COMPUTING)
    prefill.move(PrefillState.ABORTED)
    with pytest.raises(RuntimeError):
        prefill.move(PrefillState.DONE)
    decode = DecodeRoom("b", Request("b", [1], SamplingParams(), 0, 8), "p", 0.0)
    with pytest.raises(RuntimeError, match="WAITING_PAGES to DRAINING"):
        decode.move(DecodeState.DRAINING)
    decode.move(DecodeState.TRANSFERRING)
    decode.move(DecodeState.DRAINING)
    with pytest.raises(RuntimeError):
        decode.move(DecodeState.DECODING)
    decode.move(DecodeState.CLOSED)
