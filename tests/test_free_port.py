"""``worker.processes.free_port``: ports a server can bind, picked below the
ephemeral range, where outgoing connections cannot take them first."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from worker import processes
from worker.processes import LOWEST_PORT, free_port


def _listen(port: int) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_free_ports_are_below_the_ephemeral_range_and_bind() -> None:
    low = processes._ephemeral_low()
    if low is None or low <= LOWEST_PORT + 1000:
        pytest.skip("no ephemeral range to stay below on this system")
    ports = {free_port() for _ in range(20)}
    assert all(LOWEST_PORT <= p < low for p in ports), sorted(ports)
    assert len(ports) > 1  # drawn, not one fixed port
    for p in ports:
        _listen(p).close()


def test_a_taken_port_is_skipped(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("40000\t60999\n")
    monkeypatch.setattr(processes, "EPHEMERAL_RANGE", ranges)
    held = _listen(0)
    try:
        taken = held.getsockname()[1]
        free = _listen(0)
        other = free.getsockname()[1]
        free.close()
        draws = iter([taken, other])
        monkeypatch.setattr(processes.random, "randrange", lambda a, b: next(draws))
        assert free_port() == other
    finally:
        held.close()


def test_without_a_known_range_the_system_picks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(processes, "EPHEMERAL_RANGE", tmp_path / "missing")
    monkeypatch.setattr(processes.random, "randrange", lambda a, b: pytest.fail("drew a port"))
    _listen(free_port()).close()
