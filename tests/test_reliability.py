"""Reliability, without worker processes: authenticated planes (a rogue
request-plane client and a rogue KV writer are refused), liveness (a paused or
killed peer is noticed within seconds, a known-dead worker fails a request at
once), the end of a room whose prefill worker is lost, routing that returns to
a recovered worker, and admission control."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator

import msgspec
import pytest
import torch
import zmq
import zmq.asyncio

from gateway.admission import Admission, AdmissionConfig, Overloaded
from gateway.dispatch import merge_prefill_decode
from gateway.routing import CircuitBreaker, Router, RouterConfig, WorkerInfo
from kvtransfer.backend import ByteRange, TransferState
from kvtransfer.tcp import TcpBackend, _Begin, _Data, _Hello, _Reply
from protocol import to_worker
from protocol.auth import keys_for, secure_client, secure_server
from protocol.client import WorkerClient, WorkerDisconnected, WorkerUnreachable
from protocol.finish import FinishReason
from protocol.sampling import SamplingParams
from protocol.to_gateway import TokenDelta
from protocol.to_worker import Generate
from worker.processes import free_port

TOKEN = "reliability-secret"
SPEC = SamplingParams(max_tokens=4, temperature=0.0)


def run(coro) -> None:  # noqa: ANN001
    asyncio.run(coro)


# -- the request plane: CURVE keys from the cluster token -------------------------


def _router(token: str | None) -> tuple[zmq.Socket, str]:
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.linger = 0
    secure_server(sock, keys_for(token))
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    return sock, f"tcp://127.0.0.1:{port}"


@pytest.mark.parametrize("rogue_token", [None, "not-the-token"], ids=["no-keys", "wrong-token"])
def test_rogue_request_plane_client_is_refused(rogue_token: str | None) -> None:
    """A peer without the cluster token gets no message through to a worker's
    request plane (its handshake fails inside libzmq); one with it does."""
    server, endpoint = _router(TOKEN)
    ctx = zmq.Context.instance()
    rogue, good = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        for sock, token in ((rogue, rogue_token), (good, TOKEN)):
            sock.linger = 0
            secure_client(sock, keys_for(token))
            sock.connect(endpoint)
        frame = to_worker.encoder.encode(Generate("r1", [1, 2, 3], SPEC))
        rogue.send(frame)
        good.send(frame)
        assert server.poll(5000), "the legitimate peer's message never arrived"
        _, got = server.recv_multipart()
        assert got == frame
        # The rogue's message never shows up, however long we wait.
        assert not server.poll(1500), "a peer without the cluster token got through"
    finally:
        for sock in (rogue, good, server):
            sock.close(0)


def test_client_reports_a_token_mismatch_quickly() -> None:
    async def go() -> None:
        server, endpoint = _router(TOKEN)
        try:
            async with WorkerClient(
                endpoint, timeout_s=5, connect_timeout_s=1.0, auth=keys_for("other")
            ) as client:
                with pytest.raises(WorkerUnreachable, match="within 1s"):
                    async for _ in client.generate(Generate("r", [1], SPEC)):
                        pass
        finally:
            server.close(0)

    run(go())


def test_abort_before_the_connection_is_up_never_sends_the_request() -> None:
    """A request aborted while it waits for the connection ends with an
    "abort" delta at once and never reaches the worker (which would otherwise
    run it after dropping the Abort as one for an unknown request)."""
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"

    async def go() -> None:
        server = zmq.Context.instance().socket(zmq.ROUTER)
        server.linger = 0
        secure_server(server, keys_for(TOKEN))
        try:
            async with WorkerClient(
                endpoint, timeout_s=5, connect_timeout_s=30.0, auth=keys_for(TOKEN)
            ) as client:
                got: list[TokenDelta] = []

                async def consume(rid: str) -> None:
                    async for d in client.generate(Generate(rid, [1], SPEC)):
                        got.append(d)

                # Nothing listens yet: "early" waits for the connection.
                early = asyncio.create_task(consume("early"))
                while "early" not in client._unsent:
                    await asyncio.sleep(0.01)
                t0 = time.monotonic()
                await client.abort("early")
                await asyncio.wait_for(early, 5)
                assert time.monotonic() - t0 < 1.0
                assert [(d.rid, d.finish_reason) for d in got] == [("early", "abort")]
                # Once the worker is up, the first message it gets is the next
                # request's: neither "early" nor its Abort was sent.
                server.bind(endpoint)
                later = asyncio.create_task(consume("later"))
                rids = []
                t0 = time.monotonic()
                while "later" not in rids and time.monotonic() - t0 < 10:
                    if server.poll(0):
                        msg = to_worker.decoder.decode(server.recv_multipart()[1])
                        rids.append(getattr(msg, "rid", type(msg).__name__))
                    await asyncio.sleep(0.01)
                assert [r for r in rids if r != "Heartbeat"] == ["later"], rids
                later.cancel()
        finally:
            server.close(0)

    run(go())


# -- liveness ---------------------------------------------------------------------

_PEER = textwrap.dedent(
    """
    import sys, zmq
    from protocol.auth import keys_for, secure_server
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    secure_server(sock, keys_for(sys.argv[1]))
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    print(port, flush=True)
    while True:
        sock.recv_multipart()
    """
)


def _peer_process() -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _PEER, TOKEN],
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    return proc, f"tcp://127.0.0.1:{port}"


@pytest.mark.parametrize("fault", ["pause", "kill"])
def test_lost_worker_is_noticed_within_seconds(fault: str) -> None:
    """A worker that is paused (SIGSTOP: its TCP connection stays open) or
    killed drops out within ~2 s by ZMTP heartbeats; afterwards a request
    fails at once instead of waiting the connect timeout."""

    async def go() -> None:
        proc, endpoint = _peer_process()
        events: list[tuple[float, bool]] = []
        try:
            client = WorkerClient(
                endpoint,
                timeout_s=30,
                connect_timeout_s=10,
                auth=keys_for(TOKEN),
                on_connection=lambda up, _: events.append((time.monotonic(), up)),
            )
            async with client:
                deadline = time.monotonic() + 10
                while not client.connected:
                    assert time.monotonic() < deadline, "never connected"
                    await asyncio.sleep(0.02)
                t0 = time.monotonic()
                os.kill(proc.pid, signal.SIGSTOP if fault == "pause" else signal.SIGKILL)
                while not client.lost:
                    assert time.monotonic() - t0 < 4.0, "the lost worker went unnoticed"
                    await asyncio.sleep(0.02)
                assert events[-1][1] is False and events[-1][0] - t0 < 3.0
                t1 = time.monotonic()
                with pytest.raises(WorkerUnreachable, match="is down"):
                    async for _ in client.generate(Generate("r", [1], SPEC)):
                        pass
                assert time.monotonic() - t1 < 0.5, "waited a connect timeout for a dead worker"
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)

    run(go())


# -- a room whose prefill worker is lost after its first token ----------------------


async def _prefill_then_silence(lost: asyncio.Event) -> AsyncIterator[TokenDelta]:
    # The connection drops a moment after the first token went out.
    asyncio.get_running_loop().call_later(0.1, lost.set)
    yield TokenDelta("r", [7], [-0.1], FinishReason.PREFILL_DONE)


async def _decode_never_answers() -> AsyncIterator[TokenDelta]:
    await asyncio.sleep(60)
    yield TokenDelta("r", [8], [-0.1], "length")


def test_prefill_loss_after_its_token_ends_the_request_at_once() -> None:
    """Prefill's only delta is out but its KV has not reached decode; its
    connection drops: the request ends now, not at decode's transfer timeout."""

    async def go() -> None:
        lost = asyncio.Event()
        got: list[TokenDelta] = []
        t0 = time.monotonic()
        with pytest.raises(WorkerDisconnected, match="lost before"):
            async for delta, _ in merge_prefill_decode(
                _prefill_then_silence(lost), _decode_never_answers(), lambda: lost, "p0"
            ):
                got.append(delta)
        assert [d.token_ids for d in got] == [[7]]
        assert time.monotonic() - t0 < 1.0

    run(go())


