"""KV transfer backends (tcp, nixl) between two real processes.

Each agent is a spawned process owning a ``KVPool``; the test process drives
them over pipes (register, connect, write+poll, dump) and compares the pools.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import random
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import torch

from engine.kvcache.pool import KVPool, KVPoolConfig
from harness.agent_process import AgentProcess
from kvtransfer import TRANSFER_BACKENDS, backend_class, make_backend
from kvtransfer.backend import ByteRange, TransferError, TransferState
from kvtransfer.layout import buffer_nbytes, check_ranges, page_ranges, total_bytes

CALL_TIMEOUT_S = 60.0
# Small chunks so that multi-chunk splitting (at offsets that are not page
# aligned) is exercised even by small pools.
BACKEND_KWARGS: dict[str, dict[str, Any]] = {
    "tcp": {"timeout": 5.0, "chunk_bytes": 1000, "window": 3},
    "nixl": {"timeout": 5.0},
    "nccl": {"timeout": 5.0},
}


@functools.cache
def nixl_skip_reason() -> str | None:
    from kvtransfer.nixl import nixl_available

    ok, why = nixl_available()
    return None if ok else why


def require(backend: str) -> None:
    if backend == "nixl" and (why := nixl_skip_reason()):
        pytest.skip(f"nixl not importable: {why}")


# ----------------------------------------------------------------- the agents


def pool_config(page_size: int, **over: Any) -> KVPoolConfig:
    cfg = dict(num_pages=64, page_size=page_size, num_layers=2, num_kv_heads=2, head_dim=8)
    cfg.update(over)
    return KVPoolConfig(**cfg)


def initial_kv(cfg: KVPoolConfig, seed: int) -> torch.Tensor:
    pool = KVPool(cfg)
    gen = torch.Generator().manual_seed(seed)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen, dtype=torch.float32))
    return pool.kv


def _handle(state: dict[str, Any], cmd: str, *args: Any) -> Any:
    if cmd == "setup":
        backend, name, kwargs, cfg, seed = args
        state["kv"] = initial_kv(cfg, seed)
        state["backend"] = make_backend(backend, name, **kwargs)
        state["backend"].register(state["kv"])
        return state["backend"].metadata()
    be = state["backend"]
    if cmd == "connect":
        be.connect(*args)
        return None
    if cmd == "write":
        peer, ranges, wait_s = args
        t0 = time.monotonic()
        handle = be.write(peer, ranges)
        state_ = be.poll(handle)
        while state_ is TransferState.PENDING and time.monotonic() - t0 < wait_s:
            state_ = be.poll(handle)
        return state_.value, time.monotonic() - t0, getattr(be, "last_error", None)
    if cmd == "dump":
        return state["kv"].clone()
    if cmd == "close":
        be.close()
        be.close()
        return None
    raise ValueError(f"unknown command {cmd!r}")


@pytest.fixture
def spawn() -> Iterator[Any]:
    """``spawn(name) -> AgentProcess``; every agent is stopped when the test ends."""
    ctx = mp.get_context("spawn")
    agents: list[AgentProcess] = []

    def make(name: str) -> AgentProcess:
        agent = AgentProcess(ctx, name, _handle, CALL_TIMEOUT_S)
        agents.append(agent)
        return agent

    try:
        yield make
    finally:
        for agent in agents:
            agent.stop()


def random_page_map(rng: random.Random, num_pages: int, n: int) -> tuple[list[int], list[int]]:
    """``n`` distinct src pages -> ``n`` distinct dst pages (never page 0), made of
    runs of 1..5 pages that are consecutive on both sides, placed at random."""
    lengths = []
    while sum(lengths) < n:
        lengths.append(min(rng.randint(1, 5), n - sum(lengths)))

    def place() -> list[int]:
        free = set(range(1, num_pages))
        out: list[int] = []
        for length in lengths:
            starts = [s for s in free if all(s + i in free for i in range(length))]
            if starts:
                s = rng.choice(sorted(starts))
                run = list(range(s, s + length))
            else:  # fragmented: fall back to scattered single pages
                run = rng.sample(sorted(free), length)
            free.difference_update(run)
            out.extend(run)
        return out

    return place(), place()


def assert_pages_moved(
    src_kv: torch.Tensor,
    dst_kv: torch.Tensor,
    dst_before: torch.Tensor,
    src_pages: list[int],
    dst_pages: list[int],
) -> None:
    num_layers = src_kv.shape[1]
    for s, d in zip(src_pages, dst_pages):
        for layer in range(num_layers):
            for kv in (0, 1):
                assert torch.equal(dst_kv[d, layer, kv], src_kv[s, layer, kv]), (
                    f"dst page {d} layer {layer} {'KV'[kv]} != src page {s}"
                )
    touched = set(dst_pages)
    for p in range(dst_kv.shape[0]):
        if p not in touched:
            assert torch.equal(dst_kv[p], dst_before[p]), f"untouched dst page {p} changed"


def setup_pair(
    spawn: Any, backend: str, cfg: KVPoolConfig, kwargs: dict[str, Any] | None = None
) -> tuple[AgentProcess, AgentProcess, bytes]:
    kwargs = BACKEND_KWARGS[backend] if kwargs is None else kwargs
    src, dst = spawn("prefill"), spawn("decode")
    src_md = src.call("setup", backend, "prefill", kwargs, cfg, 1)
    dst_md = dst.call("setup", backend, "decode", kwargs, cfg, 2)
    assert src_md and dst_md
    src.call("connect", "decode", dst_md)
    src.call("connect", "decode", dst_md)  # idempotent
    return src, dst, dst_md


# ------------------------------------------------------------------- layout


def test_page_ranges_merges_contiguous_runs() -> None:
    assert page_ranges(list(range(1, 9)), list(range(10, 18)), 100) == [ByteRange(100, 1000, 800)]
    # Two runs, broken where the dst side jumps.
    assert page_ranges([1, 2, 3, 4], [5, 6, 20, 21], 10) == [
        ByteRange(10, 50, 20),
        ByteRange(30, 200, 20),
    ]
    # src consecutive but dst not (and vice versa): no merge.
    assert len(page_ranges([1, 2, 3], [9, 7, 5], 8)) == 3
    assert len(page_ranges([9, 7, 5], [1, 2, 3], 8)) == 3
    # Descending runs are not merged either (each range ascends).
    assert len(page_ranges([3, 2, 1], [3, 2, 1], 8)) == 3
    assert page_ranges([], [], 64) == []


def test_page_ranges_scattered_is_one_per_page() -> None:
    rng = random.Random(0)
    src = rng.sample(range(1, 1000), 200)
    dst = rng.sample(range(1, 1000), 200)
    ranges = page_ranges(src, dst, 4096)
    merged = sum(1 for i in range(1, 200) if src[i] == src[i - 1] + 1 and dst[i] == dst[i - 1] + 1)
    assert len(ranges) == 200 - merged
    assert total_bytes(ranges) == 200 * 4096


def test_page_ranges_random_map_covers_every_page() -> None:
    rng = random.Random(1)
    src, dst = random_page_map(rng, 64, 30)
    ranges = page_ranges(src, dst, 16)
    assert len(ranges) < 30  # runs were merged
    covered = [
        (r.src_offset + i * 16, r.dst_offset + i * 16)
        for r in ranges
        for i in range(r.nbytes // 16)
    ]
    assert covered == [(s * 16, d * 16) for s, d in zip(src, dst)]


def test_page_ranges_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        page_ranges([1, 2], [1], 8)
    with pytest.raises(ValueError):
        page_ranges([1], [1], 0)
    with pytest.raises(ValueError):
        page_ranges([-1], [1], 8)


def test_check_ranges_and_nbytes() -> None:
    kv = KVPool(pool_config(4)).kv
    assert buffer_nbytes(kv) == 64 * pool_config(4).page_bytes
    assert check_ranges([ByteRange(0, 0, 10)], 10, 10) is None
    assert "past the peer buffer" in check_ranges([ByteRange(0, 5, 10)], 10, 10)
    assert "past the local buffer" in check_ranges([ByteRange(5, 0, 10)], 10, 10)
    assert "negative" in check_ranges([ByteRange(0, -1, 1)], 10, 10)


def test_registry() -> None:
    assert set(TRANSFER_BACKENDS) == {"tcp", "nixl", "nccl"}
    assert backend_class("tcp").name == "tcp"
    with pytest.raises(ValueError, match="choices: nccl, nixl, tcp"):
        make_backend("rdma", "x")


# --------------------------------------------------------- two-process moves


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("backend", ["tcp", "nixl", "nccl"])
def test_transfer_byte_exact(spawn: Any, backend: str, page_size: int) -> None:
    require(backend)
    cfg = pool_config(page_size)
    src, dst, _ = setup_pair(spawn, backend, cfg)
    rng = random.Random(page_size)
    src_pages, dst_pages = random_page_map(rng, cfg.num_pages, 40)
    ranges = page_ranges(src_pages, dst_pages, cfg.page_bytes)
    assert len(ranges) < len(src_pages)

    state, elapsed, err = src.call("write", "decode", ranges, 20.0)
    assert state == "done", err

    src_kv, dst_kv = src.call("dump"), dst.call("dump")
    assert torch.equal(src_kv, initial_kv(cfg, 1)), "source pool changed"
    assert_pages_moved(src_kv, dst_kv, initial_kv(cfg, 2), src_pages, dst_pages)

    # A second write into the same agent (dst pages reused, new sources).
    src_pages2 = rng.sample(range(1, cfg.num_pages), 10)
    dst_pages2 = rng.sample(range(1, cfg.num_pages), 10)
    state, _, err = src.call(
        "write", "decode", page_ranges(src_pages2, dst_pages2, cfg.page_bytes), 20.0
    )
    assert state == "done", err
    expect = dst_kv.clone()
    expect[dst_pages2] = src_kv[src_pages2]
    assert torch.equal(dst.call("dump"), expect)


@pytest.mark.parametrize("backend", ["tcp", "nixl", "nccl"])
def test_large_contiguous_transfer(spawn: Any, backend: str) -> None:
    """32 MiB pool, one 31.5 MiB range: tcp splits it into default-size frames."""
    require(backend)
    cfg = pool_config(16, num_layers=4, num_kv_heads=8, head_dim=128)
    kwargs = {"timeout": 10.0}
    src, dst, _ = setup_pair(spawn, backend, cfg, kwargs)
    pages = list(range(1, cfg.num_pages))
    ranges = page_ranges(pages, pages, cfg.page_bytes)
    assert len(ranges) == 1
    state, _, err = src.call("write", "decode", ranges, 30.0)
    assert state == "done", err
    dst_kv = dst.call("dump")
    src_kv = initial_kv(cfg, 1)
    assert torch.equal(dst_kv[1:], src_kv[1:])
    assert torch.equal(dst_kv[0], initial_kv(cfg, 2)[0])


def _forge_size(backend: str, metadata: bytes, nbytes: int) -> bytes:
    """Peer metadata claiming a bigger buffer than the peer really has, so the
    writer's own bounds check passes and the receiver must refuse."""
    if backend == "tcp":
        from kvtransfer.tcp import TcpMetadata as Meta
    elif backend == "nccl":
        from kvtransfer.nccl import NcclMetadata as Meta
    else:
        from kvtransfer.nixl import NixlMetadata as Meta
    meta = msgspec.msgpack.decode(metadata, type=Meta)
    return msgspec.msgpack.encode(msgspec.structs.replace(meta, nbytes=nbytes))


