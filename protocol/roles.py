"""Names of the worker roles, shared by workers and the gateway (torch-free)."""

from __future__ import annotations

PREFILL = "prefill"
DECODE = "decode"
BOTH = "both"
ROLES: tuple[str, ...] = (PREFILL, DECODE, BOTH)
"""Every role a worker can run."""
