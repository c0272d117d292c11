"""The scheduler on its own, over the tiny model on CPU: who gets the token
budget first, the per-request chunk cap, the fallback after a starved
overlapped schedule, which request is retracted when the pool runs dry, and
the hand-over methods the disaggregated loops use."""

from __future__ import annotations

from typing import Any

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.request import Request
from engine.scheduler import ScheduledBatch
from protocol.sampling import SamplingParams

SPEC = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def make_engine(model_dir: str, **kw: Any) -> Engine:
    base: dict[str, Any] = dict(
        model=model_dir,
        device="cpu",
        page_size=4,
        num_pages=64,
        max_num_batched_tokens=64,
        enable_prefix_cache=False,
    )
    base.update(kw)
    return Engine(EngineConfig(**base))


def add(engine: Engine, rid: str, n_prompt: int) -> Request:
    req = engine.build_request(rid, [10 + i for i in range(n_prompt)], SPEC)
    engine.scheduler.add(req)
    return req


def step(engine: Engine) -> ScheduledBatch | None:
    """Schedule and run one batch without overlap; the batch it ran."""
    batch = engine.scheduler.schedule()
    if batch is not None:
        engine.finish(engine.launch_batch(batch))
    return batch


def shape(batch: ScheduledBatch | None) -> list[tuple[str, int]]:
    """(rid, tokens run) of each request in the batch, in batch order."""
    assert batch is not None
    return [(r.rid, n) for r, n in zip(batch.requests, batch.extend_lens)]


def test_budget_goes_to_decodes_then_prefills_then_admissions(model_dir: str) -> None:
    engine = make_engine(model_dir, max_num_batched_tokens=5, chunk_size=4)
    add(engine, "long", 20)
    add(engine, "short", 5)
    add(engine, "late", 6)
    # Admission is FIFO and takes what the budget leaves.
    assert shape(step(engine)) == [("long", 4), ("short", 1)]
    for _ in range(3):
        assert shape(step(engine)) == [("long", 4), ("short", 1)]
    # "short" is about to sample: its token goes before the older request's
    # prefill chunk, and nothing is left for the waiting request.
    batch = step(engine)
    assert shape(batch) == [("short", 1), ("long", 4)]
    assert [r.rid for r in engine.scheduler.waiting] == ["late"]
    # Both decode now (one token each); the admission gets the remaining 3.
    assert shape(step(engine)) == [("long", 1), ("short", 1), ("late", 3)]


def test_chunk_cap_per_request(model_dir: str) -> None:
    engine = make_engine(model_dir, max_num_batched_tokens=64, chunk_size=7)
    add(engine, "a", 30)
    add(engine, "b", 10)
    # The budget would fit both prompts; each request still runs at most 7.
    batch = step(engine)
    assert shape(batch) == [("a", 7), ("b", 7)]
    assert batch is not None and batch.sample_requests == []
    batch = step(engine)
    assert shape(batch) == [("a", 7), ("b", 3)]
    assert batch is not None and [r.rid for r in batch.sample_requests] == ["b"]
    assert shape(step(engine)) == [("b", 1), ("a", 7)]


def test_starved_overlap_falls_back_to_a_plain_step(model_dir: str) -> None:
    # 5 pages: two 8-token prompts take 4; the first decode token of each
    # needs a third page, and only one is left.
    engine = make_engine(model_dir, num_pages=6)
    sched = engine.scheduler
    a, b = add(engine, "a", 8), add(engine, "b", 8)
    inflight, results = engine.overlap_step(None)
    assert inflight is not None and results == []
    assert shape(inflight.batch) == [("a", 8), ("b", 8)]
    # Built while the prefill runs: "a" gets the last page; "b" cannot, and
    # nothing may be retracted while a batch is in flight.
    inflight, results = engine.overlap_step(inflight)
    assert inflight is not None and shape(inflight.batch) == [("a", 1)]
    assert sched.starved
    assert sched.num_retracted == 0 and sched.running == [a, b] and len(b.page_table) == 2
    assert [r.rid for r in results] == ["a", "b"]
    # After a starved schedule nothing new is launched: the batch in flight
    # finishes alone...
    inflight, results = engine.overlap_step(inflight)
    assert inflight is None and not sched.starved
    assert [r.rid for r in results] == ["a"]
    # ...so the next schedule runs without overlap, where retraction may free
    # pages: "b" (no older request to take from) gives its own back.
    inflight, results = engine.overlap_step(None)
    assert inflight is not None and shape(inflight.batch) == [("a", 1)]
    assert sched.num_retracted == 1 and list(sched.waiting) == [b] and b.page_table == []


