"""Text layer of the OpenAI-compatible gateway: tokenizer, chat templates, streaming detokenizer,
stop strings.

The gateway process must stay free of torch, so this module only uses the ``tokenizers`` library
(``tokenizer.json``) and ``jinja2``. The behaviour follows Hugging Face ``transformers``' fast
tokenizers for the same files (which the tests check byte for byte):

- :class:`Tokenizer` loads a model directory's tokenizer files (or the same files received over
  HTTP, see :data:`TOKENIZER_FILES`) and offers ``encode``/``decode``/``apply_chat_template``/
  ``chat_ids``.
- :class:`IncrementalDetokenizer` turns a stream of token ids into a stream of text whose
  concatenation equals ``Tokenizer.decode`` of all the ids, never emitting half a character.
- :class:`StopStringMatcher` cuts a text stream exactly before the first stop string.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken
from tokenizers import Tokenizer as _BackendTokenizer

from protocol import tokenizer_files

__all__ = [
    "TOKENIZER_FILES",
    "ChatTemplateError",
    "IncrementalDetokenizer",
    "StopStringMatcher",
    "Tokenizer",
]

# The files a tokenizer is built from: what `Tokenizer.from_dir` reads and what a worker's
# `GET /tokenizer` sends. Only `tokenizer.json` is required.
TOKENIZER_FILES = tokenizer_files.TOKENIZER_FILES

# Named special tokens handed to chat templates (plus any model specific `*_token` entries).
_NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

# tokenizer_config.json writes "no limit" as int(1e30).
_HUGE_MAX_LENGTH = 10**29

# Message fields that carry the reasoning part of an assistant turn (aliased like transformers does).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

_REPLACEMENT_CHAR = "\ufffd"

# transformers' `clean_up_tokenization`: applied one after another to the whole decoded text.
_CLEANUP_REPLACEMENTS: tuple[tuple[str, str], ...] = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


class ChatTemplateError(ValueError):
    """The model has no chat template, or rendering it failed (e.g. the template's
    ``raise_exception`` rejected the conversation)."""


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------


def _token_str(value: Any) -> str | None:
    """A special-token entry from a config file: a string, an AddedToken dict, or None."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _partial_suffix_len(text: str, patterns: Iterable[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``patterns``."""
    best = 0
    for pat in patterns:
        k = min(len(pat) - 1, len(text))
        while k > best:
            if text.endswith(pat[:k]):
                best = k
                break
            k -= 1
    return best


def _decoder_has(decoder_cfg: Any, kind: str) -> bool:
    if isinstance(decoder_cfg, Mapping):
        if decoder_cfg.get("type") == kind:
            return True
        return any(_decoder_has(d, kind) for d in decoder_cfg.get("decoders") or ())
    return False