# -- routing that returns ------------------------------------------------------------


def test_half_open_breaker_gets_the_trial_request() -> None:
    """A worker whose breaker went half-open gets the next request even when
    the policy would send it elsewhere (its cache is empty, others have the
    prompt cached); its success closes the breaker."""
    now = [0.0]
    router = Router(
        RouterConfig(
            prefill_policy="cache_aware", breaker_failure_threshold=1, breaker_cooldown_s=5
        ),
        clock=lambda: now[0],
    )
    a = router.add(WorkerInfo(url="http://p0", role="prefill"))
    b = router.add(WorkerInfo(url="http://p1", role="prefill"))
    ids = list(range(64))
    router.begin(b, 1)
    router.end(b, 1, ok=False)  # b's breaker opens
    assert b.breaker.state == CircuitBreaker.OPEN
    for _ in range(3):
        assert router.pick_prefill(ids) is a
    now[0] = 10.0
    assert b.breaker.state == CircuitBreaker.HALF_OPEN
    assert router.pick_prefill(ids) is b  # the trial
    router.begin(b, 64)
    assert router.pick_prefill(ids) is a  # one trial at a time
    router.end(b, 64, ok=True)
    assert b.breaker.state == CircuitBreaker.CLOSED


def test_restart_and_passive_health() -> None:
    router = Router(RouterConfig(breaker_failure_threshold=1))
    w = router.add(WorkerInfo(url="http://d0", role="decode"))
    router.begin(w, 1)
    router.end(w, 1, ok=False)
    assert w.breaker.state == CircuitBreaker.OPEN
    router.restarted(w)  # a new process: the old one's failures say nothing
    assert w.breaker.state == CircuitBreaker.CLOSED
    router.mark_down(w, "connection dropped")
    assert not w.healthy and w.last_error == "connection dropped"
    assert router.pick_decode([1]) is None


