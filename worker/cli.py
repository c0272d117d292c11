"""Command line of ``python -m prefill_server`` / ``python -m decode_server``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from protocol import settings
from protocol.settings import CLUSTER_TOKEN_ENV as CLUSTER_TOKEN_ENV
from worker.config import REGISTER_KEY_ENV as REGISTER_KEY_ENV
from worker.config import WorkerConfig, flags, require_torch
from worker.roles import Role


def build_parser(prog: str, roles: Sequence[Role], default_port: int) -> argparse.ArgumentParser:
    """The parser of a server offering ``roles``; the first is the default.

    One flag per setting of ``WorkerConfig`` and of its ``EngineConfig``, made
    from the fields: name, type, default, choices, help and argument group.
    """
    ap = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Run one worker: an HTTP front (/health, /metrics, /server_info) and an "
            "engine process serving the request plane (ZMQ) for the gateway."
        ),
        epilog="Roles: " + "; ".join(f"{r.name}: {r.help}" for r in roles),
    )
    overrides = {
        "role": {"choices": [r.name for r in roles], "default": roles[0].name},
        "port": {"default": default_port},
    }
    settings.add_flags(ap, flags(), overrides=overrides)
    return ap


def config_from_args(ns: argparse.Namespace) -> WorkerConfig:
    return WorkerConfig.from_settings(**settings.values(ns, flags()))


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
    require_torch(f"{prog} runs an engine on torch")
    from worker.front import run_worker

    role = next(r for r in roles if r.name == config.role)
    run_worker(config, role)
