"""A tensor-parallel rank other than the lead: its shard of the model, its own
KV pool, and a loop that mirrors the lead's forwards (see
``engine.parallel.ranks``)."""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from engine.config import EngineConfig
from engine.forward_batch import ForwardBatch
from engine.model_config import ModelConfig
from engine.parallel.group import TPGroup, follower_store
from engine.parallel.shard import Shard
from engine.runner import ModelRunner

log = logging.getLogger(__name__)

TICK_S = 0.001
"""How often a rank with tickers (e.g. KV writes in flight) polls them while
no command comes."""
PARENT_POLL_S = 0.5


class BatchMeta(NamedTuple):
    """The host part of a ``ForwardBatch``; its tensors come by broadcast."""

    seq_lens: list[int]
    extend_lens: list[int]
    page_tables: list[list[int]]
    sizes: tuple[int, ...]
    """Lengths of input_ids, positions, write_pages, write_slots, logits_indices."""


class RankContext:
    """What a call from the lead runs against on this rank."""

    def __init__(self, rank: int, runner: ModelRunner, conn: Any) -> None:
        self.rank = rank
        self.runner = runner
        self._conn = conn
        self.state: dict[str, Any] = {}
        """What calls keep between them (e.g. a KV transfer agent), by name."""
        self.tickers: list[Callable[[], list[Any]]] = []
        """Polled between commands while present; what they return goes to the
        lead as events."""
        self.closers: list[Callable[[], None]] = []
        """Run when the rank stops."""

    def send_event(self, event: Any) -> None:
        """Tell the lead something (read by ``LeadRunner.events``)."""
        self._conn.send(("event", event))

    def tick(self) -> None:
        for ticker in list(self.tickers):
            for event in ticker():
                self.send_event(event)


def _watch_parent(parent_pid: int) -> None:
    # The lead may be killed outright; a rank must not outlive it.
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(1)


def follower_main(
    config: EngineConfig,
    model_config: ModelConfig,
    rank: int,
    store_port: int,
    conn: multiprocessing.connection.Connection,
    parent_pid: int,
    log_level: int,
    cpu_threads: int,
) -> None:
    logging.basicConfig(
        level=log_level or logging.INFO,
        format=f"%(asctime)s %(levelname)s [tp-rank-{rank}] %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    # Ctrl-C reaches the whole process group; the lead decides when ranks stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    if config.device == "cpu":
        torch.set_num_threads(cpu_threads)
    try:
        device = torch.device(config.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # The lead builds its side of the group only after every rank got here:
        # a rank that fails before it cannot leave the lead waiting to join.
        conn.send(("joining", None))
        group = TPGroup(
            Shard(rank, config.tp_size), follower_store(store_port, config.tp_size), device
        )
        runner = ModelRunner(config, model_config, group)
    except Exception as e:
        log.error("startup failed:\n%s", traceback.format_exc())
        conn.send(("error", f"{type(e).__name__}: {e}"))
        sys.exit(1)
    conn.send(("ready", os.getpid()))
    ctx = RankContext(rank, runner, conn)
    try:
        _serve(ctx, conn)
    finally:
        for close in reversed(ctx.closers):
            try:
                close()
            except Exception:
                log.exception("closing rank %d failed", rank)


def _serve(ctx: RankContext, conn: multiprocessing.connection.Connection) -> None:
    runner = ctx.runner
    device = runner.device
    while True:
        if not conn.poll(TICK_S if ctx.tickers else None):
            ctx.tick()
            continue
        try:
            msg = conn.recv()
        except EOFError:
            return
        kind = msg[0]
        if kind == "forward":
            meta: BatchMeta = msg[1]
            flat = torch.empty(sum(meta.sizes), dtype=torch.int64, device=device)
            assert runner.tp is not None
            runner.tp.broadcast(flat)
            ids, pos, pages, slots, logits = flat.split(list(meta.sizes))
            runner.forward_logits(
                ForwardBatch(
                    ids,
                    pos,
                    meta.seq_lens,
                    meta.extend_lens,
                    meta.page_tables,
                    pages,
                    slots,
                    logits,
                )
            )
        elif kind == "call":
            _, fn, args, reply = msg
            try:
                result = fn(ctx, *args)
            except Exception as e:
                if not reply:
                    raise
                conn.send(("error", f"{type(e).__name__}: {e}"))
            else:
                if reply:
                    conn.send(("result", result))
        elif kind == "stop":
            return
        if ctx.tickers:
            ctx.tick()
