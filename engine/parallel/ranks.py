"""The lead rank of a tensor-parallel engine and the processes of the others.

The lead (the process that owns the ``Engine``) runs the scheduler and
sampling; every other rank is a process of its own (one device each) that
builds its shard of the model and its own KV pool, then mirrors each forward
of the lead: the lead sends a step's host lists (sequence lengths, page
tables) down a pipe and broadcasts its token tensors over the device group,
so on CUDA nothing waits for the host. Logits are gathered on every rank
(vocab-parallel); only the lead samples.

Beyond forwards the pipe carries calls of module-level functions on a rank's
``RankContext`` (how the worker opens a rank's KV transfer agent and has it
write), with results or events coming back.

Losing a rank is fatal to the group: the lead's collectives fail (gloo), a
watch thread records why (``failure``), and on CUDA, where a collective
waiting for the lost rank never returns, it ends the lead process after a
grace period. A rank whose lead is gone exits by itself.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from engine.config import EngineConfig
from engine.forward_batch import ForwardBatch
from engine.model_config import ModelConfig
from engine.parallel.follower import BatchMeta, follower_main
from engine.parallel.group import TPGroup, lead_store
from engine.parallel.shard import Shard
from engine.runner import ModelRunner

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 300.0
"""How long the lead waits for the other ranks to load their shards."""
STOP_TIMEOUT_S = 10.0
CUDA_EXIT_GRACE_S = 10.0
"""On CUDA: how long after losing a rank the lead may take to stop on its own
before the watch ends the process (its collectives would wait forever)."""


def make_runner(config: EngineConfig, model_config: ModelConfig) -> ModelRunner:
    """The runner of a resolved config: one device, or the lead of ``tp_size`` ranks."""
    if config.tp_size == 1:
        return ModelRunner(config, model_config)
    return LeadRunner(config, model_config)


def rank_device(device: str, rank: int) -> str:
    """Rank ``rank``'s device: ``cuda:K`` -> ``cuda:K+rank``; CPU ranks share the CPU."""
    if not device.startswith("cuda"):
        return device
    _, _, index = device.partition(":")
    return f"cuda:{int(index or 0) + rank}"


class RankError(RuntimeError):
    """A rank failed to start or to run a call; the message says why."""


@dataclass
class _Rank:
    rank: int
    proc: multiprocessing.process.BaseProcess
    conn: multiprocessing.connection.Connection
    events: list[Any]
    """Events it sent while the lead waited for something else."""


