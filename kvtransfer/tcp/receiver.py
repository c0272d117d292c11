"""The receiving side of the tcp data channel: checks every transfer message
against the registered buffer and the announced transfer, and writes the bytes
of those that pass.

A ``Begin`` announces every range of a transfer; it is refused (nothing of the
transfer is ever written) when its token is not the receiver's current
incarnation or a range falls outside the buffer. A ``Data`` message is checked
whole (bounds, framing, announced size) before any of its bytes are written.
"""

from __future__ import annotations

from collections import OrderedDict

from kvtransfer.tcp.buffer import _ByteBuffer
from kvtransfer.tcp.frames import _Begin, _Data, _Reply

_MAX_REMEMBERED_XFERS = 4096


class _Receiver:
    """What the receiver knows: its registered buffer, its incarnation token
    and the transfers writers announced to it. Owned by the I/O thread."""

    def __init__(self, agent_name: str) -> None:
        self.agent_name = agent_name
        self.rx: _ByteBuffer | None = None
        self.rx_token: str | None = None
        # (writer, xfer) -> bytes still expected, or -1 when the transfer was refused
        self.rx_xfers: OrderedDict[tuple[str, int], int] = OrderedDict()

    def register(self, buffer: _ByteBuffer, token: str) -> None:
        """Take writes into ``buffer`` from now on, only from metadata with ``token``."""
        self.rx, self.rx_token = buffer, token
        self.rx_xfers.clear()

    def receive(self, msg: _Begin | _Data, payloads: list[memoryview]) -> _Reply | None:
        """Check and apply one transfer message; the reply to send back, if any."""
        key = (msg.writer, msg.xfer)
        if self.rx is None or msg.token != self.rx_token:
            why = "no buffer registered" if self.rx is None else "stale metadata"
            return _Reply(msg.xfer, 0, f"receiver {self.agent_name!r} refused: {why}")
        size = self.rx.nbytes
        if isinstance(msg, _Begin):
            total = 0
            for off, n in msg.ranges:
                if off < 0 or n < 0 or off + n > size:
                    self._remember(key, -1)
                    return _Reply(
                        msg.xfer,
                        0,
                        f"receiver {self.agent_name!r} refused range [{off}, {off + n}) "
                        f"outside its {size}-byte buffer; nothing was written",
                    )
                total += n
            self._remember(key, total)
            return None
        remaining = self.rx_xfers.get(key)
        if remaining is None or remaining < 0:
            if remaining is None:
                return _Reply(msg.xfer, 0, "data for a transfer the receiver does not know")
            return None  # refused already; the writer was told
        # Check every piece (bounds, framing, announced size) before writing any.
        places = []
        n = fi = pos = 0
        for off, length in msg.pieces:
            if off < 0 or length < 0 or off + length > size:
                self.rx_xfers[key] = -1
                return _Reply(msg.xfer, 0, f"piece [{off}, {off + length}) out of bounds")
            while fi < len(payloads) and pos == len(payloads[fi]) and length:
                fi, pos = fi + 1, 0
            if length and (fi == len(payloads) or pos + length > len(payloads[fi])):
                self.rx_xfers[key] = -1
                return _Reply(msg.xfer, 0, "malformed data message (pieces do not match frames)")
            places.append((off, length, fi, pos))
            pos += length
            n += length
        if n != sum(len(p) for p in payloads) or n > remaining:
            self.rx_xfers[key] = -1
            return _Reply(msg.xfer, 0, "data does not match the announced transfer")
        self.rx.scatter(places, payloads)
        remaining -= n
        if remaining == 0:
            del self.rx_xfers[key]
        else:
            self.rx_xfers[key] = remaining
        return _Reply(msg.xfer, n)

    def _remember(self, key: tuple[str, int], value: int) -> None:
        self.rx_xfers[key] = value
        while len(self.rx_xfers) > _MAX_REMEMBERED_XFERS:
            self.rx_xfers.popitem(last=False)
