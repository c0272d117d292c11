"""Command line of ``python -m prefill_server`` / ``python -m decode_server``."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

from worker.config import CLUSTER_TOKEN_ENV as CLUSTER_TOKEN_ENV
from worker.config import REGISTER_KEY_ENV as REGISTER_KEY_ENV
from worker.config import Flag, WorkerConfig, flags
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
    groups: dict[str | None, argparse._ActionsContainer] = {None: ap}
    for flag in flags():
        title = flag.meta("group")
        if title not in groups:
            groups[title] = ap.add_argument_group(title)
        overrides: dict[str, Any] = {}
        if flag.name == "role":
            overrides = {"choices": [r.name for r in roles], "default": roles[0].name}
        elif flag.name == "port":
            overrides = {"default": default_port}
        add_flag(groups[title], flag, **overrides)
    return ap


def add_flag(container: argparse._ActionsContainer, flag: Flag, **overrides: Any) -> None:
    """Add ``flag`` (name, type, default, choices, help) to a parser or group;
    ``overrides`` replace ``add_argument`` keywords. The gateway adds the
    engine flags of its embedded workers through here too."""
    kwargs: dict[str, Any] = {"help": flag.meta("help"), "default": flag.default}
    if flag.meta("env"):
        # A secret in the environment stays off the command line, which others can read.
        kwargs["default"] = os.environ.get(flag.meta("env"), flag.default)
    if flag.kind is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        kwargs["type"] = flag.parse
        kwargs["choices"] = flag.meta("choices")
        kwargs["metavar"] = flag.meta("metavar")
    container.add_argument(flag.option, **{**kwargs, **overrides})


def config_from_args(ns: argparse.Namespace) -> WorkerConfig:
    return WorkerConfig.from_settings(**{flag.name: getattr(ns, flag.name) for flag in flags()})


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