_BYTE_TOKEN_RE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _byte_level_alphabet() -> dict[str, int]:
    """Character -> byte of the byte-level BPE alphabet (GPT-2's): printable
    bytes stand for themselves, the other 68 are shifted to U+0100 and up."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out = {chr(b): b for b in keep}
    shifted = 0
    for b in range(256):
        if b not in keep:
            out[chr(256 + shifted)] = b
            shifted += 1
    return out


_UNICODE_TO_BYTE = _byte_level_alphabet()


# --------------------------------------------------------------------------------------------
# Chat template environment
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


class Tokenizer:
    """A model's tokenizer and chat template, without torch/transformers.

    Build with :meth:`from_dir` or :meth:`from_files`. ``encode``/``decode`` behave like the
    transformers fast tokenizer (``AutoTokenizer``) loaded from the same files.
    """

    def __init__(self, files: Mapping[str, bytes | str]) -> None:
        texts: dict[str, str] = {}
        for name in TOKENIZER_FILES:
            data = files.get(name)
            if data is None:
                continue
            texts[name] = data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else data
        if "tokenizer.json" not in texts:
            raise FileNotFoundError("tokenizer.json is required to build a Tokenizer")

        def load_json(name: str) -> dict[str, Any]:
            if name not in texts:
                return {}
            try:
                obj = json.loads(texts[name])
            except json.JSONDecodeError as e:
                raise ValueError(f"{name} is not valid JSON: {e}") from e
            if not isinstance(obj, dict):
                raise ValueError(f"{name} must hold a JSON object")
            return obj

        tok_json = load_json("tokenizer.json")
        config = load_json("tokenizer_config.json")
        self._config = config
        self._generation_config = load_json("generation_config.json")
        self._model_config = load_json("config.json")

        self._backend = _BackendTokenizer.from_str(texts["tokenizer.json"])
        # Never truncate or pad silently.
        self._backend.no_truncation()
        self._backend.no_padding()
        self._backend.encode_special_tokens = False

        # Special tokens: tokenizer_config.json; special_tokens_map.json is only read by
        # transformers when the config has no `added_tokens_decoder` (legacy layout), and then
        # its entries win.
        merged: dict[str, Any] = dict(config)
        if "additional_special_tokens" in merged and not merged.get("extra_special_tokens"):
            merged["extra_special_tokens"] = merged.pop("additional_special_tokens")
        if "added_tokens_decoder" not in config:
            stm = load_json("special_tokens_map.json")
            for key, value in stm.items():
                if key == "additional_special_tokens" and not merged.get("extra_special_tokens"):
                    key = "extra_special_tokens"
                merged[key] = value

        special: dict[str, str] = {}
        for key in _NAMED_SPECIAL_TOKENS:
            s = _token_str(merged.get(key))
            if s is not None:
                special[key] = s
        for key, value in merged.items():
            if key.endswith("_token") and key not in special and isinstance(value, (str, dict)):
                s = _token_str(value)
                if s is not None:
                    special[key] = s
        extra = merged.get("extra_special_tokens")
        extra_list: list[str] = []
        if isinstance(extra, Mapping):
            for key, value in extra.items():
                s = _token_str(value)
                if s is not None:
                    special.setdefault(key, s)
        elif isinstance(extra, (list, tuple)):
            extra_list = [s for s in (_token_str(v) for v in extra) if s is not None]
        self._special_tokens = special

        self._sync_added_tokens(config.get("added_tokens_decoder"), special, extra_list)

        # Special tokens added by `encode` come from tokenizer.json's post-processor alone: like
        # transformers (5.x) when a tokenizer.json exists, add_bos_token/add_eos_token in
        # tokenizer_config.json are not consulted.

        # Decoding details.
        decoder_cfg = tok_json.get("decoder")
        model_type = (tok_json.get("model") or {}).get("type")
        self._cleanup = bool(config.get("clean_up_tokenization_spaces", False)) and (
            model_type != "BPE"
            or bool(
                config.get(
                    "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
                )
            )
        )
        # Byte-fallback decoders turn each run of "<0xNN>" tokens into text as a whole (all of
        # it U+FFFD if it is not valid UTF-8); the detokenizer needs to know those ids.
        self._byte_fallback_ids: frozenset[int] = frozenset()
        if _decoder_has(decoder_cfg, "ByteFallback"):
            vocab = self._backend.get_vocab(with_added_tokens=True)
            self._byte_fallback_ids = frozenset(
                i for t, i in vocab.items() if len(t) == 6 and _BYTE_TOKEN_RE.fullmatch(t)
            )
        self._byte_level = _decoder_has(decoder_cfg, "ByteLevel")
        self._added_ids: frozenset[int] | None = None
        self._special_ids: frozenset[int] = frozenset(
            i for i, t in self._backend.get_added_tokens_decoder().items() if t.special
        )

        # Chat template: chat_template.jinja wins over tokenizer_config.json's entry.
        tmpl: Any = texts.get("chat_template.jinja", config.get("chat_template"))
        if isinstance(tmpl, list):
            tmpl = {
                t["name"]: t["template"]
                for t in tmpl
                if isinstance(t, Mapping) and "name" in t and "template" in t
            }
        if not isinstance(tmpl, (str, dict)) or not tmpl:
            tmpl = None
        self._chat_template: str | dict[str, str] | None = tmpl
        self._env: ImmutableSandboxedEnvironment | None = None
        self._compiled: dict[str, jinja2.Template] = {}

    # ---- construction ----------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load the tokenizer files (:data:`TOKENIZER_FILES`) of a Hugging Face model dir."""
        root = Path(path)
        if not (root / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{root} has no tokenizer.json")
        return cls.from_files(cls.read_files(root))

    @classmethod
    def from_files(cls, files: Mapping[str, bytes | str]) -> Tokenizer:
        """Build from file name -> contents (names outside :data:`TOKENIZER_FILES` are ignored)."""
        return cls(files)

    @staticmethod
    def read_files(path: str | os.PathLike[str]) -> dict[str, bytes]:
        """The :data:`TOKENIZER_FILES` present in ``path``, as name -> bytes (what a worker
        serves on ``GET /tokenizer``)."""
        root = Path(path)
        return {n: (root / n).read_bytes() for n in TOKENIZER_FILES if (root / n).is_file()}

    def _sync_added_tokens(
        self, added_decoder: Any, special: Mapping[str, str], extra: Sequence[str]
    ) -> None:
        """Register the config's added tokens and special tokens with the backend, as
        transformers does when it loads the tokenizer."""
        existing = {t.content: t for t in self._backend.get_added_tokens_decoder().values()}
        to_add: list[AddedToken] = []
        if isinstance(added_decoder, Mapping):
            for _idx, spec in sorted(added_decoder.items(), key=lambda kv: int(kv[0])):
                if not isinstance(spec, Mapping) or not isinstance(spec.get("content"), str):
                    continue
                cur = existing.get(spec["content"])
                props = {
                    k: bool(spec[k])
                    for k in ("single_word", "lstrip", "rstrip", "normalized", "special")
                    if k in spec
                }
                if cur is not None and all(getattr(cur, k) == v for k, v in props.items()):
                    continue
                to_add.append(AddedToken(spec["content"], **props))
        if to_add:
            self._backend.add_special_tokens([t for t in to_add if t.special])
            self._backend.add_tokens([t for t in to_add if not t.special])
            existing = {t.content: t for t in self._backend.get_added_tokens_decoder().values()}
        specials: list[AddedToken] = []
        for content in [*special.values(), *extra]:
            cur = existing.get(content)
            if cur is None:
                specials.append(AddedToken(content, special=True, normalized=False))
            elif not cur.special:
                specials.append(
                    AddedToken(
                        content,
                        single_word=cur.single_word,
                        lstrip=cur.lstrip,
                        rstrip=cur.rstrip,
                        normalized=cur.normalized,
                        special=True,
                    )
                )
        if specials:
            self._backend.add_special_tokens(specials)

    # ---- encode / decode -------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds what the post-processor adds
        (e.g. a bos token) exactly where transformers would."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (like transformers' ``decode``, including its optional clean-up)."""
        text = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self._cleanup:
            for old, new in _CLEANUP_REPLACEMENTS:
                text = text.replace(old, new)
        return text

    def _decode_raw(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (part of a UTF-8 character for some
        tokens, which is why the OpenAI API reports them as bytes)."""
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._byte_fallback_ids:
            return bytes([int(piece[3:5], 16)])
        if self._added_ids is None:
            self._added_ids = frozenset(self._backend.get_added_tokens_decoder())
        if (
            self._byte_level
            and token_id not in self._added_ids
            and all(c in _UNICODE_TO_BYTE for c in piece)
        ):
            return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        return self.decode([token_id]).encode()

    # ---- chat templates --------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    def _template_source(self, tools: Any) -> str:
        tmpl = self._chat_template
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

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render the model's chat template (as transformers does; extra ``kwargs`` are template
        variables). Message content may be a string or a list of ``{"type": "text"}`` parts."""
        source = self._template_source(tools)
        template = self._compile(source)
        msgs = _normalize_messages(messages)
        if tools is not None:
            if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
                raise TypeError("tools must be a list of JSON schema objects")
            for t in tools:
                if not isinstance(t, Mapping):
                    raise TypeError("tools must be a list of JSON schema objects")
            tools = _plain(list(tools))
        variables: dict[str, Any] = dict(self._special_tokens)
        variables.update(_plain(kwargs))
        variables.setdefault("documents", None)
        try:
            return template.render(
                **{
                    **variables,
                    "messages": msgs,
                    "tools": tools,
                    "add_generation_prompt": add_generation_prompt,
                }
            )
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"chat template error: {e}") from e

    def chat_ids(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """Token ids of the rendered chat. The template writes its own special tokens (bos
        included), so the text is encoded without adding special tokens again."""
        text = self.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs
        )
        return self.encode(text, add_special_tokens=False)

    # ---- properties ------------------------------------------------------------------------

    @property
    def special_tokens(self) -> dict[str, str]:
        """Named special tokens (``bos_token``, ``eos_token``, ...) as strings."""
        return dict(self._special_tokens)

    @property
    def bos_token(self) -> str | None:
        return self._special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._special_tokens.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self._special_tokens.get("pad_token")

    @property
    def unk_token(self) -> str | None:
        return self._special_tokens.get("unk_token")

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self._backend.token_to_id(self.bos_token)

    @property
    def eos_token_ids(self) -> list[int]:
        """Ids that end generation: generation_config.json's ``eos_token_id`` (int or list),
        config.json's, and the tokenizer's eos token, in that order without duplicates."""
        ids: list[int] = []
        ids += _as_id_list(self._generation_config.get("eos_token_id"))
        ids += _as_id_list(self._model_config.get("eos_token_id"))
        if self.eos_token is not None:
            tid = self._backend.token_to_id(self.eos_token)
            if tid is not None:
                ids.append(tid)
        return list(dict.fromkeys(ids))

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (``len(hf_tokenizer)``)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def model_max_length(self) -> int | None:
        """tokenizer_config.json's ``model_max_length`` unless absent or the "no limit" sentinel,
        else config.json's ``max_position_embeddings``, else None."""
        v = self._config.get("model_max_length")
        if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < _HUGE_MAX_LENGTH:
            return int(v)
        v = self._model_config.get("max_position_embeddings")
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
        return None


# --------------------------------------------------------------------------------------------
# Streaming text
# --------------------------------------------------------------------------------------------


class _StreamingReplace:
    """``str.replace(old, new)`` over a text stream: the concatenated output of ``push``es and
    ``flush`` equals ``full_text.replace(old, new)``."""

    __slots__ = ("_old", "_new", "_held")

    def __init__(self, old: str, new: str) -> None:
        self._old, self._new, self._held = old, new, ""

    def push(self, text: str) -> str:
        buf = self._held + text
        old, new = self._old, self._new
        pieces = []
        pos = 0
        while (j := buf.find(old, pos)) >= 0:  # left to right, non-overlapping, like str.replace
            pieces += (buf[pos:j], new)
            pos = j + len(old)
        # Hold back the tail that could still start a match once more text arrives.
        k = _partial_suffix_len(buf[pos:], (old,))
        pieces.append(buf[pos : len(buf) - k])
        self._held = buf[len(buf) - k :]
        return "".join(pieces)

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


class IncrementalDetokenizer:
    """Token ids in, text out, one delta at a time.

    ``push(ids)`` returns the newly finalized text and ``flush()`` the rest at the end; their
    concatenation equals ``tokenizer.decode(all_ids, skip_special_tokens=...)`` exactly. Text is
    held back while it is not final: a trailing U+FFFD (a character split over tokens), an open
    run of byte-fallback tokens, a possible clean-up pattern.

    Each token is decoded in a small window: the ids from the start of the previously emitted
    span onwards, diffed against the decode of that span, so decoders that treat the first token
    specially (prefix spaces) or merge bytes across tokens come out as in a full decode, and the
    cost per token does not grow with the length of the output.
    """

    # When this many ids are pending (e.g. a long run of invalid bytes), look for a split point.
    _MAX_PENDING = 8

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._byte_ids = tokenizer._byte_fallback_ids
        # Skipped special tokens are dropped before the decoder runs, so they never enter the
        # window (a run of them can not grow it, and they do not end a byte-fallback run).
        self._hidden_ids = tokenizer._special_ids if skip_special_tokens else frozenset()
        self._ids: list[int] = []  # window: ids from the prefix offset on
        self._read = 0  # ids[:read] is the already emitted span of the window
        self._prefix_text = ""  # decode(ids[:read])
        self._cleanup = (
            [_StreamingReplace(o, n) for o, n in _CLEANUP_REPLACEMENTS]
            if tokenizer._cleanup
            else None
        )
        self._done = False

    @property
    def window_size(self) -> int:
        """Number of ids currently kept for decoding (bounded for ordinary text)."""
        return len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tok._decode_raw(ids, self._skip)

    def _advance(self, read: int, emitted_text: str) -> str:
        """The window's ids[:read] are final: emit, then restart the window at the old read
        offset (keeping one emitted span as left context)."""
        out = emitted_text[len(self._prefix_text) :]
        del self._ids[: self._read]
        self._read = read - self._read
        self._prefix_text = self._decode(self._ids[: self._read])
        return out

    def _step(self, token_id: int) -> str:
        if token_id in self._hidden_ids:
            return ""
        ids = self._ids
        ids.append(token_id)
        if token_id in self._byte_ids:
            return ""  # an open byte-fallback run can still change (it is decoded as a group)
        text = self._decode(ids)
        prefix = self._prefix_text
        if (
            len(text) > len(prefix)
            and text.startswith(prefix)
            and not text.endswith(_REPLACEMENT_CHAR)
        ):
            return self._advance(len(ids), text)
        if len(ids) - self._read > self._MAX_PENDING:
            return self._split_pending(text)
        return ""

    def _split_pending(self, text: str) -> str:
        """Many ids pending (e.g. a run of invalid bytes, each ending the text in U+FFFD): emit
        up to a point m after which decoding restarts cleanly, checked as
        decode(ids[:m]) + decode(ids[m:]) == decode(ids)."""
        ids, prefix = self._ids, self._prefix_text
        for m in range(len(ids) - 1, max(self._read, len(ids) - 5), -1):
            if ids[m - 1] in self._byte_ids:
                continue
            head = self._decode(ids[:m])
            if len(head) <= len(prefix) or not head.startswith(prefix):
                continue
            if head + self._decode(ids[m:]) == text:
                return self._advance(m, head)
        return ""

    def _post(self, text: str) -> str:
        if self._cleanup is not None:
            for stage in self._cleanup:
                text = stage.push(text)
        return text

    def push(self, ids: Iterable[int]) -> str:
        """Add generated ids; returns the text that became final."""
        if self._done:
            raise RuntimeError("IncrementalDetokenizer.push after flush")
        pieces = [self._step(int(i)) for i in ids]
        return self._post("".join(pieces))

    def flush(self) -> str:
        """End of the stream: the text still held back (may end in U+FFFD if the ids do)."""
        if self._done:
            return ""
        self._done = True
        text = self._decode(self._ids)
        out = text[len(self._prefix_text) :] if len(text) > len(self._prefix_text) else ""
        self._ids, self._read, self._prefix_text = [], 0, ""
        out = self._post(out)
        if self._cleanup is not None:
            for i, stage in enumerate(self._cleanup):
                tail = stage.flush()
                for later in self._cleanup[i + 1 :]:
                    tail = later.push(tail)
                out += tail
        return out


class StopStringMatcher:
    """Cut a text stream exactly before the first stop string.

    ``push(text)`` returns ``(safe_text, stopped)``: ``safe_text`` can be emitted now (it cannot
    be part of a stop string), and once a stop string has been seen, nothing after its start is
    ever returned. The stop that completes first in the stream wins (among stops completing at
    the same point, the one starting earliest). ``flush()`` releases the held-back tail at the
    end of the stream when no stop was hit.
    """

    def __init__(self, stops: Sequence[str] | None) -> None:
        if isinstance(stops, str):
            stops = [stops]
        stops = list(stops or ())
        for s in stops:
            if not isinstance(s, str):
                raise TypeError(f"stop strings must be str, got {type(s).__name__}")
            if not s:
                raise ValueError("stop strings must not be empty")
        self._stops = list(dict.fromkeys(stops))
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that was hit

    @property
    def stops(self) -> list[str]:
        return list(self._stops)

    def push(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self._stops:
            return text, False
        buf = self._held + text
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for s in self._stops:
            i = buf.find(s)
            if i >= 0:
                cand = (i + len(s), i, s)
                if best is None or cand[:2] < best[:2]:
                    best = cand
        if best is not None:
            self.stopped, self.matched, self._held = True, best[2], ""
            return buf[: best[1]], True
        k = _partial_suffix_len(buf, self._stops)
        self._held = buf[len(buf) - k :] if k else ""
        return buf[: len(buf) - k], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held
