"""The gateway's settings: one definition per setting (``GatewayConfig``,
``RouterConfig``, ``AdmissionConfig``, the embedded workers'), the command line
generated from them, and ``to_argv`` as its inverse."""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any

import pytest
from test_worker_config import other_value

from gateway import embedded
from gateway.__main__ import _embedded_config, _gateway_config, build_parser, main
from gateway.admission import AdmissionConfig
from gateway.config import GatewayConfig, flags
from gateway.embedded import EMBEDDED_SETTINGS, EmbeddedConfig
from gateway.planner import PlannerConfig
from gateway.routing import RouterConfig
from protocol import settings
from protocol.settings import CLUSTER_TOKEN_ENV, LOG_LEVELS, setting
from worker import config as worker_config

OLD_FLAGS: dict[str, tuple[Any, list[str], Any]] = {
    # option: (default, arguments, what they parse to), as the hand-written
    # parser of ``python -m gateway`` had them before it was generated.
    "--host": ("0.0.0.0", ["127.0.0.1"], "127.0.0.1"),
    "--port": (8000, ["8100"], 8100),
    "--prefill": ((), ["http://p:1", "http://p:2"], ("http://p:1", "http://p:2")),
    "--decode": ((), ["http://d:1"], ("http://d:1",)),
    "--served-model-name": (None, ["m"], "m"),
    "--api-key": (None, ["k"], "k"),
    "--admin-key": (None, ["a"], "a"),
    "--cluster-token": (None, ["t"], "t"),
    "--wait-for-workers": (False, [], True),
    "--worker-startup-timeout-s": (30.0, ["5"], 5.0),
    "--shutdown-timeout-s": (30.0, ["0"], 0.0),
    "--max-concurrent-requests": (0, ["8"], 8),
    "--max-queued-tokens": (0, ["4096"], 4096),
    "--max-queue-wait-s": (30.0, ["2.5"], 2.5),
    "--max-requests-per-worker": (0, ["4"], 4),
    "--prefill-policy": ("cache_aware", ["round_robin"], "round_robin"),
    "--decode-policy": ("least_load", ["power_of_two"], "power_of_two"),
    "--skip-prefill-threshold": (0, ["64"], 64),
    "--request-timeout-s": (600.0, ["60"], 60.0),
    "--worker-timeout-s": (120.0, ["30"], 30.0),
    "--connect-timeout-s": (3.0, ["1.5"], 1.5),
    "--health-interval-s": (5.0, ["1"], 1.0),
    "--health-timeout-s": (2.0, ["0.5"], 0.5),
    "--max-body-bytes": (4194304, ["2048"], 2048),
    "--busy-poll-s": (None, ["0.25"], 0.25),
    "--max-prompt-tokens": (None, ["1000"], 1000),
    "--model": (None, ["qwen3-8b"], "qwen3-8b"),
    "--load-format": ("auto", ["dummy"], "dummy"),
    "--device": ("auto", ["cpu"], "cpu"),
    "--dtype": ("auto", ["float16"], "float16"),
    "--attention-backend": ("auto", ["torch_native"], "torch_native"),
    "--cuda-graph-max-bs": (None, ["0"], 0),
    "--cuda-graph-max-tokens": (None, ["0"], 0),
    "--tp-size": (1, ["2"], 2),
    "--context-length": (None, ["auto"], None),
    "--page-size": (16, ["32"], 32),
    "--num-pages": (None, ["64"], 64),
    "--kv-cache-memory-gb": (None, ["0.5"], 0.5),
    "--gpu-memory-utilization": (0.9, ["0.45"], 0.45),
    "--max-num-batched-tokens": (None, ["4096"], 4096),
    "--chunk-size": (None, ["512"], 512),
    "--max-running-requests": (256, ["64"], 64),
    "--enable-prefix-cache": (True, [], True),
    "--no-enable-prefix-cache": (True, [], False),
    "--transfer-backend": ("auto", ["tcp"], "tcp"),
    "--prefill-device": (None, ["cuda:0"], "cuda:0"),
    "--decode-device": (None, ["cuda:1"], "cuda:1"),
    "--log-level": ("info", ["warning"], "warning"),
}
OLD_CHOICES = {
    "--prefill-policy": {"cache_aware", "least_load", "round_robin"},
    "--decode-policy": {"least_load", "power_of_two"},
    "--load-format": {"auto", "dummy"},
    "--attention-backend": {"auto", "flashinfer", "torch_native"},
    "--transfer-backend": {"auto", "nixl", "tcp"},
    "--log-level": {"debug", "info", "warning", "error"},
}


@pytest.fixture(autouse=True)
def no_env_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--cluster-token`` falls back to the config's own default."""
    monkeypatch.delenv(CLUSTER_TOKEN_ENV, raising=False)


def all_flags() -> tuple[Any, ...]:
    return (*flags(), *embedded.flags())


def actions(parser: argparse.ArgumentParser | None = None) -> dict[str, argparse.Action]:
    """The parser's actions by option string."""
    parser = parser or build_parser()
    return {o: a for a in parser._actions for o in a.option_strings}


def parse(argv: list[str]) -> tuple[GatewayConfig, EmbeddedConfig]:
    ns = build_parser().parse_args(argv)
    return _gateway_config(ns), _embedded_config(ns)


