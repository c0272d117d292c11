"""Publishing the prefix cache's KV events to the requesters that subscribe
(``protocol.kv_events``): gateways that route prompts by what each worker's
cache really holds."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable

from engine.kvcache.radix import RadixCache
from protocol.kv_events import SNAPSHOT_PLEASE, KvEvents

RING_BATCHES = 64
"""Recent batches kept to repair a subscriber's gap without a snapshot."""


class KvPublisher:
    """Drains the cache's events into numbered batches and sends each to every
    subscriber; answers a subscriber's heartbeat with what it misses (the
    batches after the one it names, or a snapshot)."""

    def __init__(self, cache: RadixCache, send: Callable[[bytes, KvEvents], None]) -> None:
        self.cache = cache
        self.send = send
        self.epoch = os.urandom(6).hex()
        self.seq = 0
        self._ring: deque[KvEvents] = deque(maxlen=RING_BATCHES)
        self._subscribers: set[bytes] = set()
        cache.events = True
        self.cache.drain_events()  # nothing before the first batch

    def publish(self) -> None:
        """Send the events since the last batch (if any) as one batch."""
        stored, removed = self.cache.drain_events()
        if not stored and not removed:
            return
        self.seq += 1
        batch = KvEvents(self.epoch, self.seq, self.cache.page_size, stored, removed)
        self._ring.append(batch)
        for client in self._subscribers:
            self.send(client, batch)

    def on_heartbeat(self, client: bytes, epoch: str, seq: int) -> None:
        """``client`` has applied batch ``seq`` of ``epoch`` (or asks for a
        snapshot): send what it lacks, and keep it subscribed."""
        self.publish()  # so that what follows is current
        self._subscribers.add(client)
        if epoch == self.epoch and seq == self.seq:
            return
        first = self._ring[0].seq if self._ring else self.seq + 1
        if epoch == self.epoch and seq != SNAPSHOT_PLEASE and first - 1 <= seq < self.seq:
            for batch in self._ring:
                if batch.seq > seq:
                    self.send(client, batch)
            return
        snapshot = KvEvents(
            self.epoch, self.seq, self.cache.page_size, self.cache.block_hashes(), [], True
        )
        self.send(client, snapshot)

    def forget(self, client: bytes) -> None:
        self._subscribers.discard(client)

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)
