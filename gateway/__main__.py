"""``python -m gateway``: the OpenAI-compatible gateway.

With no ``--prefill``/``--decode`` workers it starts one local prefill and one
local decode worker (the built-in tiny model, or ``--model``) and stops them
when it stops.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
from collections.abc import Iterator
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from gateway.admission import AdmissionConfig
from gateway.app import build_app
from gateway.config import LOG_LEVELS, GatewayConfig
from gateway.dispatch import Dispatcher
from gateway.routing import DECODE_POLICIES, PREFILL_POLICIES, HealthChecker, Router, RouterConfig
from gateway.state import GatewayState
from protocol.auth import keys_for
from protocol.host import AUTO_BUSY_POLL_S, BUSY_POLL_MIN_CORES

CLUSTER_TOKEN_ENV = "DISAGG_CLUSTER_TOKEN"
log = logging.getLogger("gateway")

if TYPE_CHECKING:
    from gateway.embedded import EmbeddedConfig


def _optional_seconds(text: str) -> float | None:
    if text.lower() == "auto":
        return None
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be >= 0 or auto")
    return value


def build_parser() -> argparse.ArgumentParser:
    # Imported here, not at the top: gateway.embedded imports worker modules,
    # and importing the gateway imports none (its process stays torch-free).
    from gateway.embedded import EmbeddedConfig, add_embedded_flags

    gw, rc, em, ad = GatewayConfig(), RouterConfig(), EmbeddedConfig(), AdmissionConfig()
    ap = argparse.ArgumentParser(
        prog="python -m gateway",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--host", default=gw.host, help="address to serve on (default: %(default)s)")
    ap.add_argument("--port", type=int, default=gw.port, help="HTTP port (default: %(default)s)")
    ap.add_argument(
        "--prefill", nargs="*", default=list(gw.prefill), metavar="URL", help="prefill worker URLs"
    )
    ap.add_argument(
        "--decode",
        nargs="*",
        default=list(gw.decode),
        metavar="URL",
        help="decode (or --role both) worker URLs",
    )
    ap.add_argument(
        "--served-model-name",
        default=gw.served_model_name,
        help="model name clients use (default: the workers')",
    )
    ap.add_argument(
        "--api-key", default=gw.api_key, help="require 'Authorization: Bearer KEY' on /v1/*"
    )
    ap.add_argument(
        "--admin-key",
        default=gw.admin_key,
        help="require this bearer key on /admin/* (worker registration; default: the "
        "cluster token; with neither, the admin API refuses every call)",
    )
    ap.add_argument(
        "--cluster-token",
        default=os.environ.get(CLUSTER_TOKEN_ENV) or None,
        help=f"the workers' shared secret (default: ${CLUSTER_TOKEN_ENV}; prefer the "
        "variable, command lines are visible to other users): the request plane is "
        "authenticated and encrypted with keys derived from it",
    )
    ap.add_argument(
        "--wait-for-workers",
        action="store_true",
        help="with no --prefill/--decode, start no embedded workers: serve the workers "
        "that register (--register on the workers)",
    )
    ap.add_argument(
        "--worker-startup-timeout-s",
        type=float,
        default=gw.worker_startup_timeout_s,
        help="while no worker is up, a request waits this long for one before it fails "
        "with 503 (default: %(default)s)",
    )
    ap.add_argument(
        "--shutdown-timeout-s",
        type=float,
        default=gw.shutdown_timeout_s,
        help="on SIGTERM/Ctrl-C, in-flight requests may finish for this long; the rest "
        "are then aborted on the workers (default: %(default)s)",
    )
    ap.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=ad.max_concurrent_requests,
        help="generation requests served at once; more wait in a bounded queue or get 429 "
        "(default: %(default)s, no limit)",
    )
    ap.add_argument(
        "--max-queued-tokens",
        type=int,
        default=ad.max_queued_tokens,
        help="prompt plus max_tokens of the requests waiting for a slot; beyond it, 429 "
        "with Retry-After (default: %(default)s)",
    )
    ap.add_argument(
        "--max-queue-wait-s",
        type=float,
        default=ad.max_queue_wait_s,
        help="a queued request waits this long for a slot, then gets 429 (default: %(default)s)",
    )
    ap.add_argument(
        "--max-requests-per-worker",
        type=int,
        default=rc.max_requests_per_worker,
        help="requests one worker gets at once (default: %(default)s, no bound)",
    )
    ap.add_argument(
        "--prefill-policy",
        default=rc.prefill_policy,
        choices=sorted(PREFILL_POLICIES),
        help="how a prefill worker is picked (default: %(default)s)",
    )
    ap.add_argument(
        "--decode-policy",
        default=rc.decode_policy,
        choices=sorted(DECODE_POLICIES),
        help="how a decode worker is picked (default: %(default)s)",
    )
    ap.add_argument(
        "--skip-prefill-threshold",
        type=int,
        default=rc.skip_prefill_threshold,
        help="prompts of at most this many tokens go to a decode worker alone (0: never)",
    )
    ap.add_argument(
        "--request-timeout-s",
        type=float,
        default=gw.request_timeout_s,
        help=f"every request ends within this many seconds (default: {gw.request_timeout_s:g})",
    )
    ap.add_argument(
        "--worker-timeout-s",
        type=float,
        default=gw.worker_timeout_s,
        help="fail a request when its worker sends nothing for this long "
        f"(default: {gw.worker_timeout_s:g})",
    )
    ap.add_argument(
        "--connect-timeout-s",
        type=float,
        default=gw.connect_timeout_s,
        help="how long a request waits for a connection to the worker it was routed to "
        f"before it is sent to another worker (default: {gw.connect_timeout_s:g})",
    )
    ap.add_argument(
        "--health-interval-s",
        type=float,
        default=rc.health_interval_s,
        help="seconds between two health checks of a worker; a worker failing two in a row "
        "takes no new requests until one passes (default: %(default)s)",
    )
    ap.add_argument(
        "--health-timeout-s",
        type=float,
        default=rc.health_timeout_s,
        help="HTTP timeout of one health check (default: %(default)s)",
    )
    ap.add_argument(
        "--max-body-bytes",
        type=int,
        default=gw.max_body_bytes,
        help=f"largest request body (default: {gw.max_body_bytes / (1 << 20):g} MiB)",
    )
    ap.add_argument(
        "--busy-poll-s",
        type=_optional_seconds,
        default=gw.busy_poll_s,
        metavar="SECONDS",
        help="while requests are in flight and this long after the last one, the "
        "event loop polls instead of sleeping, so that a worker's first token or the "
        "next request is read at once rather than after the CPU wakes from idle "
        "(0.1-0.4 ms per wake on virtualized hosts); spins one core meanwhile; 0 "
        f"disables; auto: {AUTO_BUSY_POLL_S:g} with {BUSY_POLL_MIN_CORES} or more usable cores, else "
        "0 (default: auto)",
    )
    ap.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=gw.max_prompt_tokens,
        help="largest prompt in tokens (default: the model's context window)",
    )
    emb = ap.add_argument_group(
        "embedded workers (used when no --prefill/--decode is given): the workers' own flags"
    )
    add_embedded_flags(emb)
    emb.add_argument(
        "--prefill-device", default=em.prefill_device, help="device of the prefill worker"
    )
    emb.add_argument(
        "--decode-device",
        default=em.decode_device,
        help="device of the decode worker (default: with --device auto or cuda and two or "
        "more GPUs, prefill and decode each on their own; else both on --device, each "
        "taking half of --gpu-memory-utilization)",
    )
    ap.add_argument("--log-level", default=gw.log_level, choices=LOG_LEVELS)
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
    try:
        router_cfg = RouterConfig(
            prefill_policy=args.prefill_policy,
            decode_policy=args.decode_policy,
            skip_prefill_threshold=args.skip_prefill_threshold,
            health_interval_s=args.health_interval_s,
            health_timeout_s=args.health_timeout_s,
            max_requests_per_worker=args.max_requests_per_worker,
        )
        admission = AdmissionConfig(
            max_concurrent_requests=args.max_concurrent_requests,
            max_queued_tokens=args.max_queued_tokens,
            max_queue_wait_s=args.max_queue_wait_s,
        )
    except ValueError as e:  # bad flag values: a usage error, not a traceback
        parser.error(str(e))
    with contextlib.ExitStack() as stack:
        prefill, decode = tuple(args.prefill), tuple(args.decode)
        token = args.cluster_token
        if not prefill and not decode and not args.wait_for_workers:
            from gateway.embedded import EmbeddedWorkers

            try:
                emb = stack.enter_context(EmbeddedWorkers(_embedded_config(args), token))
            except RuntimeError as e:  # its own log says why, above
                log.error("%s; its log above says why", e)
                raise SystemExit(1) from None
            prefill, decode = (emb.prefill_url,), (emb.decode_url,)
            token = emb.cluster_token
        try:
            cfg = _gateway_config(args, prefill, decode, router_cfg, admission, token)
        except ValueError as e:
            parser.error(str(e))
        if cfg.admin_bearer is None:
            log.warning(
                "no --admin-key and no cluster token: the admin API (worker registration) "
                "refuses every call"
            )
        router = Router(router_cfg)
        state = GatewayState(
            cfg,
            router,
            HealthChecker(router),
            Dispatcher(
                router,
                cfg.worker_timeout_s,
                cfg.connect_timeout_s,
                auth=keys_for(token),
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
        server.run()


def _embedded_config(args: argparse.Namespace) -> EmbeddedConfig:
    from gateway.embedded import EMBEDDED_SETTINGS, EmbeddedConfig

    return EmbeddedConfig.from_settings(
        prefill_device=args.prefill_device,
        decode_device=args.decode_device,
        **{name: getattr(args, name) for name in EMBEDDED_SETTINGS},
    )


def _gateway_config(
    args: argparse.Namespace,
    prefill: tuple[str, ...],
    decode: tuple[str, ...],
    router_cfg: RouterConfig,
    admission: AdmissionConfig,
    cluster_token: str | None,
) -> GatewayConfig:
    return GatewayConfig(
        host=args.host,
        port=args.port,
        prefill=prefill,
        decode=decode,
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        admin_key=args.admin_key,
        cluster_token=cluster_token,
        router=router_cfg,
        admission=admission,
        worker_startup_timeout_s=args.worker_startup_timeout_s,
        shutdown_timeout_s=args.shutdown_timeout_s,
        request_timeout_s=args.request_timeout_s,
        worker_timeout_s=args.worker_timeout_s,
        connect_timeout_s=args.connect_timeout_s,
        max_body_bytes=args.max_body_bytes,
        max_prompt_tokens=args.max_prompt_tokens,
        log_level=args.log_level,
        busy_poll_s=args.busy_poll_s,
    )


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
