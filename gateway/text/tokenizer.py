"""The tokenizer: a model's tokenizer files, read with the ``tokenizers`` library alone (no
torch, no transformers), encoding and decoding exactly like the transformers fast tokenizer
(``AutoTokenizer``) loaded from the same files."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as _BackendTokenizer

from gateway.text.chat_template import ChatTemplate
from gateway.text.cleanup import clean_up
from protocol import tokenizer_files

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


def _texts(files: Mapping[str, bytes | str]) -> dict[str, str]:
    """The :data:`TOKENIZER_FILES` among ``files``, as text."""
    texts: dict[str, str] = {}
    for name in TOKENIZER_FILES:
        data = files.get(name)
        if data is None:
            continue
        texts[name] = data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else data
    if "tokenizer.json" not in texts:
        raise FileNotFoundError("tokenizer.json is required to build a Tokenizer")
    return texts


def _load_json(texts: Mapping[str, str], name: str) -> dict[str, Any]:
    if name not in texts:
        return {}
    try:
        obj = json.loads(texts[name])
    except json.JSONDecodeError as e:
        raise ValueError(f"{name} is not valid JSON: {e}") from e
    if not isinstance(obj, dict):
        raise ValueError(f"{name} must hold a JSON object")
    return obj


def _special_tokens(
    config: Mapping[str, Any], texts: Mapping[str, str]
) -> tuple[dict[str, str], list[str]]:
    """Named special tokens (name -> string) and the unnamed extra ones.

    They come from tokenizer_config.json; special_tokens_map.json is only read by
    transformers when the config has no `added_tokens_decoder` (legacy layout), and then its
    entries win."""
    merged: dict[str, Any] = dict(config)
    if "additional_special_tokens" in merged and not merged.get("extra_special_tokens"):
        merged["extra_special_tokens"] = merged.pop("additional_special_tokens")
    if "added_tokens_decoder" not in config:
        stm = _load_json(texts, "special_tokens_map.json")
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
    return special, extra_list


class Tokenizer:
    """A model's tokenizer and chat template, without torch/transformers.

    Build with :meth:`from_dir` or :meth:`from_files`. ``encode``/``decode`` behave like the
    transformers fast tokenizer (``AutoTokenizer``) loaded from the same files.
    """

    def __init__(self, files: Mapping[str, bytes | str]) -> None:
        texts = _texts(files)
        tok_json = _load_json(texts, "tokenizer.json")
        config = _load_json(texts, "tokenizer_config.json")
        self._config = config
        self._generation_config = _load_json(texts, "generation_config.json")
        self._model_config = _load_json(texts, "config.json")

        self._backend = _BackendTokenizer.from_str(texts["tokenizer.json"])
        # Never truncate or pad silently.
        self._backend.no_truncation()
        self._backend.no_padding()
        self._backend.encode_special_tokens = False

        special, extra = _special_tokens(config, texts)
        self._special_tokens = special
        self._sync_added_tokens(config.get("added_tokens_decoder"), special, extra)

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
        # A decoder that is ByteLevel alone turns a token sequence into the UTF-8
        # decode of its bytes: text that ends on a character boundary, followed
        # by a token whose bytes are whole characters, decodes to the two texts
        # joined (what the stream detokenizer's fast path relies on).
        self._plain_byte_level = (
            isinstance(decoder_cfg, Mapping) and decoder_cfg.get("type") == "ByteLevel"
        )
        self._standalone: dict[int, str | None] = {}
        self._added_ids: frozenset[int] | None = None
        self._special_ids: frozenset[int] = frozenset(
            i for i, t in self._backend.get_added_tokens_decoder().items() if t.special
        )
        self._chat_template = ChatTemplate.from_files(texts, config)

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
        return clean_up(text) if self._cleanup else text

    def decode_raw(self, ids: list[int], skip_special_tokens: bool) -> str:
        """The backend's decode of ``ids``, without the clean-up (the stream detokenizer diffs
        these and cleans up its output itself)."""
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

    # ---- facts for stream decoding ---------------------------------------------------------

    def standalone_text(self, token_id: int) -> str | None:
        """The text of ``token_id`` when it does not depend on its neighbours: a
        token of a plain byte-level decoder (not an added token) whose bytes are
        whole UTF-8 characters. Decoding such a token after ids whose text ends
        on a character boundary appends exactly this text. None for any other
        token, and for every token of other decoders."""
        if not self._plain_byte_level:
            return None
        text = self._standalone.get(token_id, "")
        if text == "":
            text = self._standalone[token_id] = self._compute_standalone(token_id)
        return text

    def _compute_standalone(self, token_id: int) -> str | None:
        if self._added_ids is None:
            self._added_ids = frozenset(self._backend.get_added_tokens_decoder())
        piece = self._backend.id_to_token(token_id)
        if piece is None or token_id in self._added_ids:
            return None
        if not all(c in _UNICODE_TO_BYTE for c in piece):
            return None
        try:
            text = bytes(_UNICODE_TO_BYTE[c] for c in piece).decode("utf-8")
        except UnicodeDecodeError:
            return None
        # Checked against the backend once per id: the table is only ever a cache.
        if not text or self._backend.decode([token_id], skip_special_tokens=False) != text:
            return None
        return text

    @property
    def byte_fallback_ids(self) -> frozenset[int]:
        """Ids of the "<0xNN>" byte tokens of a byte-fallback decoder, which turns each run of
        them into text as a whole (all of it U+FFFD if it is not valid UTF-8); empty for other
        decoders."""
        return self._byte_fallback_ids

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of the special added tokens (what ``skip_special_tokens`` drops)."""
        return self._special_ids

    @property
    def cleans_up_spaces(self) -> bool:
        """Whether ``decode`` applies transformers' ``clean_up_tokenization``."""
        return self._cleanup

    # ---- chat templates --------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template.available

    @property
    def chat_template_text(self) -> str:
        """The chat template's source ("" if the model has none)."""
        return self._chat_template.text

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render the model's chat template (as transformers does; extra ``kwargs`` are template
        variables). Message content may be a string or a list of ``{"type": "text"}`` parts."""
        return self._chat_template.render(
            messages, add_generation_prompt, tools, self._special_tokens, kwargs
        )

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
