"""The counter-based noise of sampling: a uniform number for vocab entry ``v``
of a request is a pure function of ``(seed, step, v)`` (murmur3's finaliser),
turned into Gumbel noise. Shared by the torch sampler (``engine.sampling``)
and the CUDA one (``engine.sampling_triton``), which must draw alike."""

from __future__ import annotations

import torch

SEED_LIMIT = 2**31
"""Seeds stored in a :class:`SamplingBatch` lie in ``[0, SEED_LIMIT)``."""

_M32 = 0xFFFFFFFF
_M16 = 0xFFFF
# Constants that decorrelate the three inputs of the hash (seed, step, index).
_SEED_SALT = 0x243F6A88
_STEP_SALT = 0x9E3779B9
_INDEX_SALT = 0x632BE5AB
# murmur3 fmix32 multipliers.
_FMIX_C1 = 0x85EBCA6B
_FMIX_C2 = 0xC2B2AE35


# --------------------------------------------------------------------------- hashing


def _fmix32_int(x: int) -> int:
    """murmur3's 32-bit finaliser on a Python int (used for seed folding)."""
    x &= _M32
    x ^= x >> 16
    x = (x * _FMIX_C1) & _M32
    x ^= x >> 13
    x = (x * _FMIX_C2) & _M32
    x ^= x >> 16
    return x


def fold_seed(seed: int) -> int:
    """Map any non-negative integer seed into ``[0, 2**31)``.

    Seeds already in range are returned unchanged; larger ones are hashed 32
    bits at a time (deterministic across processes, unlike ``hash()``).
    """
    seed = int(seed)
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if seed < SEED_LIMIT:
        return seed
    h = 0
    while seed:
        h = _fmix32_int(h ^ (seed & _M32)) + 1
        seed >>= 32
    return _fmix32_int(h) & (SEED_LIMIT - 1)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for int64 ``x`` in ``[0, 2**32)`` without int64 overflow.

    The product is split on the 16-bit halves of ``x`` so every intermediate
    stays below ``2**49``.
    """
    hi = ((x >> 16) * c) & _M16
    return ((hi << 16) + (x & _M16) * c) & _M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on an int64 tensor of values in ``[0, 2**32)``.

    All values stay non-negative, so the right shifts are logical shifts.
    """
    x = x ^ (x >> 16)
    x = _mul32(x, _FMIX_C1)
    x = x ^ (x >> 13)
    x = _mul32(x, _FMIX_C2)
    return x ^ (x >> 16)


def _row_keys(seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """[B] int64 32-bit key of each (seed, step) pair."""
    s = _fmix32((seed & _M32) ^ _SEED_SALT)
    return _fmix32(((s ^ (step & _M32)) + _STEP_SALT) & _M32)


def _fmix32_(x: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """In-place :func:`_fmix32` on a large tensor; ``tmp`` is scratch of the same shape."""
    for shift, mult in ((16, _FMIX_C1), (13, _FMIX_C2)):
        x.bitwise_xor_(torch.bitwise_right_shift(x, shift, out=tmp))
        # x = (x * mult) mod 2**32, split on the 16-bit halves as in _mul32.
        torch.bitwise_right_shift(x, 16, out=tmp).mul_(mult).bitwise_and_(_M16)
        tmp.bitwise_left_shift_(16)
        x.bitwise_and_(_M16).mul_(mult).add_(tmp).bitwise_and_(_M32)
    return x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=tmp))


def _gumbel_noise(seed: torch.Tensor, step: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float32 standard Gumbel noise; entry (r, v) depends on (seed[r], step[r], v) only."""
    device = seed.device
    keys = _row_keys(seed, step)
    index = torch.arange(vocab_size, dtype=torch.int64, device=device)
    index_keys = _fmix32((index + _INDEX_SALT) & _M32)
    h = keys[:, None] ^ index_keys[None, :]
    h = _fmix32_(h, torch.empty_like(h))
    # 23 hash bits -> u = (2j + 1) / 2**24: an odd integer below 2**24 times a power
    # of two, so u is exact in float32 and lies strictly inside (0, 1).
    u = h.bitwise_right_shift_(9).mul_(2).add_(1).to(torch.float32).mul_(2.0**-24)
    # -log(u) > 0 for every u < 1, so the second log is finite.
    return u.log_().neg_().log_().neg_()