# -- admission ---------------------------------------------------------------------


def test_admission_queues_within_bounds_and_refuses_beyond() -> None:
    async def go() -> None:
        adm = Admission(
            AdmissionConfig(max_concurrent_requests=2, max_queued_tokens=100, max_queue_wait_s=5)
        )
        await adm.acquire(10)
        await adm.acquire(10)
        waiter = asyncio.create_task(adm.acquire(60))
        await asyncio.sleep(0.05)
        assert adm.queued == 1 and adm.queued_tokens == 60
        with pytest.raises(Overloaded) as e:
            await adm.acquire(50)  # 60 + 50 > 100 queued tokens
        assert e.value.retry_after == "1"
        adm.release()
        await asyncio.wait_for(waiter, 1)
        assert adm.running == 2 and adm.queued == 0 and adm.queued_tokens == 0
        # A queued request that waits too long is refused and leaves no trace.
        short = Admission(
            AdmissionConfig(max_concurrent_requests=1, max_queued_tokens=10, max_queue_wait_s=0.1)
        )
        await short.acquire(1)
        with pytest.raises(Overloaded):
            await short.acquire(1)
        assert short.running == 1 and short.queued == 0 and short.queued_tokens == 0
        short.release()
        await short.acquire(1)  # the slot is free again

    run(go())


# -- the tcp KV data channel ----------------------------------------------------------


def _pair(writer_token: str | None) -> tuple[TcpBackend, TcpBackend, torch.Tensor, torch.Tensor]:
    src = torch.arange(4096, dtype=torch.uint8).reshape(16, 256).clone()
    dst = torch.zeros(16, 256, dtype=torch.uint8)
    writer = TcpBackend("writer", timeout=3.0, cluster_token=writer_token)
    receiver = TcpBackend("receiver", timeout=3.0, cluster_token=TOKEN)
    writer.register(src)
    receiver.register(dst)
    writer.connect("receiver", receiver.metadata())
    return writer, receiver, src, dst


def _wait(backend: TcpBackend, handle: int) -> TransferState:
    deadline = time.monotonic() + 10
    while (state := backend.poll(handle)) is TransferState.PENDING:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return state


@pytest.mark.parametrize("token", [TOKEN, "wrong", None], ids=["token", "wrong-token", "none"])
def test_tcp_data_channel_takes_writes_only_with_the_token(token: str | None) -> None:
    writer, receiver, src, dst = _pair(token)
    try:
        state = _wait(writer, writer.write("receiver", [ByteRange(0, 0, 4096)]))
        if token == TOKEN:
            assert state is TransferState.DONE
            assert torch.equal(src, dst)
        else:
            assert state is TransferState.FAILED
            assert "refused" in (writer.last_error or ""), writer.last_error
            assert not dst.any(), "a writer without the token wrote into the pool"
    finally:
        writer.close()
        receiver.close()


def test_rogue_kv_writer_with_stolen_metadata_is_refused() -> None:
    """A peer that learnt the receiver's metadata (endpoint and incarnation
    token) but holds no cluster token cannot write a byte into the pool."""
    dst = torch.zeros(16, 256, dtype=torch.uint8)
    receiver = TcpBackend("receiver", cluster_token=TOKEN)
    receiver.register(dst)
    meta = msgspec.msgpack.decode(receiver.metadata())
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    try:
        sock.connect(meta["endpoint"])
        encode = msgspec.msgpack.Encoder().encode
        sock.send(encode(_Hello("rogue")))  # asks for a challenge, then ignores it
        sock.send(encode(_Begin("rogue", 1, meta["token"], [(0, 4096)])))
        sock.send_multipart([encode(_Data("rogue", 1, meta["token"], [(0, 4096)])), b"\xff" * 4096])
        replies = []
        deadline = time.monotonic() + 5
        while len(replies) < 3 and time.monotonic() < deadline:
            if sock.poll(200):
                replies.append(sock.recv())
        decoded = [msgspec.msgpack.decode(r) for r in replies]
        refusals = [r for r in decoded if r[0] == "r"]
        assert len(refusals) == 2, decoded
        assert all(r[4] is True for r in refusals), decoded  # "unauthenticated"
        assert not dst.any(), "the rogue writer wrote into the pool"
        assert _Reply  # the refusal's type
    finally:
        sock.close(0)
        receiver.close()
