"""The nccl transfer backend through its gloo twin, both ends in this process:
pairing and its refusals, staging against in-place ranges, and the failure
contract (a write that cannot land fails within the timeout, its pair is
aborted on both sides and the next write builds a new one; a closed writer's
pair is released by the receiver). Two real processes, worker restarts and
the P/D paths are in test_kvtransfer_backends.py and test_pd_e2e.py."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvtransfer.backend import ByteRange, TransferState
from kvtransfer.endpoint import PEER_HEARTBEAT_TIMEOUT_S
from kvtransfer.faults import FAULT_FILE_ENV
from kvtransfer.nccl import NcclBackend
from kvtransfer.nccl.channel import STAGE_BELOW_BYTES, Span, gather, scatter, staged

TOKEN = "kv-nccl-secret"
TIMEOUT_S = 2.0
PAGES, PAGE = 16, 4096


def _source() -> torch.Tensor:
    return torch.arange(PAGES * PAGE, dtype=torch.int32).to(torch.uint8).reshape(PAGES, PAGE)


def _wait(backend: NcclBackend, handle: int, timeout: float = 15.0) -> TransferState:
    deadline = time.monotonic() + timeout
    while (state := backend.poll(handle)) is TransferState.PENDING:
        assert time.monotonic() < deadline, "transfer neither done nor failed"
        time.sleep(0.002)
    return state


def _pages(*pages: int) -> list[ByteRange]:
    return [ByteRange(p * PAGE, p * PAGE, PAGE) for p in pages]


class Ends:
    def __init__(self, writer: NcclBackend, receiver: NcclBackend, dst: torch.Tensor) -> None:
        self.writer, self.receiver, self.dst = writer, receiver, dst

    def write(self, ranges: list[ByteRange]) -> TransferState:
        return _wait(self.writer, self.writer.write("receiver", ranges))


def _ends(monkeypatch: pytest.MonkeyPatch, fault_file: Path | None = None) -> Ends:
    if fault_file is not None:
        monkeypatch.setenv(FAULT_FILE_ENV, str(fault_file))
    writer = NcclBackend("writer", timeout=TIMEOUT_S, cluster_token=TOKEN)
    monkeypatch.delenv(FAULT_FILE_ENV, raising=False)
    receiver = NcclBackend("receiver", timeout=TIMEOUT_S, cluster_token=TOKEN)
    dst = torch.zeros(PAGES, PAGE, dtype=torch.uint8)
    writer.register(_source())
    receiver.register(dst)
    writer.connect("receiver", receiver.metadata())
    return Ends(writer, receiver, dst)


@pytest.fixture
def ends(monkeypatch: pytest.MonkeyPatch) -> Iterator[Ends]:
    e = _ends(monkeypatch)
    try:
        yield e
    finally:
        e.writer.close()
        e.receiver.close()


def test_pages_land_in_place_and_pairs_are_reused(ends: Ends) -> None:
    assert ends.write(_pages(3, 4, 9)) is TransferState.DONE
    src = _source()
    for p in range(PAGES):
        want = src[p] if p in (3, 4, 9) else torch.zeros(PAGE, dtype=torch.uint8)
        assert torch.equal(ends.dst[p], want), p
    pair = ends.writer._pairs["receiver"]
    assert ends.write(_pages(1)) is TransferState.DONE
    assert ends.writer._pairs["receiver"] is pair, "a healthy pair is cached"
    assert torch.equal(ends.dst[1], src[1])


def test_many_small_ranges_go_through_staging(ends: Ends) -> None:
    """Head-slice-like ranges (64 bytes each, scattered): one staged message,
    scattered into place by the receiver."""
    rows = [
        ByteRange(p * PAGE + 128 * r, ((p + 7) % PAGES) * PAGE + 64 * r, 64)
        for p in range(4)
        for r in range(8)
    ]
    assert staged([Span(r.dst_offset, r.nbytes) for r in rows])
    assert ends.write(rows) is TransferState.DONE
    flat_src, flat_dst = _source().reshape(-1), ends.dst.reshape(-1)
    expect = torch.zeros_like(flat_dst)
    for r in rows:
        expect[r.dst_offset : r.dst_offset + r.nbytes] = flat_src[
            r.src_offset : r.src_offset + r.nbytes
        ]
    assert torch.equal(flat_dst, expect)


def test_gather_scatter_round_trip_and_threshold() -> None:
    buf = torch.arange(1000, dtype=torch.int32).to(torch.uint8)
    spans = [Span(10, 5), Span(500, 7), Span(3, 2)]
    packed = gather(buf, spans)
    assert packed.tolist() == buf[10:15].tolist() + buf[500:507].tolist() + buf[3:5].tolist()
    out = torch.zeros_like(buf)
    scatter(out, spans, packed)
    for s in spans:
        assert torch.equal(out[s.offset : s.offset + s.nbytes], buf[s.offset : s.offset + s.nbytes])
    assert not staged([Span(0, 1)]), "one range is sent as it is"
    assert not staged([Span(0, STAGE_BELOW_BYTES), Span(STAGE_BELOW_BYTES, STAGE_BELOW_BYTES)])


def test_wrong_cluster_token_cannot_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    receiver = NcclBackend("receiver", timeout=TIMEOUT_S, cluster_token=TOKEN)
    rogue = NcclBackend("rogue", timeout=TIMEOUT_S, cluster_token="wrong")
    try:
        dst = torch.zeros(PAGES, PAGE, dtype=torch.uint8)
        receiver.register(dst)
        rogue.register(_source())
        rogue.connect("receiver", receiver.metadata())
        assert _wait(rogue, rogue.write("receiver", _pages(2))) is TransferState.FAILED
        assert "handshake" in (rogue.last_error or ""), rogue.last_error
        assert not dst.any(), "a refused writer changed the destination"
        assert not receiver._receiver.pairs
    finally:
        rogue.close()
        receiver.close()


def test_reregistered_receiver_refuses_stale_metadata_then_pairs_anew(ends: Ends) -> None:
    assert ends.write(_pages(1)) is TransferState.DONE
    old = ends.receiver.metadata()
    ends.receiver.register(ends.dst)  # a restart: new incarnation token, new endpoint
    # The writer still holds the old metadata: its pair is gone with the old
    # control socket, and a new pair offered to the old incarnation fails.
    state = ends.write(_pages(2))
    assert state is TransferState.FAILED
    ends.writer.connect("receiver", ends.receiver.metadata())
    assert ends.receiver.metadata() != old
    assert ends.write(_pages(5)) is TransferState.DONE
    assert torch.equal(ends.dst[5], _source()[5])


def test_lost_data_fails_within_timeout_and_next_write_builds_a_new_pair(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fault = tmp_path / "fault"
    fault.write_text("drop 1")
    e = _ends(monkeypatch, fault)
    try:
        t0 = time.monotonic()
        assert e.write(_pages(0)) is TransferState.FAILED
        assert time.monotonic() - t0 < TIMEOUT_S + 1.5
        first = e.writer._pairs.get("receiver")
        assert first is None or first.dead is not None, "the failed pair was aborted"
        # The receiver aborted its end too (or the writer's Unpair did).
        deadline = time.monotonic() + 5
        while any(not p.dead for p in e.receiver._receiver.pairs.values()):
            assert time.monotonic() < deadline, "the receiver kept the failed pair"
            time.sleep(0.01)
        assert not e.dst[0].any(), "bytes of an aborted write landed"
        assert e.write(_pages(6)) is TransferState.DONE
        assert e.writer._pairs["receiver"] is not first
        assert torch.equal(e.dst[6], _source()[6])
    finally:
        e.writer.close()
        e.receiver.close()


def test_delayed_data_still_lands(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fault = tmp_path / "fault"
    fault.write_text("delay 0.3")
    e = _ends(monkeypatch, fault)
    try:
        time.sleep(0.06)
        t0 = time.monotonic()
        assert e.write(_pages(8)) is TransferState.DONE
        assert time.monotonic() - t0 >= 0.3
        assert torch.equal(e.dst[8], _source()[8])
    finally:
        e.writer.close()
        e.receiver.close()


def test_receiver_releases_the_pair_of_a_closed_writer(ends: Ends) -> None:
    assert ends.write(_pages(1)) is TransferState.DONE
    assert len(ends.receiver._receiver.pairs) == 1
    ends.writer.close()
    deadline = time.monotonic() + PEER_HEARTBEAT_TIMEOUT_S + 3
    while any(not p.dead for p in ends.receiver._receiver.pairs.values()):
        assert time.monotonic() < deadline, "the receiver kept a closed writer's pair"
        time.sleep(0.02)