class LeadRunner(ModelRunner):
    def __init__(self, config: EngineConfig, model_config: ModelConfig) -> None:
        size = config.tp_size
        device = torch.device(config.device)
        if device.type == "cuda":
            first = device.index or 0
            if first + size > torch.cuda.device_count():
                raise RankError(
                    f"tp_size {size} from {config.device} needs cuda:{first}..cuda:{first + size - 1}"
                    f" but {torch.cuda.device_count()} CUDA device(s) are visible"
                )
        self._closing = False
        self._failure: str | None = None
        self._on_cuda = device.type == "cuda"
        self._store = lead_store(size)
        spawn = multiprocessing.get_context("spawn")
        self._ranks: list[_Rank] = []
        try:
            for rank in range(1, size):
                ours, theirs = spawn.Pipe()
                proc = spawn.Process(
                    target=follower_main,
                    args=(
                        replace(config, device=rank_device(config.device, rank)),
                        model_config,
                        rank,
                        self._store.port,
                        theirs,
                        os.getpid(),
                        logging.getLogger().level,
                        # CPU ranks share the cores the lead was given.
                        max(1, torch.get_num_threads() // size),
                    ),
                    name=f"tp-rank-{rank}",
                    daemon=True,
                )
                proc.start()
                theirs.close()
                self._ranks.append(_Rank(rank, proc, ours, []))
            threading.Thread(target=self._watch, name="tp-rank-watch", daemon=True).start()
            deadline = time.monotonic() + READY_TIMEOUT_S
            for r in self._ranks:
                kind, value = self._receive(r, deadline, ("joining", "error"))
                if kind == "error":
                    raise RankError(f"tensor-parallel rank {r.rank} failed to start: {value}")
            if device.type == "cuda":
                torch.cuda.set_device(device)
            group = TPGroup(Shard(0, size), self._store, device)
            super().__init__(config, model_config, group)
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    # -- ranks -------------------------------------------------------------------

    @property
    def rank_pids(self) -> list[int]:
        """Process ids of ranks 1..N-1 (the lead is this process)."""
        return [r.proc.pid for r in self._ranks if r.proc.pid is not None]

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        for r in self._ranks:
            kind, value = self._receive(r, deadline, ("ready", "error"))
            if kind == "error":
                raise RankError(f"tensor-parallel rank {r.rank} failed to start: {value}")
        log.info("tensor-parallel group of %d ranks ready", len(self._ranks) + 1)

    def _watch(self) -> None:
        by_sentinel = {r.proc.sentinel: r for r in self._ranks}
        gone = multiprocessing.connection.wait(list(by_sentinel))
        if self._closing:
            return
        r = by_sentinel[gone[0]]  # type: ignore[index]
        r.proc.join(1.0)
        self._failure = (
            f"tensor-parallel rank {r.rank} (pid {r.proc.pid}) exited with code {r.proc.exitcode}"
        )
        log.error("%s; the engine cannot run forwards any more", self._failure)
        if self._on_cuda:
            time.sleep(CUDA_EXIT_GRACE_S)
            if not self._closing:
                log.error("the engine did not stop after losing a rank; exiting")
                os._exit(1)

    def failure(self) -> str | None:
        return self._failure

    def _send(self, r: _Rank, msg: tuple[Any, ...]) -> None:
        try:
            r.conn.send(msg)
        except OSError as e:
            raise RankError(
                self._failure or f"tensor-parallel rank {r.rank} is unreachable: {e}"
            ) from None

    def _receive(self, r: _Rank, deadline: float, kinds: tuple[str, ...]) -> tuple[str, Any]:
        """The next message of one of ``kinds`` from ``r``; events meanwhile are kept."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RankError(f"tensor-parallel rank {r.rank} did not answer in time")
            try:
                if not r.conn.poll(min(left, 0.5)):
                    if not r.proc.is_alive():
                        raise RankError(
                            f"tensor-parallel rank {r.rank} exited with code {r.proc.exitcode}"
                        )
                    continue
                msg = r.conn.recv()
            except (EOFError, OSError):
                r.proc.join(1.0)
                raise RankError(
                    f"tensor-parallel rank {r.rank} exited with code {r.proc.exitcode}"
                ) from None
            if msg[0] == "event":
                r.events.append(msg[1])
            elif msg[0] in kinds:
                return msg[0], msg[1]

    def post(self, rank: int, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(ctx, *args)`` on ``rank`` (>= 1) without waiting."""
        self._send(self._ranks[rank - 1], ("call", fn, args, False))

    def call(self, rank: int, fn: Callable[..., Any], *args: Any, timeout: float = 60.0) -> Any:
        """``fn(ctx, *args)`` run on ``rank`` (>= 1); its result (raises ``RankError``)."""
        r = self._ranks[rank - 1]
        self._send(r, ("call", fn, args, True))
        kind, value = self._receive(r, time.monotonic() + timeout, ("result", "error"))
        if kind == "error":
            raise RankError(f"tensor-parallel rank {rank}: {value}")
        return value

    def events(self) -> list[tuple[int, Any]]:
        """Events the ranks sent since the last call (rank, event), without waiting."""
        out: list[tuple[int, Any]] = []
        for r in self._ranks:
            out.extend((r.rank, e) for e in r.events)
            r.events.clear()
            try:
                while r.conn.poll(0):
                    msg = r.conn.recv()
                    if msg[0] == "event":
                        out.append((r.rank, msg[1]))
            except (EOFError, OSError):
                raise RankError(self._failure or f"tensor-parallel rank {r.rank} is gone") from None
        return out

    # -- forwards ----------------------------------------------------------------

    @torch.inference_mode()
    def forward_logits(self, batch: ForwardBatch) -> torch.Tensor:
        tensors = (
            batch.input_ids,
            batch.positions,
            batch.write_pages,
            batch.write_slots,
            batch.logits_indices,
        )
        meta = BatchMeta(
            batch.seq_lens,
            batch.extend_lens,
            batch.page_tables,
            tuple(t.numel() for t in tensors),
        )
        for r in self._ranks:
            self._send(r, ("forward", meta))
        assert self.tp is not None
        # Queued on the stream behind whatever wrote the ids (the tokens the
        # forward in flight samples): no wait for the host.
        self.tp.broadcast(torch.cat(tensors))
        return super().forward_logits(batch)

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        for r in self._ranks:
            with contextlib.suppress(OSError):
                r.conn.send(("stop",))
        for r in self._ranks:
            r.proc.join(STOP_TIMEOUT_S)
            if r.proc.is_alive():
                log.warning("tensor-parallel rank %d did not stop; killing it", r.rank)
                r.proc.kill()
                r.proc.join(5.0)
            r.conn.close()
