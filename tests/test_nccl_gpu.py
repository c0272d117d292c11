"""The nccl backend's CUDA channel on one GPU. NCCL refuses two ranks of one
communicator on one device, so what one GPU allows is tested: a one-rank
communicator that sends to itself inside one group call, through the same
``NcclChannel.post`` the pairs use (binding, side stream ordered after the
compute stream, in-place ranges and the staging path, scatter into pages),
checked byte for byte against the source pages; and a channel abort that
leaves it refusing further posts."""

from __future__ import annotations

import random
import time

import pytest
import torch

from kvtransfer.layout import page_ranges

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

nccl_core = pytest.importorskip("nccl.core", reason="nccl4py is not installed")

from kvtransfer.nccl.channel import ChannelError, NcclChannel, Span, staged  # noqa: E402

PAGES = 64


def _channel(buf: torch.Tensor) -> NcclChannel:
    uid = bytes(nccl_core.get_unique_id())
    return NcclChannel.create(uid, 1, 0, buf, timeout_s=60.0)


def _pool(page_bytes: int) -> torch.Tensor:
    """Pages 0..PAGES-1 are the source half, PAGES..2*PAGES-1 the destination."""
    return torch.zeros(2 * PAGES * page_bytes, dtype=torch.uint8, device="cuda")


@pytest.mark.parametrize("page_bytes", [2 << 20, 512], ids=["in-place", "staged"])
def test_self_send_scatters_pages_byte_exact(page_bytes: int) -> None:
    buf = _pool(page_bytes)
    channel = _channel(buf)
    try:
        rng = random.Random(page_bytes)
        src_pages = rng.sample(range(PAGES), 40)
        dst_pages = [PAGES + p for p in rng.sample(range(PAGES), 40)]
        ranges = page_ranges(src_pages, dst_pages, page_bytes)
        sends = [Span(r.src_offset, r.nbytes) for r in ranges]
        recvs = [Span(r.dst_offset, r.nbytes) for r in ranges]
        assert staged(sends) == (page_bytes < (256 << 10))
        # Fill the source pages on the compute stream just before the post:
        # the channel's side stream must wait for it.
        torch.cuda.synchronize()
        src = buf[: PAGES * page_bytes]
        torch.cuda._sleep(50_000_000)  # ~tens of ms of GPU time ahead of the fill
        src.copy_(torch.randint(0, 256, src.shape, dtype=torch.uint8, device="cuda"))
        op = channel.post(sends, recvs, peer=0)
        channel.wait(op, time.monotonic() + 60)
        host = buf.cpu().view(2 * PAGES, page_bytes)
        for s, d in zip(src_pages, dst_pages):
            assert torch.equal(host[d], host[s]), f"page {s} -> {d}"
        untouched = set(range(PAGES, 2 * PAGES)) - set(dst_pages)
        for p in untouched:
            assert not host[p].any(), f"untouched page {p} changed"
    finally:
        channel.abort()


def test_aborted_channel_refuses_posts() -> None:
    buf = _pool(4096)
    channel = _channel(buf)
    channel.abort()
    channel.abort()  # twice is fine
    with pytest.raises(ChannelError):
        channel.post([Span(0, 4096)], [Span(PAGES * 4096, 4096)], peer=0)
