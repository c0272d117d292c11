"""Data movement of the KV plane: push byte ranges of a local registered buffer
into a peer's registered buffer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from enum import StrEnum
from typing import NamedTuple

import torch


class ByteRange(NamedTuple):
    src_offset: int
    dst_offset: int
    nbytes: int


class TransferState(StrEnum):
    PENDING = "pending"
    DONE = "done"
    """Every byte has landed in the peer's buffer (not merely left this process)."""
    FAILED = "failed"


class TransferError(RuntimeError):
    """A transfer or connection failed; the message says why."""


class TransferBackend(ABC):
    """One per engine process. Push model: the prefill side writes into the
    decode side's buffer; the decode side only registers and publishes metadata.

    Thread-safety is not required: one scheduler thread drives it. A backend
    may run its own helper threads internally.
    """

    name: str

    def __init__(self, agent_name: str) -> None:
        self.agent_name = agent_name

    @abstractmethod
    def register(self, buffer: torch.Tensor) -> None:
        """Register the (contiguous) buffer peers read from or write into."""

    @abstractmethod
    def metadata(self) -> bytes:
        """What a peer passes to ``connect`` to reach this agent's buffer."""

    @abstractmethod
    def connect(self, peer: str, metadata: bytes) -> None:
        """Make ``peer`` (its agent name) writable; idempotent."""

    @abstractmethod
    def write(self, peer: str, ranges: Sequence[ByteRange]) -> int:
        """Start writing local ``ranges`` into the peer's buffer; returns a handle."""

    @abstractmethod
    def poll(self, handle: int) -> TransferState:
        """State of a write; a DONE or FAILED handle is released by this call."""

    @abstractmethod
    def disconnect(self, peer: str) -> None:
        """Forget a peer (after it died or was removed)."""

    def prune(self) -> list[str]:
        """Forget the peers known to have exited; returns their names. Called
        now and then by the writing side: a backend that holds resources of its
        peers (a mapped pool) lets go of them here."""
        return []

    @abstractmethod
    def close(self) -> None:
        """Release every resource; safe to call twice."""