@pytest.mark.parametrize("backend", ["tcp", "nixl", "nccl"])
def test_out_of_bounds_write_is_refused(spawn: Any, backend: str) -> None:
    require(backend)
    cfg = pool_config(4)
    src, dst, dst_md = setup_pair(spawn, backend, cfg)
    size = cfg.num_pages * cfg.page_bytes
    pb = cfg.page_bytes
    before = initial_kv(cfg, 2)

    # Honest metadata: the writer refuses on its own.
    state, elapsed, err = src.call("write", "decode", [ByteRange(pb, size - pb, 2 * pb)], 10.0)
    assert state == "failed" and "past the peer buffer" in err
    assert elapsed < 1.0

    # Lying metadata: the receiver must refuse the whole write, including the
    # range that alone would have fit.
    src.call("connect", "decode", _forge_size(backend, dst_md, 4 * size))
    ranges = [ByteRange(pb, pb, pb), ByteRange(2 * pb, size - pb // 2, pb)]
    state, elapsed, err = src.call("write", "decode", ranges, 10.0)
    assert state == "failed", err
    assert torch.equal(dst.call("dump"), before), "a refused write changed the destination"

    # The receiver is still healthy afterwards.
    src.call("connect", "decode", dst_md)
    state, _, err = src.call("write", "decode", [ByteRange(pb, 3 * pb, pb)], 10.0)
    assert state == "done", err
    after = dst.call("dump")
    assert torch.equal(after[3], initial_kv(cfg, 1)[1])
    after[3] = before[3]
    assert torch.equal(after, before)


@pytest.mark.parametrize("backend", ["tcp", "nixl", "nccl"])
def test_dead_peer_fails_within_timeout(spawn: Any, backend: str) -> None:
    require(backend)
    cfg = pool_config(4)
    timeout = 1.0
    kwargs = {**BACKEND_KWARGS[backend], "timeout": timeout}
    src, dst, _ = setup_pair(spawn, backend, cfg, kwargs)
    pb = cfg.page_bytes
    state, _, err = src.call("write", "decode", [ByteRange(pb, pb, 8 * pb)], 10.0)
    assert state == "done", err

    dst.kill()
    state, elapsed, err = src.call("write", "decode", [ByteRange(pb, pb, 8 * pb)], 10.0)
    assert state == "failed", f"write to a dead peer ended {state} after {elapsed:.2f}s"
    assert elapsed < timeout + 2.0, f"took {elapsed:.2f}s with a {timeout}s timeout"
    src.call("close", timeout=10)


def test_tcp_unreachable_peer_and_close_do_not_hang() -> None:
    from kvtransfer.tcp import TcpBackend

    a = TcpBackend("a", timeout=0.5)
    b = TcpBackend("b")
    try:
        a.register(torch.zeros(1024))
        b.register(torch.zeros(1024))
        md = b.metadata()
        b.close()  # nobody listens on that port any more
        a.connect("b", md)
        t0 = time.monotonic()
        h = a.write("b", [ByteRange(0, 0, 4096)])
        while (state := a.poll(h)) is TransferState.PENDING:
            assert time.monotonic() - t0 < 5.0, "write to a closed port never failed"
        assert state is TransferState.FAILED
        assert "no progress" in (a.last_error or "")
        # A write still pending when the backend closes: close() returns promptly.
        h = a.write("b", [ByteRange(0, 0, 4096)])
        t0 = time.monotonic()
        a.close()
        assert time.monotonic() - t0 < 2.0
        assert a.poll(h) is TransferState.FAILED
        with pytest.raises(TransferError):
            a.write("b", [ByteRange(0, 0, 8)])
    finally:
        a.close()
        b.close()


def test_tcp_in_process_api() -> None:
    """Same-process agents: empty writes, unknown peers and handles, loopback."""
    from kvtransfer.tcp import TcpBackend

    a = TcpBackend("a")
    try:
        with pytest.raises(TransferError):
            a.metadata()
        with pytest.raises(TransferError):
            a.write("a", [])
        buf = torch.arange(256, dtype=torch.float32)
        a.register(buf)
        with pytest.raises(TransferError, match="unknown peer"):
            a.write("nobody", [])
        a.connect("a", a.metadata())  # loopback into its own buffer
        h = a.write("a", [])
        assert a.poll(h) is TransferState.DONE
        with pytest.raises(TransferError):
            a.poll(h)
        h = a.write("a", [ByteRange(0, 512, 256)])
        t0 = time.monotonic()
        while (state := a.poll(h)) is TransferState.PENDING:
            assert time.monotonic() - t0 < 5.0
        assert state is TransferState.DONE
        assert torch.equal(buf[128:192], torch.arange(64, dtype=torch.float32))
    finally:
        a.close()


def test_tcp_mixed_piece_sizes_in_one_message() -> None:
    """Small pieces are gathered into one frame and big ones sent zero-copy,
    within the same message; every byte must land where its range says."""
    from kvtransfer.tcp import TcpBackend

    a, b = TcpBackend("a", chunk_bytes=4 << 20), TcpBackend("b")
    try:
        src = torch.randint(0, 256, (8 << 20,), dtype=torch.uint8)
        dst = torch.zeros(8 << 20, dtype=torch.uint8)
        a.register(src)
        b.register(dst)
        a.connect("b", b.metadata())
        mib = 1 << 20
        ranges = [
            ByteRange(0, 7 * mib, 4096),
            ByteRange(mib, 3 * mib, 3 * mib // 2),
            ByteRange(5 * mib, 100, 333),
            ByteRange(6 * mib, 5 * mib, 2 * mib),  # crosses into a second chunk
            ByteRange(8 * mib - 7, 8 * mib - 7, 7),
        ]
        h = a.write("b", ranges)
        t0 = time.monotonic()
        while (state := a.poll(h)) is TransferState.PENDING:
            assert time.monotonic() - t0 < 10.0
        assert state is TransferState.DONE, a.last_error
        expect = torch.zeros_like(dst)
        for r in ranges:
            expect[r.dst_offset : r.dst_offset + r.nbytes] = src[
                r.src_offset : r.src_offset + r.nbytes
            ]
        assert torch.equal(dst, expect)
    finally:
        a.close()
        b.close()


def test_tcp_receiver_checks_every_piece() -> None:
    """A writer that skips its own checks (raw protocol messages) still cannot
    write outside the receiver's buffer or past what it announced."""
    import zmq

    from kvtransfer.tcp import TcpBackend, TcpMetadata, _Begin, _Data, _Reply

    b = TcpBackend("b")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    try:
        dst = torch.zeros(1024, dtype=torch.uint8)
        b.register(dst)
        meta = msgspec.msgpack.decode(b.metadata(), type=TcpMetadata)
        sock.connect(meta.endpoint)
        enc = msgspec.msgpack.encode

        def reply() -> _Reply:
            return msgspec.msgpack.decode(sock.recv(), type=_Reply)

        # Announced range fits, but the data piece does not.
        sock.send(enc(_Begin("w", 1, meta.token, [(0, 16)])))
        sock.send_multipart([enc(_Data("w", 1, meta.token, [(1020, 16)])), b"x" * 16])
        r = reply()
        assert r.xfer == 1 and "out of bounds" in r.error
        # Pieces claiming more bytes than the frames hold.
        sock.send(enc(_Begin("w", 2, meta.token, [(0, 16)])))
        sock.send_multipart([enc(_Data("w", 2, meta.token, [(0, 16)])), b"x" * 8])
        r = reply()
        assert r.xfer == 2 and "malformed" in r.error
        # More data than announced.
        sock.send(enc(_Begin("w", 3, meta.token, [(0, 4)])))
        sock.send_multipart([enc(_Data("w", 3, meta.token, [(0, 8)])), b"x" * 8])
        r = reply()
        assert r.xfer == 3 and r.error
        # Announced range out of bounds; wrong token.
        sock.send(enc(_Begin("w", 4, meta.token, [(1000, 100)])))
        assert "outside" in reply().error
        sock.send(enc(_Begin("w", 5, "stale", [(0, 4)])))
        assert "stale" in reply().error
        assert int(dst.count_nonzero()) == 0, "the receiver wrote refused bytes"
        # A well-formed write still works: two pieces in one frame.
        sock.send(enc(_Begin("w", 6, meta.token, [(0, 4), (10, 4)])))
        sock.send_multipart([enc(_Data("w", 6, meta.token, [(0, 4), (10, 4)])), b"abcdefgh"])
        r = reply()
        assert (r.xfer, r.nbytes, r.error) == (6, 8, None)
        assert bytes(dst[:14].tolist()) == b"abcd\0\0\0\0\0\0efgh"
    finally:
        sock.close(linger=0)
        ctx.term()
        b.close()
