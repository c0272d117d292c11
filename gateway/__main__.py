"""``python -m gateway``: the OpenAI-compatible gateway.

With no ``--prefill``/``--decode`` workers it starts one local prefill and one
local decode worker (the built-in tiny model, or ``--model``) and stops them
when it stops.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
from collections.abc import Iterator
from dataclasses import replace
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from gateway.app import build_app
from gateway.config import GatewayConfig, flags
from gateway.dispatch import Dispatcher
from gateway.replicas import bind_sockets
from gateway.routing import HealthChecker, Router
from gateway.state import GatewayState
from protocol import settings
from protocol.auth import keys_for

log = logging.getLogger("gateway")

if TYPE_CHECKING:
    from gateway.embedded import EmbeddedConfig


def build_parser() -> argparse.ArgumentParser:
    """One flag per setting of ``GatewayConfig`` (its router's and admission
    queue's included) and of the embedded workers, made from the fields:
    name, type, default, choices, help and argument group."""
    # Imported here, not at the top: gateway.embedded imports worker modules,
    # and importing the gateway imports none (its process stays torch-free).
    from gateway import embedded

    ap = argparse.ArgumentParser(
        prog="python -m gateway",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    settings.add_flags(ap, flags())
    settings.add_flags(ap, embedded.flags(), group=embedded.EMBEDDED_GROUP)
    return ap


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.log_level != "debug":
        # httpx logs every call at INFO: every health check of every worker.
        logging.getLogger("httpx").setLevel(logging.WARNING)
    try:  # bad flag values: a usage error, not a traceback
        cfg = _gateway_config(args)
        embedded = None
        if not cfg.prefill and not cfg.decode and not cfg.wait_for_workers:
            embedded = _embedded_config(args)
    except ValueError as e:
        parser.error(str(e))
    with contextlib.ExitStack() as stack:
        if embedded is not None:
            from gateway.embedded import EmbeddedWorkers

            try:
                emb = stack.enter_context(EmbeddedWorkers(embedded, cfg.cluster_token))
            except RuntimeError as e:  # its own log says why, above
                log.error("%s; its log above says why", e)
                raise SystemExit(1) from None
            cfg = replace(
                cfg,
                prefill=(emb.prefill_url,),
                decode=(emb.decode_url,),
                cluster_token=emb.cluster_token,
            )
        if cfg.replicas > 1:
            from gateway.replicas import start_replicas, stop_replicas

            cfg, others = start_replicas(cfg)
            stack.callback(stop_replicas, others, cfg.shutdown_timeout_s)
        if cfg.admin_bearer is None:
            log.warning(
                "no --admin-key and no cluster token: the admin API (worker registration) "
                "refuses every call"
            )
        router = Router(cfg.router)
        state = GatewayState(
            cfg,
            router,
            HealthChecker(router),
            Dispatcher(
                router,
                cfg.worker_timeout_s,
                cfg.connect_timeout_s,
                auth=keys_for(cfg.cluster_token),
                wait_for_worker_s=cfg.worker_startup_timeout_s,
            ),
        )
        server = _Server(
            uvicorn.Config(
                build_app(state),
                host=cfg.host,
                port=cfg.port,
                log_level=cfg.log_level,
                timeout_graceful_shutdown=max(cfg.shutdown_timeout_s, 0.01),
            ),
            state,
        )
        server.run(sockets=bind_sockets(cfg))


def _gateway_config(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig.from_settings(**settings.values(args, flags()))


def _embedded_config(args: argparse.Namespace) -> EmbeddedConfig:
    from gateway import embedded

    return embedded.EmbeddedConfig.from_settings(**settings.values(args, embedded.flags()))


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: GatewayState) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            log.info(
                "%s: no new requests; %d in flight may finish within %gs, then the rest "
                "are aborted",
                signal.Signals(sig).name,
                self.state.admission.running,
                self.state.config.shutdown_timeout_s,
            )
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # Ctrl-C/SIGTERM end run() normally (uvicorn would re-raise them after
        # shutdown, killing the process before the embedded workers are stopped).
        old = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)


if __name__ == "__main__":
    main()
