"""The grammar mask on CUDA logits in one launch (``engine.grammar`` uses it).

A program covers ``BLOCK`` tokens of one grammar row: it reads the row's index
and its bitmask words and stores the lowest finite value over the forbidden
tokens only, so the logits are written where the mask forbids and never read
(the tensor-op version reads and writes every masked row twice over)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


# The number of rows changes from step to step: specialising on it (1, a
# multiple of 16, other) would compile the kernel again mid-serving.
@triton.jit(do_not_specialize=["num_rows"])
def _mask_kernel(logits_ptr, stride, packed_ptr, num_rows, words, vocab, low, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = offs < vocab
    row = tl.load(packed_ptr + r).to(tl.int64)
    word = tl.load(packed_ptr + num_rows + r * words + offs // 32, mask=live, other=-1)
    # An arithmetic shift of a negative word still leaves bit ``t % 32`` lowest.
    forbidden = ((word >> (offs % 32)) & 1) == 0
    tl.store(logits_ptr + row * stride + offs, low, mask=live & forbidden)


def apply_packed_bitmask(logits: torch.Tensor, packed: torch.Tensor, num_rows: int) -> None:
    """Mask ``logits`` ([B, V], unit stride over V) in place; ``packed``: int32,
    the ``num_rows`` row indices, then their ``[num_rows, ceil(V / 32)]``
    bitmask (xgrammar's layout), on the logits' device."""
    assert logits.stride(1) == 1 and packed.dtype == torch.int32
    vocab = logits.shape[1]
    words = -(-vocab // 32)
    assert packed.numel() >= num_rows * (1 + words)
    low = torch.finfo(logits.dtype).min
    grid = (num_rows, triton.cdiv(vocab, BLOCK))
    _mask_kernel[grid](logits, logits.stride(0), packed, num_rows, words, vocab, low, BLOCK=BLOCK)
