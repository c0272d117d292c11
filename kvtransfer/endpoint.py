"""Binding of the KV plane's ROUTER sockets."""

from __future__ import annotations

import zmq

PEER_HEARTBEAT_IVL_S = 0.5
PEER_HEARTBEAT_TIMEOUT_S = 1.5
"""ZMTP heartbeats on a decode engine's connection to each prefill engine: a
prefill engine silent this long (no PONG: libzmq answers PINGs in its own I/O
thread, so a busy engine still answers) is taken as gone, within the timeout
rather than at a transfer deadline."""


def bind_router(host: str, port: int) -> tuple[zmq.Socket, str]:
    """A ROUTER bound at ``host:port`` (0 picks a free port) and its endpoint."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    if port == 0:
        port = sock.bind_to_random_port(f"tcp://{host}")
    else:
        sock.bind(f"tcp://{host}:{port}")
    return sock, f"tcp://{host}:{port}"
