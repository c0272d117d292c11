"""The gateway's busy polling: its event loop spins while requests are in
flight and for the linger after the last one, then sleeps again."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.__main__ import build_parser
from gateway.busy_poll import MAX_IN_FLIGHT, BusyPoller
from gateway.config import GatewayConfig


async def _cpu_over(seconds: float) -> float:
    t0 = time.process_time()
    await asyncio.sleep(seconds)
    return time.process_time() - t0


def test_spins_while_in_flight_and_for_the_linger() -> None:
    async def scenario() -> None:
        poller = BusyPoller(0.3)
        poller.begin()
        poller.begin()
        assert poller.spinning
        # The loop never sleeps: this process takes most of a core.
        assert await _cpu_over(0.2) >= 0.1
        poller.end()
        await asyncio.sleep(0.4)
        assert poller.spinning, "one request is still in flight"
        poller.end()
        await asyncio.sleep(0.1)
        assert poller.spinning, "stopped before the linger ended"
        await asyncio.sleep(0.3)
        assert not poller.spinning
        assert await _cpu_over(0.2) <= 0.05
        poller.begin()  # a later request starts it again
        assert poller.spinning
        await poller.stop()
        assert not poller.spinning

    asyncio.run(scenario())


def test_zero_linger_never_spins() -> None:
    async def scenario() -> None:
        poller = BusyPoller(0)
        poller.begin()
        assert not poller.spinning
        assert await _cpu_over(0.2) <= 0.05
        poller.end()

    asyncio.run(scenario())


def test_configuration() -> None:
    with pytest.raises(ValueError, match="busy_poll_s"):
        GatewayConfig(busy_poll_s=-1)
    assert GatewayConfig(busy_poll_s=0.5).busy_poll_linger_s == 0.5
    parser = build_parser()
    assert parser.parse_args([]).busy_poll_s is None
    assert parser.parse_args(["--busy-poll-s", "auto"]).busy_poll_s is None
    assert parser.parse_args(["--busy-poll-s", "0"]).busy_poll_s == 0.0
    with pytest.raises(SystemExit):
        parser.parse_args(["--busy-poll-s", "-1"])


def test_auto_needs_cores_to_spare(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda _: set(range(16)))
    assert GatewayConfig().busy_poll_linger_s == 1.0
    monkeypatch.setattr("os.sched_getaffinity", lambda _: {0, 1})
    assert GatewayConfig().busy_poll_linger_s == 0.0


def test_stops_under_load_and_resumes_below_it() -> None:
    async def scenario() -> None:
        poller = BusyPoller(0.3)
        for _ in range(MAX_IN_FLIGHT + 1):
            poller.begin()
        await asyncio.sleep(0.05)
        assert not poller.spinning, "spins with more than MAX_IN_FLIGHT requests"
        assert await _cpu_over(0.2) <= 0.05
        poller.end()
        assert poller.spinning
        for _ in range(MAX_IN_FLIGHT):
            poller.end()
        await poller.stop()

    asyncio.run(scenario())
