"""What two engines must agree on before one writes KV into the other, and the
cluster-token MAC that admits a peer."""

from __future__ import annotations

import hashlib
import hmac

LAYOUT = "page-major-v1"
"""``kv[page, layer, k_or_v, slot, kv_head, head_dim]``; bump on any change."""


def compat_info(
    *,
    model: str,
    architecture: str,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: str,
    page_size: int,
    page_bytes: int,
    backend: str,
    tp_size: int = 1,
    kv_head_ranges: str = "",
    kv_dtype: str = "",
) -> dict[str, str]:
    """``page_bytes``: one page of one rank's pool; ``kv_head_ranges``: the KV
    heads each rank holds ("0-1,1-2"; empty: one rank holding all);
    ``kv_dtype``: the pool's element type (empty: the model's ``dtype``)."""
    return {
        "kv_dtype": kv_dtype or dtype,
        "model": model,
        "architecture": architecture,
        "num_layers": str(num_layers),
        "num_kv_heads": str(num_kv_heads),
        "head_dim": str(head_dim),
        "dtype": dtype,
        "page_size": str(page_size),
        "page_bytes": str(page_bytes),
        "layout": LAYOUT,
        "backend": backend,
        "tp_size": str(tp_size),
        "kv_head_ranges": kv_head_ranges or f"0-{num_kv_heads}",
    }


TP_FIELDS = frozenset({"tp_size", "kv_head_ranges", "page_bytes"})
"""Fields the two sides may differ in: tensor-parallel groups of different
sizes map onto each other (``kvtransfer.tp_map.plan`` checks that they do)."""


def compat_hash(info: dict[str, str]) -> str:
    text = "\n".join(f"{k}={info[k]}" for k in sorted(info))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def describe_mismatch(prefill: dict[str, str], decode: dict[str, str]) -> str | None:
    """A message naming every field on which the two sides differ, or None
    (the ``TP_FIELDS`` aside)."""
    keys = sorted((set(prefill) | set(decode)) - TP_FIELDS)
    diffs = [
        f"{k} (prefill {prefill.get(k, '?')!s}, decode {decode.get(k, '?')!s})"
        for k in keys
        if prefill.get(k) != decode.get(k)
    ]
    if not diffs:
        return None
    return "prefill and decode workers are incompatible: " + "; ".join(diffs)


def sign(token: str, *parts: str) -> str:
    return hmac.new(token.encode(), "\x00".join(parts).encode(), hashlib.sha256).hexdigest()


def verify(token: str, mac: str, *parts: str) -> bool:
    return hmac.compare_digest(sign(token, *parts), mac)
