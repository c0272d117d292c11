"""Where programmatic dependent launch is on (``engine.layers.pdl``): never
on the CPU, under Triton's interpreter, or on ROCm; and the launch options
kernels take either way."""

from __future__ import annotations

import pytest
import torch

from engine.layers import pdl


def test_off_on_the_cpu_and_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not pdl.enabled(torch.device("cpu"))
    assert pdl.launch_options(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setattr(pdl, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(pdl, "_triton_launches_it", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert pdl.enabled(torch.device("cuda", 0))
    assert pdl.launch_options(torch.device("cuda", 0)) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.enabled(torch.device("cuda", 0))


def test_off_before_compute_capability_9_and_on_rocm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(pdl, "_triton_launches_it", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(pdl, "_capability", lambda index: (8, 0))
    assert not pdl.enabled(torch.device("cuda", 0))
    monkeypatch.setattr(pdl, "_capability", lambda index: (9, 4))
    assert pdl.enabled(torch.device("cuda", 0))
    monkeypatch.setattr(torch.version, "cuda", None)
    assert not pdl.enabled(torch.device("cuda", 0))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(pdl, "_triton_launches_it", lambda: False)
    assert not pdl.enabled(torch.device("cuda", 0))


def test_the_decode_attentions_widened_v_follows_the_same_device_rule(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``paged_decode.widens`` reads the capability as PDL does: compute
    capability 8.9+ (the e4m3 conversion instruction), NVIDIA only, never
    under the interpreter or on the CPU."""
    from engine.attention import paged_decode

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(pdl, "_capability", lambda index: (8, 0))
    assert not paged_decode.widens(cuda)
    monkeypatch.setattr(pdl, "_capability", lambda index: (8, 9))
    assert paged_decode.widens(cuda) and not pdl.enabled(cuda)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not paged_decode.widens(cuda)
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(torch.version, "cuda", None)
    assert not paged_decode.widens(cuda)
    assert not paged_decode.widens(torch.device("cpu"))


def test_prefetch_spans_stay_within_the_budget_rows_and_lines() -> None:
    """``prefetch_bytes``: the same first bytes of every row's span, whole L2
    lines, never past the span, all rows together within the budget; none
    where a row's share is under a line, and none by default."""
    line = pdl.PREFETCH_LINE
    assert pdl.PREFETCH_BYTES == 0 and pdl.prefetch_bytes(96 * 64, 4096) == 0
    for rows, span, budget in [(96 * 64, 4096, 16 << 20), (224 * 128, 4096, 16 << 20),
                               (64 * 64, 4096, 16 << 20), (6144, 8192, 8 << 20),
                               (128 * 64, 7168, 1 << 30), (2004 * 64, 4096, 16 << 20)]:  # fmt: skip
        got = pdl.prefetch_bytes(rows, span, budget)
        assert got % line == 0 and 0 <= got <= span
        assert rows * got <= budget
        if got == 0:
            assert budget // rows < line
        else:  # the largest whole-line share: one line more would pass a bound
            assert got == span or rows * (got + line) > budget
    assert pdl.prefetch_bytes(64 * 64, 4096, 16 << 20) == 4096  # o: the whole weight
    assert pdl.prefetch_bytes(96 * 64, 4096, 16 << 20) == 2688  # qkv: its first 2688 of 4096


def test_prefetching_programs_are_the_first_within_the_budget() -> None:
    """``prefetch_programs``: the most whole spans of the first programs
    within the budget, never more programs than the launch has; none by
    default."""
    assert pdl.prefetch_programs(6144, 8192) == 0
    assert pdl.prefetch_programs(6144, 8192, 16 << 20) == 2048  # QKV's first third
    assert pdl.prefetch_programs(2048, 8192, 16 << 20) == 2048  # o: all of it
    assert pdl.prefetch_programs(8016, 16 * 8192, 16 << 20) == 128  # the LM head's first rows
    assert pdl.prefetch_programs(10, 1 << 20, 1 << 19) == 0


def test_the_routing_prefetches_the_chosen_experts_first_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``moe_route.expert_rows``: two spans a pair (the first gate rows, the
    first up rows) within the budget and within a half of the expert's
    rows; none by default, nor where a pair's share is under a line."""
    from engine.layers import moe_route

    w13 = torch.empty(128, 2 * 768, 2048, dtype=torch.bfloat16)
    half = 768 * 2048 * 2
    assert moe_route.expert_rows(w13, 8) == {}
    monkeypatch.setattr(pdl, "PREFETCH_BYTES", 16 << 20)
    got = moe_route.expert_rows(w13, 8)
    assert got["w13"] is w13 and got["stride_we"] == 2 * 768 * 2048
    assert got["up_offset"] == 768 * 2048  # elements from a gate row to its up row
    assert got["PREFETCH"] == 1 << 20 and 2 * 8 * got["PREFETCH"] <= 16 << 20 < half * 16
    assert moe_route.expert_rows(w13, 2)["PREFETCH"] == half  # a few pairs: the whole halves
    assert moe_route.expert_rows(w13, (16 << 20) // 2 // 64 + 1) == {}