def test_retraction_takes_the_newest_request_not_in_the_batch(model_dir: str) -> None:
    # 6 pages: three 8-token prompts take them all; each first decode token
    # needs one more page.
    engine = make_engine(model_dir, num_pages=7)
    sched = engine.scheduler
    a, b, c = add(engine, "a", 8), add(engine, "b", 8), add(engine, "c", 8)
    assert shape(step(engine)) == [("a", 8), ("b", 8), ("c", 8)]
    assert engine.runner.pool.allocator.num_free == 0
    # "a" needs a page: the newest running request, "c", is retracted; its two
    # pages serve "a" and then "b".
    assert shape(step(engine)) == [("a", 1), ("b", 1)]
    assert sched.num_retracted == 1
    assert sched.running == [a, b] and list(sched.waiting) == [c]
    assert c.page_table == [] and c.num_computed == 0
    assert c.num_output == 1  # recomputed with its token when it is back
    assert len(a.page_table) == len(b.page_table) == 3


def test_detach_keeps_pages_and_admit_prefilled_decodes(model_dir: str) -> None:
    engine = make_engine(model_dir, max_num_batched_tokens=4)
    sched = engine.scheduler
    free = engine.runner.pool.allocator.num_free
    mid, queued = add(engine, "mid", 8), add(engine, "queued", 8)
    assert shape(step(engine)) == [("mid", 4)]
    assert sched.detach(mid) and sched.detach(queued)
    assert not sched.detach(mid)
    assert not sched.has_work() and len(mid.page_table) == 1
    sched.release(mid)
    # A request whose prompt KV another engine wrote into reserved pages
    # decodes from its first token on.
    req = engine.build_request("remote", [10 + i for i in range(8)], SPEC)
    assert sched.reserve_prompt(req) and len(req.page_table) == 2
    req.num_computed = len(req.fill_ids)
    req.fill_ids.append(7)
    sched.admit_prefilled(req)
    assert sched.running == [req]
    assert shape(step(engine)) == [("remote", 1)]
    assert req.num_output == 2
    sched.abort("remote")
    assert engine.runner.pool.allocator.num_free == free


def add_long(engine: Engine, rid: str, n_prompt: int) -> None:
    engine.scheduler.add(engine.build_request(rid, [3 + i % 500 for i in range(n_prompt)], SPEC))


def test_prefill_beside_decodes_is_capped_by_the_load(model_dir: str) -> None:
    def run(per_request: int, floor: int = 256) -> list[tuple[str, int]]:
        engine = make_engine(
            model_dir,
            num_pages=400,
            max_num_batched_tokens=2048,
            prefill_per_request=per_request,
            prefill_floor=floor,
        )
        add(engine, "a", 5)
        assert shape(step(engine)) == [("a", 5)]
        add_long(engine, "b", 600)
        add_long(engine, "c", 600)
        return shape(step(engine))

    # Two requests admitted or waiting beside one decoding: the cap is the floor
    # of 256 tokens (max(256, 1 x 3)), split between the prompts in order.
    assert run(1) == [("a", 1), ("b", 256)]
    assert run(200) == [("a", 1), ("b", 600)]  # max(256, 200 x 3) = 600
    assert run(1, floor=1000) == [("a", 1), ("b", 600), ("c", 400)]  # the floor, 1000
    # Off: only the token budget limits the prefill.
    assert run(0) == [("a", 1), ("b", 600), ("c", 600)]


def test_prefill_cap_needs_a_decoding_request(model_dir: str) -> None:
    engine = make_engine(
        model_dir, num_pages=400, max_num_batched_tokens=2048, prefill_per_request=1
    )
    add_long(engine, "b", 600)
    add_long(engine, "c", 600)
    assert shape(step(engine)) == [("b", 600), ("c", 600)]


def test_prefill_settings_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError, match="prefill_floor must be >= 1"):
        EngineConfig(prefill_floor=0)
    with pytest.raises(ValueError, match="prefill_per_request must be >= 0"):
        EngineConfig(prefill_per_request=-1)
