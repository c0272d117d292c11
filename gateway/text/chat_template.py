"""Chat templates: the model's Jinja template(s), rendered in a sandbox the way
Hugging Face ``transformers`` renders them (which the tests check)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Message fields that carry the reasoning part of an assistant turn (aliased like transformers does).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """The model has no chat template, or rendering it failed (e.g. the template's
    ``raise_exception`` rejected the conversation)."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (used by some templates to mark assistant
    text for training masks): renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(
            lineno
        )

    def _render_body(self, caller: Any) -> str:
        return caller()


class _SafeNamespace(jinja2.utils.Namespace):
    """``namespace()`` for templates, refusing underscore-prefixed attribute names."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as jinja's Namespace
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _SafeNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates may not set underscore-prefixed namespace attributes ({name!r})"
            )


def _template_raise_exception(message: Any) -> None:
    raise jinja2.exceptions.TemplateError(str(message))


def _template_tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Unlike jinja's own filter: no HTML escaping, and the json.dumps options are exposed.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _template_strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _template_dict(*args: Any, **kwargs: Any) -> dict:
    return dict(*args, **kwargs)


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _template_tojson
    env.globals["raise_exception"] = _template_raise_exception
    env.globals["strftime_now"] = _template_strftime_now
    env.globals["dict"] = _template_dict
    env.globals["namespace"] = _SafeNamespace
    return env


def _plain(value: Any) -> Any:
    """Deep copy of JSON-like data with only plain JSON types (what a template may see)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if callable(getattr(value, "model_dump", None)):  # pydantic models
        return _plain(value.model_dump())
    raise TypeError(f"chat template data must be JSON-like, got {type(value).__name__}")


def _content_text(content: Any, index: int) -> Any:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
                continue
            if not isinstance(part, Mapping):
                raise ValueError(f"messages[{index}].content parts must be objects")
            kind = part.get("type", "text")
            if kind != "text":
                raise ValueError(
                    f"messages[{index}].content: unsupported content part type {kind!r} "
                    "(only 'text' parts are supported)"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError(f"messages[{index}].content: text part without a string 'text'")
            texts.append(text)
        return "".join(texts)
    raise ValueError(f"messages[{index}].content must be a string or a list of text parts")


def _normalize_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError("messages must be a list of message objects")
    if not messages:
        raise ValueError("messages must not be empty")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if callable(getattr(msg, "model_dump", None)):
            msg = msg.model_dump()
        if not isinstance(msg, Mapping):
            raise TypeError(f"messages[{i}] must be an object, got {type(msg).__name__}")
        if not isinstance(msg.get("role"), str):
            raise ValueError(f"messages[{i}] needs a string 'role'")
        # Like transformers: keys whose value is None are dropped (OpenAI clients send
        # `content: null`, `tool_calls: null`; templates handle a missing key better).
        m = {k: _plain(v) for k, v in msg.items() if v is not None and k != "content"}
        if msg.get("content") is not None:
            m["content"] = _content_text(msg["content"], i)
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


class ChatTemplate:
    """A model's chat template: one Jinja source, several named ones (a ``tool_use`` one is
    picked when tools are given, else ``default``), or none. Each source is compiled once."""

    def __init__(self, source: str | dict[str, str] | None) -> None:
        self._source = source
        self._env: ImmutableSandboxedEnvironment | None = None
        self._compiled: dict[str, jinja2.Template] = {}

    @classmethod
    def from_files(cls, texts: Mapping[str, str], config: Mapping[str, Any]) -> ChatTemplate:
        """The template of a model's files: chat_template.jinja wins over
        tokenizer_config.json's ``chat_template`` (a string or a list of named ones)."""
        tmpl: Any = texts.get("chat_template.jinja", config.get("chat_template"))
        if isinstance(tmpl, list):
            tmpl = {
                t["name"]: t["template"]
                for t in tmpl
                if isinstance(t, Mapping) and "name" in t and "template" in t
            }
        if not isinstance(tmpl, (str, dict)) or not tmpl:
            tmpl = None
        return cls(tmpl)

    @property
    def available(self) -> bool:
        return self._source is not None

    @property
    def text(self) -> str:
        """The template's Jinja source (several named ones joined; "" if none)."""
        src = self._source
        return "\n".join(src.values()) if isinstance(src, dict) else (src or "")

    def _select(self, tools: Any) -> str:
        tmpl = self._source
        if tmpl is None:
            raise ChatTemplateError(
                "this model has no chat template (no 'chat_template' in tokenizer_config.json and "
                "no chat_template.jinja); use the completions API with a plain prompt instead"
            )
        if isinstance(tmpl, dict):
            if tools is not None and "tool_use" in tmpl:
                return tmpl["tool_use"]
            if "default" in tmpl:
                return tmpl["default"]
            raise ChatTemplateError(
                f"this model has several chat templates and none is named 'default': {sorted(tmpl)}"
            )
        return tmpl

    def _compile(self, source: str) -> jinja2.Template:
        tpl = self._compiled.get(source)
        if tpl is None:
            if self._env is None:
                self._env = _make_environment()
            try:
                tpl = self._env.from_string(source)
            except jinja2.exceptions.TemplateSyntaxError as e:
                raise ChatTemplateError(f"the model's chat template does not parse: {e}") from e
            self._compiled[source] = tpl
        return tpl

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None,
        special_tokens: Mapping[str, str],
        variables: Mapping[str, Any],
    ) -> str:
        """The rendered conversation. ``special_tokens`` (``bos_token``, ...) and
        ``variables`` are template variables, the latter winning."""
        template = self._compile(self._select(tools))
        msgs = _normalize_messages(messages)
        if tools is not None:
            if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
                raise TypeError("tools must be a list of JSON schema objects")
            for t in tools:
                if not isinstance(t, Mapping):
                    raise TypeError("tools must be a list of JSON schema objects")
            tools = _plain(list(tools))
        context: dict[str, Any] = dict(special_tokens)
        context.update(_plain(variables))
        context.setdefault("documents", None)
        try:
            return template.render(
                **{
                    **context,
                    "messages": msgs,
                    "tools": tools,
                    "add_generation_prompt": add_generation_prompt,
                }
            )
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"chat template error: {e}") from e
