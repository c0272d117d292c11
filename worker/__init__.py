"""Worker runtime shared by ``python -m prefill_server`` and ``python -m decode_server``:
an HTTP front process plus an engine process joined by ZMQ IPC (see ``front``
and ``engine_proc``). Importing this package does not import torch."""

from worker.config import WorkerConfig

__all__ = ["WorkerConfig"]
