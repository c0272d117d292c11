"""Settings with one definition each: a config dataclass field that is also a
command-line flag.

A ``setting`` field carries its default, its help text (which names the
default), its argument group, its choices and the environment variable that
may supply it. ``flags`` turns a config class into its flags: one flat flag per
setting (``--page-size`` for ``page_size``), the fields of nested config
dataclasses in place of the field that holds them (``WorkerConfig.engine``,
``GatewayConfig.router``), the type from the annotation (``int``, ``float``,
``str``, ``bool``, ``X | None``, ``tuple[str, ...]``). ``add_flags`` puts them
on an argparse parser, ``build`` makes a config from the parsed values and
``to_argv`` is its inverse. The workers' and the gateway's command lines are
made this way.

Also the settings both sides share (``LOG_LEVELS``, ``CLUSTER_TOKEN_ENV``).
Torch-free and first-party-free: the lowest floor imports it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field
from typing import Any

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
"""The ``--log-level`` choices of the gateway and the workers."""
CLUSTER_TOKEN_ENV = "DISAGG_CLUSTER_TOKEN"
"""The environment variable of the cluster token (``protocol.auth``): the
default of the gateway's and the workers' ``--cluster-token``."""

_AUTO = ("auto", "none")
"""What an optional number's flag takes for None."""


def setting(
    default: Any = MISSING,
    *,
    help: str,
    group: str | None = None,
    flag: bool = True,
    choices: Sequence[str] | None = None,
    metavar: str | None = None,
    env: str | None = None,
    minimum: float | None = None,
    default_factory: Any = MISSING,
) -> Any:
    """A config field that is also a command-line flag.

    ``help`` documents the field and is the flag's help (argparse's
    ``%(default)s`` allowed; every flag's help names its default). ``group``
    is the title of the flag's argument group (None: the parser's own).
    ``flag=False``: no flag (``help`` says why). ``env``: the environment
    variable that supplies the command line's default instead of ``default``.
    ``minimum``: the command line refuses a smaller number (the config's own
    checks still apply to values given in code).
    """
    metadata = {
        "help": help,
        "group": group,
        "flag": flag,
        "choices": tuple(choices) if choices is not None else None,
        "metavar": metavar,
        "env": env,
        "minimum": minimum,
    }
    return field(default=default, default_factory=default_factory, metadata=metadata)


@dataclass(frozen=True)
class Flag:
    """The command-line flag of one setting: a field of a config class or of a
    config nested in it."""

    field: dataclasses.Field[Any]
    kind: type
    """``bool``, ``int``, ``float`` or ``str``: the field's type without None
    (of its items, for a tuple)."""
    optional: bool
    """None is one of the setting's values."""
    sequence: bool
    """A ``tuple[kind, ...]``: the flag takes any number of values."""
    path: tuple[str, ...] = ()
    """The fields that lead from the root config to the one holding this
    setting (``("engine",)`` for an engine setting of ``WorkerConfig``)."""

    @property
    def name(self) -> str:
        """The field's name, which is also the argparse destination."""
        return self.field.name

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def default(self) -> Any:
        f = self.field
        return f.default_factory() if f.default is MISSING else f.default

    def meta(self, key: str) -> Any:
        """``help``, ``group``, ``choices``, ``metavar``, ``env`` or ``minimum``
        (see ``setting``)."""
        return self.field.metadata[key]

    @property
    def parse(self) -> Callable[[str], Any]:
        """The argparse ``type`` of a non-bool flag."""
        base: Callable[[str], Any] = self.kind
        if self.optional and self.kind is not str:
            base = _optional_float if self.kind is float else _optional_int
        minimum = self.meta("minimum")
        if minimum is None:
            return base

        def parse(text: str) -> Any:
            value = base(text)
            if value is not None and value < minimum:
                auto = " or auto" if self.optional else ""
                raise argparse.ArgumentTypeError(f"must be >= {minimum:g}{auto}")
            return value

        parse.__name__ = base.__name__
        return parse

    def value_of(self, config: Any) -> Any:
        for name in self.path:
            config = getattr(config, name)
        return getattr(config, self.name)

    def argv(self, value: Any) -> list[str]:
        """The arguments that set this flag to ``value``."""
        if self.kind is bool:
            if value is None:  # an optional bool's None (auto) is its flag left out
                if self.default is not None:
                    raise ValueError(f"{self.name}=None has no command-line form")
                return []
            return [self.option if value else "--no-" + self.option[2:]]
        if value is None:
            if not self.optional or self.kind is str:
                raise ValueError(f"{self.name}=None has no command-line form")
            return [self.option, _AUTO[0]]
        if self.sequence:
            items = [str(v) for v in value]
            if any(item.startswith("-") for item in items):
                raise ValueError(
                    f"{self.name}: a value that starts with '-' has no command-line form"
                )
            return [self.option, *items]
        text = str(value)
        # "--x=-y": a value that starts with a dash would read as an option.
        return [f"{self.option}={text}"] if text.startswith("-") else [self.option, text]


