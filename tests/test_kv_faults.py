"""The tcp KV channel's fault hook (``kvtransfer.faults``, used by the fault
matrix) and what it showed: a transfer whose data message is lost fails
within the backend's timeout even while other transfers to the same peer
make progress."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from kvtransfer.backend import ByteRange, TransferState
from kvtransfer.faults import FAULT_FILE_ENV, FaultHook
from kvtransfer.tcp import TcpBackend

TOKEN = "kv-faults-secret"
TIMEOUT_S = 1.0
PAGE = 256


def _pair(monkeypatch: pytest.MonkeyPatch, fault_file: Path) -> tuple[TcpBackend, TcpBackend]:
    monkeypatch.setenv(FAULT_FILE_ENV, str(fault_file))
    src = torch.arange(16 * PAGE, dtype=torch.int32).to(torch.uint8).reshape(16, PAGE).clone()
    writer = TcpBackend("writer", timeout=TIMEOUT_S, cluster_token=TOKEN)
    monkeypatch.delenv(FAULT_FILE_ENV)
    receiver = TcpBackend("receiver", timeout=TIMEOUT_S, cluster_token=TOKEN)
    writer.register(src)
    receiver.register(torch.zeros(16, PAGE, dtype=torch.uint8))
    writer.connect("receiver", receiver.metadata())
    return writer, receiver


def _wait(backend: TcpBackend, handle: int, timeout: float = 10.0) -> TransferState:
    deadline = time.monotonic() + timeout
    while (state := backend.poll(handle)) is TransferState.PENDING:
        assert time.monotonic() < deadline, "transfer neither done nor failed"
        time.sleep(0.005)
    return state


def _page(i: int) -> list[ByteRange]:
    return [ByteRange(i * PAGE, i * PAGE, PAGE)]


def test_hook_reads_commands_and_rearms(tmp_path: Path) -> None:
    path = tmp_path / "fault"
    hook = FaultHook(str(path))
    assert not hook.next_message().drop  # no file: no fault
    path.write_text("drop 2")
    time.sleep(0.06)  # the file is looked at every 50 ms
    assert [hook.next_message().drop for _ in range(3)] == [True, True, False]
    path.write_text("delay 0.25")
    time.sleep(0.06)
    assert hook.next_message().delay_s == 0.25
    path.write_text("off")
    time.sleep(0.06)
    assert hook.next_message() == FaultHook(str(tmp_path / "none")).next_message()


def test_delayed_message_still_lands(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fault = tmp_path / "fault"
    fault.write_text("delay 0.3")
    writer, receiver = _pair(monkeypatch, fault)
    try:
        t0 = time.monotonic()
        assert _wait(writer, writer.write("receiver", _page(0))) is TransferState.DONE
        assert time.monotonic() - t0 >= 0.3
    finally:
        writer.close()
        receiver.close()


def test_lost_message_fails_its_transfer_while_others_progress(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A transfer whose data message was lost is never acknowledged: it must
    fail within the timeout (so its source pages come back), even though
    other transfers to the same peer keep being acknowledged all along."""
    fault = tmp_path / "fault"
    fault.write_text("drop 1")
    writer, receiver = _pair(monkeypatch, fault)
    try:
        time.sleep(0.06)
        t0 = time.monotonic()
        lost = writer.write("receiver", _page(0))
        state = TransferState.PENDING
        i = 1
        while state is TransferState.PENDING and time.monotonic() - t0 < 4 * TIMEOUT_S:
            # Steady traffic to the same peer, every transfer of it delivered.
            assert _wait(writer, writer.write("receiver", _page(i % 16))) is TransferState.DONE
            i += 1
            state = writer.poll(lost)
            time.sleep(0.05)
        assert state is TransferState.FAILED, "the lost transfer never failed"
        assert time.monotonic() - t0 < TIMEOUT_S + 1.0
        assert "no progress" in (writer.last_error or ""), writer.last_error
        # The channel still works afterwards.
        assert _wait(writer, writer.write("receiver", _page(3))) is TransferState.DONE
    finally:
        writer.close()
        receiver.close()
