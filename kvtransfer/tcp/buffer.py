"""A registered tensor seen as flat bytes: how a writer turns pieces of it into
payload frames, and how a receiver writes payload frames into it.

Big pieces of a CPU buffer travel zero-copy (zmq reads the registered buffer
itself), so the source pages must stay untouched until the write ends.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvtransfer.backend import TransferError
from kvtransfer.layout import buffer_nbytes

_ZERO_COPY_MIN = 1 << 20  # smaller pieces are gathered into one frame (fewer frames)


class _ByteBuffer:
    """A registered tensor seen as flat bytes (numpy view when on CPU)."""

    def __init__(self, buffer: torch.Tensor) -> None:
        if not buffer.is_contiguous():
            raise TransferError("the registered buffer must be contiguous")
        self.tensor = buffer
        self.nbytes = buffer_nbytes(buffer)
        self.u8 = buffer.reshape(-1).view(torch.uint8)
        self.np = self.u8.numpy() if buffer.device.type == "cpu" else None

    def frames(self, pieces: list[tuple[int, int, int]]) -> list[Any]:
        """Payload frames carrying the ``(src, dst, nbytes)`` pieces' bytes in order."""
        if self.np is None:  # device memory: gather on the device, one copy to host
            parts = [self.u8[s : s + n] for s, _, n in pieces]
            data = parts[0] if len(parts) == 1 else torch.cat(parts)
            return [data.cpu().numpy()]
        out: list[Any] = []
        small: list[memoryview] = []
        for s, _, n in pieces:
            view = memoryview(self.np[s : s + n])
            if n >= _ZERO_COPY_MIN:
                if small:
                    out.append(b"".join(small))
                    small = []
                out.append(view)  # zero-copy: zmq reads the registered buffer
            else:
                small.append(view)  # zmq would copy these anyway: gather them
        if small:
            out.append(b"".join(small))
        return out

    def scatter(self, places: list[tuple[int, int, int, int]], frames: list[memoryview]) -> None:
        """Write ``(dst, nbytes, frame, frame_offset)`` pieces (already checked)."""
        if self.np is not None:
            arrays = [np.frombuffer(f, dtype=np.uint8) for f in frames]
            for dst, n, fi, pos in places:
                self.np[dst : dst + n] = arrays[fi][pos : pos + n]
            return
        staged = []
        for f in frames:  # one host-to-device copy per frame
            host = torch.empty(len(f), dtype=torch.uint8)
            host.numpy()[:] = np.frombuffer(f, dtype=np.uint8)
            staged.append(host.to(self.u8.device))
        for dst, n, fi, pos in places:
            self.u8[dst : dst + n].copy_(staged[fi][pos : pos + n])