@functools.cache
def flags(cls: type) -> tuple[Flag, ...]:
    """The flags of config class ``cls``, in the order of its fields, with the
    flags of a nested config in place of the field that holds it. Names are
    flat, so unique across the nesting."""
    out = _flags(cls, ())
    names = [f.name for f in out]
    assert len(set(names)) == len(names), f"{cls.__name__}: settings share a name: {names}"
    return out


def _flags(cls: type, path: tuple[str, ...]) -> tuple[Flag, ...]:
    hints = typing.get_type_hints(cls)
    out: list[Flag] = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if _nested(hint):
            # The flags' defaults are the nested class's: so must the field's be.
            if f.default_factory is not hint:
                raise TypeError(f"{cls.__name__}.{f.name}: a nested config defaults to {hint}()")
            out += _flags(hint, (*path, f.name))
        elif "help" not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name} is not a setting()")
        elif f.metadata["flag"]:
            out.append(Flag(f, *_kind(hint, f.name), path=path))
    return tuple(out)


def _nested(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _kind(hint: Any, name: str) -> tuple[type, bool, bool]:
    """The flag's value type, whether None is a value and whether it is a
    tuple, from the annotation."""
    args = typing.get_args(hint)
    sequence = typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis
    optional = type(None) in args
    rest = [a for a in args if a is not type(None)]
    kind = args[0] if sequence else rest[0] if optional and len(rest) == 1 else hint
    if kind not in (bool, int, float, str) or (sequence and kind is bool):
        raise TypeError(f"setting {name!r} has type {hint}, which has no command-line form")
    return kind, optional, sequence


def build(cls: type, settings: Mapping[str, Any]) -> Any:
    """A ``cls`` from one keyword per setting, named as on the command line
    (``page_size=4``): a nested config's settings go to it. Settings left
    out keep their defaults."""
    left = dict(settings)
    config = _build(cls, left)
    if left:
        raise TypeError(f"{cls.__name__} has no setting {', '.join(sorted(left))}")
    return config


def _build(cls: type, left: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in left:
            kwargs[f.name] = left.pop(f.name)
        elif _nested(hints[f.name]):
            kwargs[f.name] = _build(hints[f.name], left)
    return cls(**kwargs)


def values(ns: argparse.Namespace, of: Iterable[Flag]) -> dict[str, Any]:
    """The parsed values of flags ``of``, by name (a sequence as a tuple), for
    ``build``."""
    out = {}
    for flag in of:
        value = getattr(ns, flag.name)
        out[flag.name] = tuple(value) if flag.sequence else value
    return out


def to_argv(config: Any, of: Iterable[Flag], always: Iterable[str] = ()) -> list[str]:
    """The arguments that give ``config``'s values of flags ``of``: those that
    differ from their defaults, plus the ones named in ``always``. Parsing
    them gives back an equal config, where the environment variables of
    ``env`` settings are unset."""
    written = set(always)
    argv: list[str] = []
    for flag in of:
        value = flag.value_of(config)
        if flag.name in written or value != flag.default:
            argv += flag.argv(value)
    return argv


def add_flag(container: argparse._ActionsContainer, flag: Flag, **overrides: Any) -> None:
    """Add ``flag`` (name, type, default, choices, help) to a parser or group;
    ``overrides`` replace ``add_argument`` keywords."""
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
        if flag.sequence:
            kwargs["nargs"] = "*"
    container.add_argument(flag.option, **{**kwargs, **overrides})


def add_flags(
    parser: argparse.ArgumentParser,
    of: Iterable[Flag],
    *,
    group: str | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    """Add flags ``of`` to ``parser``, each in the argument group its setting
    names, or all in the group titled ``group``; ``overrides`` maps a flag's
    name to ``add_argument`` keywords that replace its own."""
    groups: dict[str | None, argparse._ActionsContainer] = {None: parser}
    for flag in of:
        title = group or flag.meta("group")
        if title not in groups:
            groups[title] = parser.add_argument_group(title)
        add_flag(groups[title], flag, **(overrides or {}).get(flag.name, {}))


def _optional_int(text: str) -> int | None:
    return None if text.lower() in _AUTO else int(text)


def _optional_float(text: str) -> float | None:
    return None if text.lower() in _AUTO else float(text)
