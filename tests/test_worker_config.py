"""The worker's settings: one definition per setting, the command line generated
from them, and ``WorkerConfig.to_argv`` as its inverse."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from typing import Any

import pytest
from workers import REPO

from decode_server import DECODE_ROLE
from engine.attention import ATTENTION_BACKENDS, get_attention_backend
from engine.attention.base import AttentionBackend
from engine.config import EngineConfig
from kvtransfer import TRANSFER_BACKENDS
from prefill_server import PREFILL_ROLE
from worker.cli import CLUSTER_TOKEN_ENV, REGISTER_KEY_ENV, build_parser, config_from_args
from worker.config import Flag, WorkerConfig, flags
from worker.roles import COLOCATED, Role


@pytest.fixture
def no_env_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """The settings whose command-line default comes from the environment fall
    back to the config's own default."""
    monkeypatch.delenv(CLUSTER_TOKEN_ENV, raising=False)
    monkeypatch.delenv(REGISTER_KEY_ENV, raising=False)


def prefill_parser() -> argparse.ArgumentParser:
    return build_parser("python -m prefill_server", (PREFILL_ROLE, COLOCATED), 30000)


def test_every_engine_setting_is_a_worker_flag(no_env_defaults: None) -> None:
    actions = {a.dest: a for a in prefill_parser()._actions}
    without_flag = set()
    for f in dataclasses.fields(EngineConfig):
        if not f.metadata.get("flag", False):
            without_flag.add(f.name)
            continue
        action = actions.get(f.name)
        assert action is not None, f"EngineConfig.{f.name} has no worker flag"
        assert "--" + f.name.replace("_", "-") in action.option_strings
        assert action.default == f.default, f.name
    # Leaving a setting off the command line is a decision its help explains.
    assert without_flag == {"overlap", "extra"}
    for f in dataclasses.fields(WorkerConfig):
        assert f.name == "engine" or f.name in actions, f"WorkerConfig.{f.name} has no flag"


def test_cli_defaults_are_the_config_defaults(no_env_defaults: None) -> None:
    parsed = config_from_args(prefill_parser().parse_args([]))
    assert parsed == WorkerConfig(role="prefill", port=30000)
    assert parsed.engine == EngineConfig()


def test_every_flag_explains_its_default() -> None:
    for action in prefill_parser()._actions:
        if action.option_strings and action.dest != "help":
            assert "default" in (action.help or ""), action.option_strings


def test_cli_choices_come_from_the_registries() -> None:
    actions = {a.dest: a for a in prefill_parser()._actions}
    assert list(actions["attention_backend"].choices) == ["auto", *sorted(ATTENTION_BACKENDS)]
    assert list(actions["transfer_backend"].choices) == ["auto", *sorted(TRANSFER_BACKENDS)]
    for name in ATTENTION_BACKENDS:
        assert issubclass(get_attention_backend(name), AttentionBackend)


def other_value(flag: Flag) -> Any:
    """A valid value of ``flag`` that is not its default (the gateway's
    settings test uses it too)."""
    default = flag.default
    if flag.sequence:
        return (*default, "a", "b")
    if flag.kind is bool:
        return not default
    choices = flag.meta("choices")
    if choices:
        return next(c for c in choices if c != default)
    if flag.kind is int:
        return 7 if default is None else default + 1
    if flag.kind is float:
        if default is None:
            return 1.5
        return default / 2 if 0 < default <= 1 else default * 2 + 1  # a fraction stays one
    # A leading dash must not read as an option.
    return "-dash" if default is None else f"{default}-x"


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"role": "prefill", "model": "/models/x", "page_size": 4, "enable_prefix_cache": False},
        {"role": "both", "num_pages": 64, "cluster_token": "-starts-with-a-dash"},
        "every",
    ],
    ids=["defaults", "some", "dash", "every"],
)
def test_to_argv_round_trips(settings: dict[str, Any] | str, no_env_defaults: None) -> None:
    if settings == "every":
        settings = {flag.name: other_value(flag) for flag in flags()}
        assert settings["role"] == "prefill"
    config = WorkerConfig.from_settings(**settings)
    programs = [("prefill_server", PREFILL_ROLE, 30000), ("decode_server", DECODE_ROLE, 30001)]
    for module, role, port in programs:
        if config.role in (role.name, COLOCATED.name):
            parser = build_parser(f"python -m {module}", (role, COLOCATED), port)
            assert config_from_args(parser.parse_args(config.to_argv())) == config, module


def test_to_argv_writes_only_what_differs() -> None:
    assert WorkerConfig().to_argv() == ["--role", "both", "--port", "30000"]
    config = WorkerConfig.from_settings(page_size=4, enable_prefix_cache=False, register="u")
    assert " ".join(config.to_argv()) == (
        "--role both --port 30000 --register u --page-size 4 --no-enable-prefix-cache"
    )


@pytest.mark.parametrize(
    ("role", "port"),
    [(PREFILL_ROLE, 30000), (DECODE_ROLE, 30001)],
    ids=["prefill_server", "decode_server"],
)
def test_help_mentions_every_flag(role: Role, port: int) -> None:
    module = "prefill_server" if role is PREFILL_ROLE else "decode_server"
    out = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    flags = [
        o for a in build_parser(module, (role, COLOCATED), port)._actions for o in a.option_strings
    ]
    assert "--role" in flags and "--request-port" in flags
    missing = [f for f in flags if f not in out.stdout]
    assert not missing, missing
    assert f"default: {port}" in out.stdout
    assert f"default: {role.name}" in out.stdout
