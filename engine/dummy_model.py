"""A model directory for ``--load-format dummy`` in real shapes: a preset's
``config.json`` (``engine.presets``) plus a synthetic tokenizer that covers the
whole vocabulary, and no weight files.

A worker started with ``--model llama-3.1-8b --load-format dummy`` serves the
directory ``ensure_preset_model`` builds in the cache on first use, so its
``GET /tokenizer`` gives a gateway in front of it something to tokenize and
detokenize with. The same directory, written anywhere::

    python -m engine.dummy_model llama-3.1-8b /tmp/llama-3.1-8b
    python -m decode_server --role both --model /tmp/llama-3.1-8b --load-format dummy

The tokenizer is a word-level one: id ``i`` is the word ``t<i>`` (one token per
whitespace-separated word, so a text prompt of N words is N tokens), the
config's bos/eos ids are special tokens, and every other word maps to ``<unk>``.
The last 95 ids that are not special are the printable ASCII characters, one
each, so that constrained decoding (JSON schemas, tool calls) can spell its
output. Decoding puts a space before each word and none before a character,
so every id decodes to visible text.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from engine.presets import PRESETS
from engine.tiny import CONFIG_TRANSFORMERS_VERSION, MARKER_NAME, build_once, default_cache_root

UNK_TOKEN = "<unk>"
WORD = "\u2581"
"""Marks a token that starts a word (decoded as a space before it)."""
RECIPE = 3
"""Changes with the directory's contents, so a cached one is rebuilt."""
CHARS = [chr(c) for c in range(32, 127)]
"""Printable ASCII, one token each."""
MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
# Plain-text roles: the word-level vocabulary has no chat markup tokens, and
# role names simply become <unk> tokens.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def load_config(preset: str) -> dict[str, Any]:
    """A preset's config (``engine.presets``), or the contents of a config.json path."""
    if preset in PRESETS:
        return dict(PRESETS[preset])
    path = Path(preset)
    if path.is_file():
        return json.loads(path.read_text())
    raise ValueError(f"{preset!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a file")


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def special_tokens(config: Mapping[str, Any]) -> dict[int, str]:
    """id -> token text of the config's bos and eos ids."""
    specials: dict[int, str] = {}
    eos = _ids(config.get("eos_token_id"))
    for k, i in enumerate(eos):
        specials[i] = "</s>" if k == 0 else f"</s{k}>"
    for i in _ids(config.get("bos_token_id")):
        specials.setdefault(i, "<s>")
    return specials


def build_tokenizer(vocab_size: int, specials: Mapping[int, str]) -> Tokenizer:
    """Word-level tokenizer over ids 0..vocab_size-1 (see the module docstring)."""
    if any(not 0 <= i < vocab_size for i in specials):
        raise ValueError(f"special token ids {sorted(specials)} outside the vocab ({vocab_size})")
    # The last ids that are not special are the printable ASCII characters, so
    # that constrained decoding (JSON, tool calls) has tokens to spell with;
    # <unk> takes the first id that is not special; every other id is "t<id>".
    plain = [i for i in range(vocab_size) if i not in specials]
    if len(plain) < len(CHARS) + 2:
        raise ValueError(f"a vocabulary of {vocab_size} has no room for the characters")
    unk_id, chars = plain[0], plain[-len(CHARS) :]
    vocab = {f"{WORD}t{i}": i for i in plain[1 : -len(CHARS)]}
    vocab.update(zip(CHARS, chars))
    vocab[UNK_TOKEN] = unk_id
    vocab.update({text: i for i, text in specials.items()})
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    # Words are "▁t<id>" inside, "t<id>" outside: each starts a new word when
    # decoded, while the characters join what comes before them.
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=WORD, prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement=WORD, prepend_scheme="always")
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in specials.values()]
    )
    return tok


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def write_dummy_model(config: str | Mapping[str, Any], out_dir: str | Path) -> Path:
    """Write config.json and tokenizer files for ``config`` (a preset name, a
    config.json path or a config dict) into ``out_dir``; return the directory."""
    cfg = load_config(config) if isinstance(config, str) else dict(config)
    arch = (cfg.get("architectures") or [""])[0]
    cfg.setdefault("model_type", MODEL_TYPES.get(arch, "llama"))
    cfg.setdefault("transformers_version", CONFIG_TRANSFORMERS_VERSION)
    vocab_size = int(cfg["vocab_size"])
    specials = special_tokens(cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(vocab_size, specials).save(str(out / "tokenizer.json"))
    eos = _ids(cfg.get("eos_token_id"))
    bos = _ids(cfg.get("bos_token_id"))
    # <unk> stays an ordinary token (not named here), so that no id outside
    # bos/eos decodes to nothing when special tokens are skipped.
    named: dict[str, str] = {}
    if bos:
        named["bos_token"] = specials[bos[0]]
    if eos:
        named["eos_token"] = specials[eos[0]]
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **named,
            "clean_up_tokenization_spaces": False,
            "model_max_length": int(cfg.get("max_position_embeddings", 4096)),
            "chat_template": CHAT_TEMPLATE,
            "added_tokens_decoder": {
                str(i): {
                    "content": text,
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": False,
                    "single_word": False,
                    "special": True,
                }
                for i, text in specials.items()
            },
        },
    )
    _write_json(out / "special_tokens_map.json", named)
    _write_json(out / "config.json", cfg)
    _write_json(
        out / "generation_config.json",
        {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if cfg.get(k) is not None},
    )
    return out


def ensure_preset_model(preset: str, cache_dir: str | Path | None = None) -> Path:
    """The directory ``write_dummy_model`` makes of ``preset``, in the cache
    (built on first use; a changed preset gets a directory of its own).
    Named after the preset, so a worker serves it under the preset's name."""
    config = load_config(preset)
    recipe = json.dumps([RECIPE, config], sort_keys=True).encode()
    digest = hashlib.sha256(recipe).hexdigest()[:8]
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()

    def build(tmp: Path) -> None:
        write_dummy_model(config, tmp)
        _write_json(tmp / MARKER_NAME, {"preset": preset})

    return build_once(root / "presets" / digest / preset, build)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m engine.dummy_model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "preset", help=f"preset name ({', '.join(sorted(PRESETS))}) or a config.json path"
    )
    ap.add_argument("out_dir", help="directory to write (created if missing)")
    args = ap.parse_args(argv)
    try:
        print(write_dummy_model(args.preset, args.out_dir))
    except ValueError as e:
        ap.error(str(e))


if __name__ == "__main__":
    main()
