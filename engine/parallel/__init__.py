"""Tensor parallelism inside one engine: how weights and KV heads are split
across ranks (``shard``), the ranks' process group (``group``), the sharded
layers (``layers``) and the rank processes that mirror the lead's forwards
(``ranks``, ``follower``)."""
