"""The device process group of an engine's tensor-parallel ranks: all-reduce
after the row-parallel layers, the gather of vocab-parallel logits, and the
broadcast of each step's token tensors from the lead.

Built from backend objects on a store of its own rather than torch's global
process group, so several engines (tests, the offline API) can live in one
process. Gloo on CPU, NCCL on CUDA; NCCL collectives are ordered on the
current stream, so they can be captured in CUDA graphs."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from engine.parallel.shard import Shard

STORE_TIMEOUT_S = 300.0
"""How long a rank waits for the others to join (they load torch and the model)."""
COLLECTIVE_TIMEOUT_S = 300.0
"""How long a collective waits for a slow rank (CUDA-graph capture, first use).
A dead rank fails the collectives of the others at once on gloo; on NCCL the
lead's rank watch ends the process instead (see ``engine.parallel.ranks``)."""


def lead_store(size: int) -> dist.TCPStore:
    """The rendezvous store, hosted by the lead on a free loopback port."""
    return dist.TCPStore(
        "127.0.0.1",
        0,
        size,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S),
    )


def follower_store(port: int, size: int) -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1",
        port,
        size,
        is_master=False,
        timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S),
    )


class TPGroup:
    def __init__(self, shard: Shard, store: dist.Store, device: torch.device) -> None:
        self.shard = shard
        self.device = device
        prefixed = dist.PrefixStore("tp/", store)
        timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self._pg: dist.ProcessGroup = dist.ProcessGroupNCCL(
                prefixed, shard.rank, shard.size, opts
            )
        else:
            self._pg = dist.ProcessGroupGloo(prefixed, shard.rank, shard.size, timeout)

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def size(self) -> int:
        return self.shard.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns it."""
        self._pg.allreduce([x]).wait()
        return x

    def all_min(self, value: int) -> int:
        """The smallest ``value`` of any rank."""
        x = torch.tensor([value], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self._pg.allreduce([x], opts).wait()
        return int(x.item())

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """``[n, vocab_size]`` from every rank's ``[n, shard]`` vocab columns."""
        n, per = logits.shape
        out = torch.empty(self.size * n * per, dtype=logits.dtype, device=logits.device)
        self._pg._allgather_base(out, logits.contiguous().view(-1)).wait()
        full = out.view(self.size, n, per).permute(1, 0, 2).reshape(n, self.size * per)
        # Padded shards: samplers read rows by their stride, so drop the padding
        # into a dense tensor.
        return full if self.size * per == vocab_size else full[:, :vocab_size].contiguous()

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """The lead's ``x`` on every rank (in place); returns it."""
        self._pg.broadcast(x, 0).wait()
        return x