def test_every_setting_is_a_flag() -> None:
    by_dest = {a.dest: a for a in build_parser()._actions}
    nested = {"router", "admission", "planner"}
    for cls in (GatewayConfig, RouterConfig, AdmissionConfig, PlannerConfig):
        for f in dataclasses.fields(cls):
            if f.name in nested:
                continue
            action = by_dest.get(f.name)
            assert action is not None, f"{cls.__name__}.{f.name} has no flag"
            assert "--" + f.name.replace("_", "-") in action.option_strings
    for f in dataclasses.fields(EmbeddedConfig):
        if f.name == "worker":
            continue
        assert (f.name in by_dest) == f.metadata["flag"], f.name
    # The embedded workers' flags are the workers' own definitions.
    workers = {flag.name: flag for flag in worker_config.flags()}
    offered = {flag.name: flag for flag in embedded.flags() if flag.path[:1] == ("worker",)}
    assert set(offered) == set(EMBEDDED_SETTINGS)
    for name, flag in offered.items():
        assert flag.field is workers[name].field, name
        assert by_dest[name].choices == flag.meta("choices"), name


def test_one_log_levels_and_cluster_token_env() -> None:
    parsed = actions()
    assert tuple(parsed["--log-level"].choices) == LOG_LEVELS
    assert worker_config.LOG_LEVELS is LOG_LEVELS
    assert worker_config.CLUSTER_TOKEN_ENV == embedded.CLUSTER_TOKEN_ENV == CLUSTER_TOKEN_ENV


def test_every_flag_names_its_default() -> None:
    parser = build_parser()
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.dest == "help":
            continue
        text = formatter._expand_help(action)
        assert "default:" in text, action.option_strings
        if "%(default)s" in (action.help or ""):
            assert str(action.default) in text, action.option_strings


def test_help_lists_every_setting_with_its_default(monkeypatch: pytest.MonkeyPatch) -> None:
    # ``python -m gateway --help`` prints this text (test_gateway_api runs it).
    monkeypatch.setenv("COLUMNS", "100")
    text = " ".join(build_parser().format_help().split())
    options = [flag.option for flag in all_flags()]
    missing = [o for o in options if not re.search(rf"(?<![\w-]){o}(?![\w-])", text)]
    assert not missing, missing
    for option, default in (("--unhealthy-after", 2), ("--retry-after-s", 1.0)):
        assert f"(default: {default})" in text, option
    assert text.count("default:") >= len(options)


def test_the_defaults_are_the_configs() -> None:
    assert parse([]) == (GatewayConfig(), EmbeddedConfig())


@pytest.mark.parametrize(
    "values",
    [
        {},
        {"prefill": ("http://a:1",), "decode": ("http://b:2",), "unhealthy_after": 5},
        {"api_key": "-starts-with-a-dash", "retry_after_s": 2.0, "busy_poll_s": 0.0},
        "every",
    ],
    ids=["defaults", "some", "dash", "every"],
)
def test_to_argv_round_trips(values: dict[str, Any] | str) -> None:
    if values == "every":
        values = {flag.name: other_value(flag) for flag in all_flags()}
    gateway_names = {flag.name for flag in flags()}
    gw = GatewayConfig.from_settings(**{k: v for k, v in values.items() if k in gateway_names})
    em = EmbeddedConfig.from_settings(**{k: v for k, v in values.items() if k not in gateway_names})
    argv = [*gw.to_argv(), *em.to_argv()]
    assert parse(argv) == (gw, em), argv
    if values:
        assert argv


@pytest.mark.parametrize("option", sorted(OLD_FLAGS))
def test_the_flags_from_before_parse_as_before(option: str) -> None:
    default, args, expected = OLD_FLAGS[option]
    action = actions()[option]
    by_name = {flag.name: flag for flag in all_flags()}
    flag = by_name[action.dest]
    assert option in (flag.option, "--no-" + flag.option[2:])
    assert flag.default == default
    if option in OLD_CHOICES:
        assert OLD_CHOICES[option] <= set(action.choices or ()), option
    gw, em = parse([option, *args])
    value = flag.value_of(em if flag in embedded.flags() else gw)
    assert value == expected and type(value) is type(expected), (value, expected)


def test_the_cluster_token_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CLUSTER_TOKEN_ENV, "from-env")
    assert parse([])[0].cluster_token == "from-env"
    assert parse(["--cluster-token", "given"])[0].cluster_token == "given"


@pytest.mark.parametrize(
    "argv",
    [
        ["--busy-poll-s", "-1"],
        ["--unhealthy-after", "0"],
        ["--max-queue-wait-s", "0"],
        ["--timeout-that-does-not-exist", "1"],
        ["--tp-size", "0"],  # the embedded workers' config refuses it before they start
    ],
)
def test_bad_values_are_usage_errors(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2


def test_every_field_of_a_config_is_a_setting_or_a_nested_config() -> None:
    @dataclasses.dataclass(frozen=True)
    class Loose:
        documented: int = setting(1, help="a setting (default: %(default)s)")
        bare: int = 2

    @dataclasses.dataclass(frozen=True)
    class Nested:
        router: RouterConfig = dataclasses.field(
            default_factory=lambda: RouterConfig(unhealthy_after=3)
        )

    with pytest.raises(TypeError, match="Loose.bare is not a setting"):
        settings.flags(Loose)
    # A nested config's flags default to its class's defaults, so must the field.
    with pytest.raises(TypeError, match="Nested.router"):
        settings.flags(Nested)


def test_an_optional_bool_is_auto_where_its_flag_is_left_out() -> None:
    @dataclasses.dataclass(frozen=True)
    class Tri:
        fuse: bool | None = setting(None, help="on, off or auto")

    (flag,) = settings.flags(Tri)
    parser = argparse.ArgumentParser()
    settings.add_flags(parser, [flag])
    got = [parser.parse_args(argv).fuse for argv in ([], ["--fuse"], ["--no-fuse"])]
    assert got == [None, True, False]
    assert [flag.argv(v) for v in (None, True, False)] == [[], ["--fuse"], ["--no-fuse"]]
    for value in (None, True, False):
        assert parser.parse_args(settings.to_argv(Tri(fuse=value), [flag])).fuse is value
