"""Gateway replicas: several gateway processes serving one port, and the
passing on of worker registrations between replicas.

``--replicas N`` starts N - 1 more ``python -m gateway`` processes with this
one's settings. All N bind the port with SO_REUSEPORT (the kernel spreads
incoming connections over them) and each also serves 127.0.0.1 on a port of
its own, through which the others pass on what the admin API was told (a
worker registering with one replica is added to all). Each replica routes on
its own: its own health checks, its own connection to every worker, the same
KV events; no shared store. Admission limits hold per replica: N replicas
admit N times ``--max-concurrent-requests`` in all.

Replicas on several hosts are the same gateway started on each host with
``--peers`` naming the others (or workers that ``--register`` with every
address a name resolves to: a headless Kubernetes Service).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import httpx

from gateway.config import GatewayConfig
from protocol.settings import CLUSTER_TOKEN_ENV

log = logging.getLogger(__name__)

PEER_HEADER = "X-Gateway-Peer"
"""Set on what one replica passes on to another: not passed on again."""
FORWARD_ATTEMPTS = 5


def _free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_replicas(cfg: GatewayConfig) -> tuple[GatewayConfig, list[subprocess.Popen[bytes]]]:
    """Start ``cfg.replicas - 1`` more gateways sharing ``cfg.port``; returns
    this process's config (one replica of them) and the others' processes."""
    ports = [_free_loopback_port() for _ in range(cfg.replicas)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    env = dict(os.environ)
    if cfg.cluster_token:  # by environment, never on a command line
        env[CLUSTER_TOKEN_ENV] = cfg.cluster_token
    procs = []
    for i in range(1, cfg.replicas):
        child = replace(
            cfg,
            replicas=1,
            reuse_port=True,
            replica_port=ports[i],
            peers=tuple(u for j, u in enumerate(urls) if j != i),
            cluster_token=None,
            wait_for_workers=cfg.wait_for_workers or not (cfg.prefill or cfg.decode),
        )
        argv = [sys.executable, "-m", "gateway", *child.to_argv()]
        procs.append(subprocess.Popen(argv, env=env))
    own = replace(cfg, replicas=1, reuse_port=True, replica_port=ports[0], peers=tuple(urls[1:]))
    log.info(
        "%d gateway replicas serve port %d (pids %s and this one)",
        cfg.replicas,
        cfg.port,
        ", ".join(str(p.pid) for p in procs),
    )
    return own, procs


def stop_replicas(procs: Iterable[subprocess.Popen[bytes]], timeout_s: float) -> None:
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout_s + 5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def bind_sockets(cfg: GatewayConfig) -> list[socket.socket] | None:
    """The listening sockets when this gateway shares its port (None: let
    the server bind ``host:port`` alone)."""
    if not cfg.reuse_port and not cfg.replica_port:
        return None
    family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
    shared = socket.socket(family, socket.SOCK_STREAM)
    shared.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if cfg.reuse_port:
        shared.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    shared.bind((cfg.host, cfg.port))
    out = [shared]
    if cfg.replica_port:
        own = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        own.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        own.bind(("127.0.0.1", cfg.replica_port))
        out.append(own)
    for s in out:
        s.listen(2048)
        s.set_inheritable(True)
    return out


async def pass_on(peers: Iterable[str], method: str, path: str, key: str | None, **kw: Any) -> None:
    """Tell every peer replica what this one's admin API was told (retrying a
    peer that is not up yet); failures are logged, never raised."""
    headers = {PEER_HEADER: "1"}
    if key:
        headers["Authorization"] = f"Bearer {key}"

    async def one(client: httpx.AsyncClient, peer: str) -> None:
        delay = 0.2
        for attempt in range(1, FORWARD_ATTEMPTS + 1):
            try:
                resp = await client.request(method, f"{peer}{path}", headers=headers, **kw)
                if resp.status_code < 500:
                    if not resp.is_success:
                        log.warning(
                            "peer %s answered %d: %s", peer, resp.status_code, resp.text[:200]
                        )
                    return
            except httpx.HTTPError as e:
                if attempt == FORWARD_ATTEMPTS:
                    log.warning("could not pass %s %s on to peer %s: %s", method, path, peer, e)
                    return
            await asyncio.sleep(delay)
            delay *= 2

    async with httpx.AsyncClient(timeout=30.0) as client:
        await asyncio.gather(*(one(client, p.rstrip("/")) for p in peers))
