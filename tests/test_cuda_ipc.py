"""CUDA IPC writes of the nixl backend (``kvtransfer.cuda_ipc``): the chunk
table and the copy kernel (on the CPU, under Triton's interpreter), the
exporter's liveness, old metadata; on a GPU, two processes moving pages
through it and through UCX, and a peer that exits."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import torch

from harness.agent_process import AgentProcess
from kvtransfer import cuda_ipc
from kvtransfer.backend import ByteRange, TransferState
from kvtransfer.layout import page_ranges

W = cuda_ipc.WORD


def random_ranges(rng: random.Random, size: int, n: int) -> list[ByteRange]:
    """``n`` aligned ranges whose destinations do not overlap."""
    a_ = cuda_ipc.ALIGN
    cuts = sorted(rng.sample(range(1, size // a_), 2 * n))
    out = []
    for a, b in zip(cuts[::2], cuts[1::2]):
        nbytes = (b - a) * a_
        src = rng.randrange(0, size - nbytes + 1) // a_ * a_
        out.append(ByteRange(src, a * a_, nbytes))
    return out


def test_chunk_table_covers_every_word_once() -> None:
    rng = random.Random(0)
    ranges = random_ranges(rng, 1 << 22, 12) + [ByteRange(0, 0, 0)]
    ranges.append(ByteRange(0, (1 << 22) + 8, cuda_ipc.PIECE_WORDS * W * 3))  # whole pieces
    ranges.append(ByteRange(8, (1 << 24), cuda_ipc.PIECE_WORDS * W + 8 * 5))  # and a tail
    table = cuda_ipc.chunk_table(ranges)
    assert table.shape[0] == 3
    assert (table[2] > 0).all() and (table[2] <= cuda_ipc.PIECE_WORDS).all()
    got = sorted(zip(table[1].tolist(), table[0].tolist(), table[2].tolist()))
    expect = []
    for r in ranges:
        for k in range(0, r.nbytes // W, cuda_ipc.PIECE_WORDS):
            n = min(cuda_ipc.PIECE_WORDS, r.nbytes // W - k)
            expect.append((r.dst_offset // W + k, r.src_offset // W + k, n))
    assert got == sorted(expect)
    # Ranges of one piece each keep their order and need no expansion.
    small = [ByteRange(8 * i, 16 * i, 8) for i in range(1, 5)]
    assert cuda_ipc.chunk_table(small).tolist() == [[1, 2, 3, 4], [2, 4, 6, 8], [1, 1, 1, 1]]


def test_aligned_and_pays() -> None:
    assert cuda_ipc.aligned([ByteRange(0, 16, 32), ByteRange(48, 0, 16)])
    assert not cuda_ipc.aligned([ByteRange(0, 16, 24)])
    assert not cuda_ipc.aligned([ByteRange(8, 16, 16)])
    page = 2 << 20
    scattered = [ByteRange(i * page, 2 * i * page, page) for i in range(cuda_ipc.MIN_RANGES)]
    assert cuda_ipc.pays(scattered)
    assert not cuda_ipc.pays(scattered[:-1])  # few descriptors: UCX
    assert not cuda_ipc.pays([ByteRange(0, 0, 512 << 20)])  # one large range: UCX
    assert not cuda_ipc.pays([ByteRange(0, 0, 64 << 20)] * cuda_ipc.MIN_RANGES)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checked on the device itself")
def test_copy_kernel_under_the_interpreter() -> None:
    """The Triton kernel itself, on CPU tensors, against slicing."""
    pytest.importorskip("triton")
    code = textwrap.dedent(
        """
        import random, torch
        from kvtransfer import cuda_ipc
        from kvtransfer.backend import ByteRange
        from tests.test_cuda_ipc import random_ranges
        rng = random.Random(1)
        size = 1 << 23
        src = torch.randint(0, 256, (size,), dtype=torch.uint8)
        dst = torch.randint(0, 256, (size,), dtype=torch.uint8)
        ref = dst.clone()
        ranges = random_ranges(rng, size // 2, 6)
        ranges.append(ByteRange(0, size // 2, cuda_ipc.PIECE_WORDS * 8 + 64))
        for r in ranges:
            ref[r.dst_offset : r.dst_offset + r.nbytes] = src[r.src_offset : r.src_offset + r.nbytes]
        table = torch.from_numpy(cuda_ipc.chunk_table(ranges))
        assert table.shape[1] > len(ranges), "some range must span several pieces"
        cuda_ipc.copy_ranges(src, dst, table)
        assert torch.equal(dst, ref), "copy differs from slicing"
        print("ok")
        """
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def _export(process: str) -> cuda_ipc.IpcExport:
    return cuda_ipc.IpcExport(
        host=cuda_ipc.host_id(),
        device=0,
        handle=b"",
        storage_bytes=0,
        storage_offset=0,
        ref_counter_handle=b"",
        ref_counter_offset=0,
        event_handle=None,
        event_sync_required=False,
        buffer_offset=0,
        nbytes=0,
        process=process,
    )


@pytest.mark.skipif(not os.path.exists("/proc/self/ns/pid"), reason="needs /proc")
def test_exporter_liveness() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        export = _export(cuda_ipc.process_id(child.pid))
        assert export.process and not cuda_ipc.exporter_gone(export)
    finally:
        child.kill()
        child.wait()
    assert cuda_ipc.exporter_gone(export)
    # A pid reused by another process is not the exporter.
    ns, pid, start = export.process.rsplit("/", 2)
    assert cuda_ipc.exporter_gone(_export(f"{ns}/{os.getpid()}/{start}"))
    # Another PID namespace: it cannot tell, so it keeps the peer.
    assert not cuda_ipc.exporter_gone(_export(f"pid:[1]/{pid}/{start}"))
    assert not cuda_ipc.exporter_gone(_export(""))


def test_host_memory_is_not_exported_and_old_metadata_decodes() -> None:
    assert cuda_ipc.export_buffer(torch.zeros(64, dtype=torch.uint8)) is None
    from kvtransfer.nixl import NixlMetadata

    class Old(msgspec.Struct, frozen=True):
        agent: str
        agent_md: bytes
        base: int
        nbytes: int
        device_id: int
        mem_type: str

    raw = msgspec.msgpack.encode(Old("a", b"md", 1, 2, 0, "VRAM"))
    assert msgspec.msgpack.decode(raw, type=NixlMetadata).ipc is None
    meta = NixlMetadata("a", b"md", 1, 2, 0, "VRAM", _export("x/1/2"))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(meta), type=NixlMetadata) == meta


# -------------------------------------------------------------- on a GPU

PAGE_BYTES = 64 * 1024
NUM_PAGES = 96


def _handle(state: dict[str, Any], cmd: str, *args: Any) -> Any:
    from kvtransfer import make_backend

    if cmd == "setup":
        name, kwargs, seed = args
        torch.cuda.set_device(0)
        gen = torch.Generator(device="cuda").manual_seed(seed)
        kv = torch.randint(
            0, 256, (NUM_PAGES, PAGE_BYTES), dtype=torch.uint8, device="cuda", generator=gen
        )
        state["kv"] = kv
        state["backend"] = make_backend("nixl", name, **kwargs)
        state["backend"].register(kv)
        return state["backend"].metadata()
    be = state["backend"]
    if cmd == "connect":
        be.connect(*args)
        return be.route(args[0])
    if cmd == "write":
        peer, ranges = args
        # Work queued on the compute stream before the write: the copy must
        # wait for it (it reads what that work writes).
        state["kv"][1:].add_(1)
        if be.route(peer) == "ucx":
            # UCX reads the buffer outside any stream: the engine's pushes come
            # after ``finish`` waited for the forward, as this does.
            torch.cuda.synchronize()
        handle = be.write(peer, ranges)
        t0 = time.monotonic()
        while (st := be.poll(handle)) is TransferState.PENDING:
            assert time.monotonic() - t0 < 30, "write hung"
        return st.value
    if cmd == "dump":
        torch.cuda.synchronize()
        return state["kv"].cpu()
    if cmd == "prune":
        return be.prune()
    if cmd == "path":
        return be.path(*args)
    if cmd == "cuda_ok":
        x = torch.ones(1024, device="cuda")
        return float((x * 2).sum().item())
    raise ValueError(cmd)


@pytest.fixture
def agents() -> Iterator[Any]:
    ctx = mp.get_context("spawn")
    made: list[AgentProcess] = []

    def make(name: str) -> AgentProcess:
        a = AgentProcess(ctx, name, _handle, 120.0)
        made.append(a)
        return a

    try:
        yield make
    finally:
        for a in made:
            a.stop()


def _nixl() -> None:
    from kvtransfer.nixl import nixl_available

    ok, why = nixl_available()
    if not ok:
        pytest.skip(why)


@pytest.mark.gpu
@pytest.mark.parametrize("use_ipc", [True, False])
def test_scattered_pages_land_on_one_gpu(agents: Any, use_ipc: bool) -> None:
    _nixl()
    src, dst = agents("prefill"), agents("decode")
    kwargs = {"timeout": 20.0, "cuda_ipc": use_ipc}
    src.call("setup", "p-agent", kwargs, 1)
    dst_md = dst.call("setup", "d-agent", kwargs, 2)
    assert src.call("connect", "d-agent", dst_md) == ("cuda_ipc" if use_ipc else "ucx")
    rng = random.Random(3)
    src_pages = rng.sample(range(1, NUM_PAGES), 40)
    dst_pages = rng.sample(range(1, NUM_PAGES), 40)
    before = dst.call("dump")
    ranges = page_ranges(src_pages, dst_pages, PAGE_BYTES)
    assert src.call("path", "d-agent", ranges) == ("cuda_ipc" if use_ipc else "ucx")
    assert src.call("write", "d-agent", ranges) == "done"
    # Few large ranges go through UCX even where the kernel could take them.
    assert src.call("path", "d-agent", [ByteRange(PAGE_BYTES, PAGE_BYTES, 8 * PAGE_BYTES)]) == "ucx"
    src_kv, dst_kv = src.call("dump"), dst.call("dump")
    expect = before.clone()
    expect[dst_pages] = src_kv[src_pages]
    assert torch.equal(dst_kv, expect)


@pytest.mark.gpu
def test_exited_peer_is_unmapped_and_refused(agents: Any) -> None:
    _nixl()
    src, dst = agents("prefill"), agents("decode")
    kwargs = {"timeout": 5.0}
    src.call("setup", "p-agent", kwargs, 1)
    assert src.call("connect", "d-agent", dst.call("setup", "d-agent", kwargs, 2)) == "cuda_ipc"
    assert src.call("write", "d-agent", [ByteRange(PAGE_BYTES, PAGE_BYTES, PAGE_BYTES)]) == "done"
    dst.kill()
    deadline = time.monotonic() + 10
    while (gone := src.call("prune")) == []:
        assert time.monotonic() < deadline, "the exited peer was never pruned"
        time.sleep(0.1)
    assert gone == ["d-agent"]
    assert src.call("write", "d-agent", [ByteRange(0, 0, PAGE_BYTES)]) == "failed"
    assert src.call("cuda_ok") == 2048.0
