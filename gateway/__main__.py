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

import uvicorn

from gateway.app import GatewayState, build_app
from gateway.config import GatewayConfig
from gateway.dispatch import Dispatcher
from gateway.embedded import EmbeddedConfig, EmbeddedWorkers
from gateway.router import DECODE_POLICIES, PREFILL_POLICIES, HealthChecker, Router, RouterConfig


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m gateway",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--host", default="0.0.0.0", help="address to serve on (default: 0.0.0.0)")
    ap.add_argument("--port", type=int, default=8000, help="HTTP port (default: 8000)")
    ap.add_argument("--prefill", nargs="*", default=[], metavar="URL", help="prefill worker URLs")
    ap.add_argument(
        "--decode", nargs="*", default=[], metavar="URL", help="decode (or --role both) worker URLs"
    )
    ap.add_argument(
        "--served-model-name", default=None, help="model name clients use (default: the workers')"
    )
    ap.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    ap.add_argument(
        "--admin-key",
        default=None,
        help="require this bearer key on /admin/* (worker registration)",
    )
    ap.add_argument(
        "--prefill-policy",
        default="cache_aware",
        choices=sorted(PREFILL_POLICIES),
        help="how a prefill worker is picked (default: cache_aware)",
    )
    ap.add_argument(
        "--decode-policy",
        default="least_load",
        choices=sorted(DECODE_POLICIES),
        help="how a decode worker is picked (default: least_load)",
    )
    ap.add_argument(
        "--skip-prefill-threshold",
        type=int,
        default=0,
        help="prompts of at most this many tokens go to a decode worker alone (0: never)",
    )
    ap.add_argument(
        "--request-timeout-s",
        type=float,
        default=600.0,
        help="every request ends within this many seconds (default: 600)",
    )
    ap.add_argument(
        "--worker-timeout-s",
        type=float,
        default=120.0,
        help="fail a request when its worker sends nothing for this long (default: 120)",
    )
    ap.add_argument(
        "--connect-timeout-s",
        type=float,
        default=3.0,
        help="how long a request waits for a connection to the worker it was routed to "
        "before it is sent to another worker (default: 3)",
    )
    ap.add_argument(
        "--health-interval-s",
        type=float,
        default=RouterConfig.health_interval_s,
        help="seconds between two health checks of a worker; a worker failing two in a row "
        "takes no new requests until one passes (default: %(default)s)",
    )
    ap.add_argument(
        "--health-timeout-s",
        type=float,
        default=RouterConfig.health_timeout_s,
        help="HTTP timeout of one health check (default: %(default)s)",
    )
    ap.add_argument(
        "--max-body-bytes", type=int, default=4 << 20, help="largest request body (default: 4 MiB)"
    )
    ap.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="largest prompt in tokens (default: the model's context window)",
    )
    emb = ap.add_argument_group("embedded workers (used when no --prefill/--decode is given)")
    emb.add_argument(
        "--model", default=None, help="checkpoint dir (default: the built-in tiny model)"
    )
    emb.add_argument("--device", default="auto", help="device of both workers (default: auto)")
    emb.add_argument("--prefill-device", default=None, help="device of the prefill worker")
    emb.add_argument("--decode-device", default=None, help="device of the decode worker")
    emb.add_argument(
        "--transfer-backend",
        default="tcp",
        choices=["tcp", "nixl"],
        help="KV transfer backend between them (default: tcp)",
    )
    emb.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default: 16)")
    emb.add_argument(
        "--kv-cache-memory-gb", type=float, default=0.25, help="KV pool per worker (default: 0.25)"
    )
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return ap


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        router_cfg = RouterConfig(
            prefill_policy=args.prefill_policy,
            decode_policy=args.decode_policy,
            skip_prefill_threshold=args.skip_prefill_threshold,
            health_interval_s=args.health_interval_s,
            health_timeout_s=args.health_timeout_s,
        )
    except ValueError as e:  # bad flag values: a usage error, not a traceback
        parser.error(str(e))
    with contextlib.ExitStack() as stack:
        prefill, decode = tuple(args.prefill), tuple(args.decode)
        if not prefill and not decode:
            emb = stack.enter_context(
                EmbeddedWorkers(
                    EmbeddedConfig(
                        model=args.model,
                        device=args.device,
                        prefill_device=args.prefill_device,
                        decode_device=args.decode_device,
                        transfer_backend=args.transfer_backend,
                        page_size=args.page_size,
                        kv_cache_memory_gb=args.kv_cache_memory_gb,
                    )
                )
            )
            prefill, decode = (emb.prefill_url,), (emb.decode_url,)
        cfg = GatewayConfig(
            host=args.host,
            port=args.port,
            prefill=prefill,
            decode=decode,
            served_model_name=args.served_model_name,
            api_key=args.api_key,
            admin_key=args.admin_key,
            router=router_cfg,
            request_timeout_s=args.request_timeout_s,
            worker_timeout_s=args.worker_timeout_s,
            connect_timeout_s=args.connect_timeout_s,
            max_body_bytes=args.max_body_bytes,
            max_prompt_tokens=args.max_prompt_tokens,
        )
        router = Router(router_cfg)
        state = GatewayState(
            cfg,
            router,
            HealthChecker(router),
            Dispatcher(router, cfg.worker_timeout_s, cfg.connect_timeout_s),
        )
        server = _Server(
            uvicorn.Config(build_app(state), host=cfg.host, port=cfg.port, log_level=args.log_level)
        )
        server.run()


class _Server(uvicorn.Server):
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
