"""Command line of ``python -m prefill_server`` / ``python -m decode_server``."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Sequence

from worker.config import ATTENTION_BACKENDS, LOG_LEVELS, TRANSFER_BACKENDS, WorkerConfig
from worker.roles import Role

CLUSTER_TOKEN_ENV = "DISAGG_CLUSTER_TOKEN"
REGISTER_KEY_ENV = "DISAGG_REGISTER_KEY"


def _optional_int(text: str) -> int | None:
    return None if text.lower() in ("auto", "none") else int(text)


def build_parser(prog: str, roles: Sequence[Role], default_port: int) -> argparse.ArgumentParser:
    """The parser of a server offering ``roles``; the first is the default."""
    default_role = roles[0].name
    d = WorkerConfig(role=default_role, port=default_port)
    ap = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Run one worker: an HTTP front (/health, /metrics, /server_info) and an "
            "engine process serving the request plane (ZMQ) for the gateway."
        ),
        epilog="Roles: " + "; ".join(f"{r.name}: {r.help}" for r in roles),
    )
    net = ap.add_argument_group("role and network")
    net.add_argument(
        "--role",
        choices=[r.name for r in roles],
        default=default_role,
        help="what this worker does (default: %(default)s); see the roles below",
    )
    net.add_argument(
        "--host",
        default=d.host,
        help="address to bind HTTP, the request plane and the KV plane to "
        "(default: %(default)s; 0.0.0.0 for all interfaces)",
    )
    net.add_argument(
        "--advertise-host",
        default=None,
        help="host name/IP put in the URL and endpoints this worker advertises "
        "(default: --host, or this machine's address when --host is a wildcard)",
    )
    net.add_argument(
        "--port", type=int, default=default_port, help="HTTP port (default: %(default)s)"
    )
    net.add_argument(
        "--request-port",
        type=int,
        default=d.request_port,
        help="request-plane (ZMQ ROUTER) port; 0 picks a free port at start, shown "
        "in /server_info as request_endpoint (default: %(default)s)",
    )
    net.add_argument(
        "--bootstrap-port",
        type=int,
        default=d.bootstrap_port,
        help="KV-plane bootstrap port of the prefill/decode roles; 0 picks a free "
        "port, shown in /server_info as bootstrap_endpoint (default: %(default)s)",
    )
    net.add_argument(
        "--register",
        metavar="GATEWAY_URL",
        default=None,
        help="once healthy, register with the gateway at this base URL "
        "(POST GATEWAY_URL/admin/workers; best effort, retried)",
    )
    net.add_argument(
        "--register-key",
        default=os.environ.get(REGISTER_KEY_ENV),
        help="bearer key for the gateway's admin API when registering: the gateway's "
        f"--admin-key (default: ${REGISTER_KEY_ENV}, else the cluster token)",
    )

    model = ap.add_argument_group("model")
    model.add_argument(
        "--model",
        default=None,
        help="HF checkpoint directory (config.json + safetensors), or a preset name "
        "with --load-format dummy (default: the built-in tiny model)",
    )
    model.add_argument(
        "--served-model-name",
        default=None,
        help="model name reported to clients (default: the checkpoint directory's name)",
    )
    model.add_argument(
        "--load-format",
        choices=["auto", "dummy"],
        default=d.load_format,
        help="auto: weights from the checkpoint; dummy: random weights (default: %(default)s)",
    )
    model.add_argument(
        "--device",
        default=d.device,
        help="torch device, e.g. cpu, cuda, cuda:1; auto picks cuda when available "
        "(default: %(default)s)",
    )
    model.add_argument(
        "--dtype",
        default=d.dtype,
        help="auto (from config.json), float32, bfloat16 or float16 (default: %(default)s)",
    )
    model.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default=d.attention_backend,
        help="attention kernels: flashinfer (CUDA, bf16/fp16), torch_native (any device); "
        "auto picks flashinfer where it can run (default: %(default)s)",
    )
    model.add_argument(
        "--cuda-graph-max-bs",
        type=_optional_int,
        default=None,
        help="largest decode batch run as a CUDA graph; 0 disables graphs (default: auto, "
        "min(--max-running-requests, 64) with flashinfer attention, else 0)",
    )
    model.add_argument(
        "--context-length",
        type=_optional_int,
        default=None,
        help="longest prompt plus output (default: the model's max_position_embeddings)",
    )
    model.add_argument("--seed", type=int, default=d.seed, help="engine seed for unseeded requests")

    kv = ap.add_argument_group("KV cache and scheduling")
    kv.add_argument(
        "--page-size",
        type=int,
        default=d.page_size,
        help="tokens per KV page (default: %(default)s)",
    )
    kv.add_argument(
        "--num-pages",
        type=_optional_int,
        default=None,
        help="pages in the KV pool (page 0 is reserved); default: sized from --kv-cache-memory-gb",
    )
    kv.add_argument(
        "--kv-cache-memory-gb",
        type=float,
        default=d.kv_cache_memory_gb,
        help="memory of the KV pool when --num-pages is not given (default: %(default)s)",
    )
    kv.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help="token budget of one forward: prefill chunks plus decode tokens "
        "(default: %(default)s)",
    )
    kv.add_argument(
        "--chunk-size",
        type=_optional_int,
        default=None,
        help="largest prefill chunk of one request per step (default: the token budget)",
    )
    kv.add_argument(
        "--max-running-requests",
        type=int,
        default=d.max_running_requests,
        help="requests admitted at once (default: %(default)s)",
    )
    kv.add_argument(
        "--enable-prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=d.enable_prefix_cache,
        help="share KV of common prompt prefixes across requests (default: on)",
    )

    xfer = ap.add_argument_group("KV transfer and timeouts")
    xfer.add_argument(
        "--transfer-backend",
        choices=list(TRANSFER_BACKENDS),
        default=d.transfer_backend,
        help="how KV pages move between prefill and decode workers: nixl "
        "(NVLink/RDMA) or tcp (default: %(default)s)",
    )
    xfer.add_argument(
        "--cluster-token",
        default=os.environ.get(CLUSTER_TOKEN_ENV),
        help="shared secret of the KV plane, also sent to the gateway on "
        f"registration (default: ${CLUSTER_TOKEN_ENV}; prefer the variable, "
        "command lines are visible to other users)",
    )
    xfer.add_argument(
        "--transfer-timeout-s",
        type=float,
        default=d.transfer_timeout_s,
        help="fail a KV transfer (and its request) that takes longer (default: %(default)s)",
    )
    xfer.add_argument(
        "--request-timeout-s",
        type=float,
        default=d.request_timeout_s,
        help="fail a request still in the engine after this many seconds, e.g. one "
        "whose requester vanished without aborting; 0 disables (default: %(default)s)",
    )
    ap.add_argument(
        "--log-level",
        choices=list(LOG_LEVELS),
        default=d.log_level,
        help="log level of both processes (default: %(default)s)",
    )
    return ap


def config_from_args(ns: argparse.Namespace) -> WorkerConfig:
    names = {f.name for f in dataclasses.fields(WorkerConfig)}
    return WorkerConfig(**{k: v for k, v in vars(ns).items() if k in names})


def main(
    argv: list[str] | None = None, *, prog: str, roles: Sequence[Role], default_port: int
) -> None:
    """Parse the command line and run the worker until it is stopped."""
    parser = build_parser(prog, roles, default_port)
    ns = parser.parse_args(argv)
    try:
        config = config_from_args(ns)
    except ValueError as e:
        parser.error(str(e))
    from worker.front import run_worker

    role = next(r for r in roles if r.name == config.role)
    run_worker(config, role)
