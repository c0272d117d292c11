"""Tests for the gateway's text layer (gateway/text/).

Reference: transformers' ``AutoTokenizer`` on the same files, for the built-in tiny model
(byte-level BPE, ChatML template) and for tokenizers built here with ``tokenizers``:

- ``spm``: Llama-2 style BPE with byte fallback (normalizer ``Prepend``/``Replace``, decoder
  ``Replace``/``ByteFallback``/``Fuse``/``Strip``), bos added by the post-processor, and a
  Llama-3 like chat template (bos_token, raise_exception, tools/tojson, strftime_now,
  namespace, loop controls, ``{% generation %}``);
- ``meta``: Unigram + Metaspace, in three post-processor/config combinations (special tokens
  come from tokenizer.json's post-processor; add_bos_token/add_eos_token are not consulted,
  as in transformers 5 when a tokenizer.json exists);
- ``wordpiece``: BERT style WordPiece with transformers' clean-up of tokenization spaces, its
  special tokens given only in special_tokens_map.json (one of them missing from
  tokenizer.json).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import (
    AddedToken,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from tokenizers import Tokenizer as HFBackend

from engine.tiny import CORPUS, ensure_tiny_model
from gateway.text import (
    TOKENIZER_FILES,
    ChatTemplateError,
    IncrementalDetokenizer,
    StopStringMatcher,
    Tokenizer,
)

transformers = pytest.importorskip("transformers")

REPO_ROOT = Path(__file__).resolve().parents[1]
FFFD = "\ufffd"

LLAMA3_LIKE_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
    {%- if message['role'] == 'user' %}{% set ns.turns = ns.turns + 1 %}{% endif %}
{%- endfor %}
<|start_header_id|>system<|end_header_id|>

Today Date: {{ date_string }}
User turns: {{ ns.turns }}
{% if tools is not none %}
You have access to these tools:
{% for t in tools %}
{{ t | tojson(indent=4) }}

{% endfor %}
{% endif %}
{{ system_message }}<|eot_id|>
{% for message in messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['role'] == 'ignored' %}{% continue %}{% endif %}
<|start_header_id|>{{ message['role'] }}<|end_header_id|>

{% if message['tool_calls'] is defined %}[tool calls]{% endif %}
{% if message['role'] == 'assistant' %}
{% generation %}{{ message['content'] | trim }}<|eot_id|>{% endgeneration %}
{% else %}
{{ message['content'] | trim }}<|eot_id|>
{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

CHATML_LIST_TEMPLATE = [
    {
        "name": "default",
        "template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    },
    {
        "name": "tool_use",
        "template": "{{ bos_token }}TOOLS={{ tools | tojson }}\n{% for m in messages %}"
        "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
    },
]

ENCODE_SAMPLES = [
    "",
    "Hello world",
    " Hello  world ",
    "The server sorts the requests into batches, gives each one a fair share of memory.",
    "Numbers 0, 1, 42 and 2024-01-15 09:30:00; version 1.2.3!",
    "line one\nline two\n\n\ttabbed",
    "naïve café résumé fiancée",
    "日本語のテキスト、中文文本 😀👍🏽 ünïcödé",
    "Don't stop, isn't it? I'm here. You're there, we've been.",
    "quote ' spaced ' and 's",
    "<s>literal specials</s> [CLS] [SEP] [MASK] <|eot_id|> <|im_start|>x<|im_end|> <|endoftext|>",
]

MESSAGES = [
    {"role": "system", "content": "  You are a tiny model.  "},
    {"role": "user", "content": "What is the capital of France? 🇫🇷"},
    {"role": "assistant", "content": "Paris, of course.", "tool_calls": None},
    {"role": "user", "content": "And of Japan (日本)?"},
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": 'Weather for a city, e.g. <Zürich> & "Köln"',
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


# ---------------------------------------------------------------------------------------------
# Building reference tokenizers
# ---------------------------------------------------------------------------------------------


EXTRA_TRAINING_TEXT = "Don't stop, isn't it? I'm here! You're there, we've been; it's fine.\n"


def _corpus_lines() -> list[str]:
    return CORPUS.splitlines(keepends=True)


def _write(dir_: Path, name: str, obj) -> None:
    text = obj if isinstance(obj, str) else json.dumps(obj, indent=2, ensure_ascii=False)
    (dir_ / name).write_text(text, encoding="utf-8")


def _added_tokens_decoder(backend: HFBackend) -> dict:
    return {
        str(i): {
            "content": t.content,
            "lstrip": t.lstrip,
            "rstrip": t.rstrip,
            "normalized": t.normalized,
            "single_word": t.single_word,
            "special": t.special,
        }
        for i, t in backend.get_added_tokens_decoder().items()
    }


def build_spm(dir_: Path) -> Path:
    """Llama-2 style: BPE with byte fallback, '▁' for spaces, bos added by the post-processor."""
    tok = HFBackend(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(_corpus_lines(), trainer=trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):  # byte tokens are ordinary vocabulary entries, as in Llama-2
        vocab[f"<0x{b:02X}>"] = len(vocab)
    spec["pre_tokenizer"] = None
    spec["normalizer"] = {
        "type": "Sequence",
        "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        ],
    }
    tok = HFBackend.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<|start_header_id|>",)]
        + [AddedToken("<|end_header_id|>", special=True, normalized=False)]
        + [AddedToken("<|eot_id|>", special=True, normalized=False)]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)]
    )
    tok.save(str(dir_ / "tokenizer.json"))
    _write(
        dir_,
        "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "<|eot_id|>",
            "unk_token": "<unk>",
            "pad_token": None,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1000000000000000019884624838656,
            "added_tokens_decoder": _added_tokens_decoder(tok),
            "chat_template": LLAMA3_LIKE_TEMPLATE,
        },
    )
    _write(
        dir_,
        "generation_config.json",
        {"bos_token_id": 1, "eos_token_id": [2, tok.token_to_id("<|eot_id|>")]},
    )
    _write(dir_, "config.json", {"max_position_embeddings": 2048, "eos_token_id": 2})
    return dir_


def build_meta(dir_: Path, variant: str) -> Path:
    """Unigram + Metaspace; ``variant`` picks the post-processor/config combination."""
    tok = HFBackend(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "</s>", "<s>", "<unk>"],
        unk_token="<unk>",
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_lines(), trainer=trainer)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "added_tokens_decoder": _added_tokens_decoder(tok),
        "chat_template": CHATML_LIST_TEMPLATE,
    }
    if variant == "json-bos":  # tokenizer.json adds bos, the config says nothing
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 2)]
        )
    elif variant == "config-off":  # tokenizer.json adds bos; config flags are not consulted
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 2)]
        )
        config["add_bos_token"] = False
    elif variant == "no-pp-config-on":  # no post-processor; config flags are not consulted
        config["add_bos_token"] = True
        config["add_eos_token"] = True
    else:
        raise AssertionError(variant)
    tok.save(str(dir_ / "tokenizer.json"))
    _write(dir_, "tokenizer_config.json", config)
    return dir_


def build_wordpiece(dir_: Path) -> Path:
    """BERT style with clean-up; special tokens only in special_tokens_map.json (legacy)."""
    tok = HFBackend(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    trainer = trainers.WordPieceTrainer(
        vocab_size=400, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"], show_progress=False
    )
    tok.train_from_iterator(_corpus_lines() + [EXTRA_TRAINING_TEXT], trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
    )
    tok.save(str(dir_ / "tokenizer.json"))
    _write(
        dir_,
        "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": True,
            "model_max_length": 512,
        },
    )
    _write(
        dir_,
        "special_tokens_map.json",
        {
            "unk_token": "[UNK]",
            "sep_token": "[SEP]",
            "pad_token": "[PAD]",
            "cls_token": "[CLS]",
            "mask_token": "[MASK]",  # not in tokenizer.json: both loaders must add it
        },
    )
    return dir_


TOKENIZER_KINDS = [
    "tiny",
    "spm",
    "meta-json-bos",
    "meta-config-off",
    "meta-no-pp-config-on",
    "wordpiece",
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    dirs = {"tiny": ensure_tiny_model()}
    for kind in TOKENIZER_KINDS[1:]:
        d = root / kind
        d.mkdir()
        if kind == "spm":
            build_spm(d)
        elif kind == "wordpiece":
            build_wordpiece(d)
        else:
            build_meta(d, kind.removeprefix("meta-"))
        dirs[kind] = d
    return dirs


@pytest.fixture(scope="module")
def pairs(model_dirs) -> dict[str, tuple[Tokenizer, object]]:
    out = {}
    for kind, d in model_dirs.items():
        out[kind] = (Tokenizer.from_dir(d), transformers.AutoTokenizer.from_pretrained(str(d)))
    return out


def _hf_chat(hf, messages, **kw):
    return hf.apply_chat_template(messages, tokenize=False, **kw)


# ---------------------------------------------------------------------------------------------
# Tokenizer vs transformers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", TOKENIZER_KINDS)
def test_encode_matches_transformers(pairs, kind):
    tok, hf = pairs[kind]
    for text in ENCODE_SAMPLES + _corpus_lines()[:8]:
        for add in (True, False):
            assert tok.encode(text, add_special_tokens=add) == hf.encode(
                text, add_special_tokens=add
            ), (kind, text, add)
    assert tok.vocab_size == len(hf)


def test_bos_eos_follow_post_processor_and_config(pairs):
    cases = {
        "tiny": (False, False),
        "spm": (True, False),
        "meta-json-bos": (True, False),
        "meta-config-off": (True, False),
        "meta-no-pp-config-on": (False, False),
    }
    for kind, (bos, eos) in cases.items():
        tok, _ = pairs[kind]
        plain = tok.encode("Hello world", add_special_tokens=False)
        ids = tok.encode("Hello world")
        bos_id = tok.token_to_id(tok.bos_token)
        eos_id = tok.token_to_id(tok.eos_token)
        assert ids == [bos_id] * bos + plain + [eos_id] * eos, kind


@pytest.mark.parametrize("kind", TOKENIZER_KINDS)
def test_decode_matches_transformers(pairs, kind):
    tok, hf = pairs[kind]
    rng = random.Random(kind)
    seqs = [hf.encode(t) for t in ENCODE_SAMPLES]
    seqs += [[rng.randrange(len(hf)) for _ in range(rng.randrange(1, 30))] for _ in range(200)]
    for ids in seqs:
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            ), (kind, ids, skip)


def test_wordpiece_cleanup_and_added_mask_token(pairs):
    tok, hf = pairs["wordpiece"]
    assert tok.token_to_id("[MASK]") == hf.convert_tokens_to_ids("[MASK]") is not None
    ids = hf.encode("Don't stop, isn't it? I'm here.", add_special_tokens=False)
    assert tok.decode(ids) == hf.decode(ids) == "don't stop, isn't it? i'm here."
    assert tok.special_tokens["mask_token"] == "[MASK]"
    assert tok.model_max_length == 512


@pytest.mark.parametrize("kind", ["tiny", "spm"])
def test_chat_template_matches_transformers(pairs, kind):
    tok, hf = pairs[kind]
    for gen in (True, False):
        for tools in (None, TOOLS):
            text = tok.apply_chat_template(MESSAGES, add_generation_prompt=gen, tools=tools)
            ref = _hf_chat(hf, MESSAGES, add_generation_prompt=gen, tools=tools)
            assert text == ref, (kind, gen, tools)
            ids = tok.chat_ids(MESSAGES, add_generation_prompt=gen, tools=tools)
            ref_ids = hf.apply_chat_template(
                MESSAGES, add_generation_prompt=gen, tools=tools, return_dict=False
            )
            assert ids == ref_ids, (kind, gen, tools)
    # default: add_generation_prompt=True
    assert tok.apply_chat_template(MESSAGES) == _hf_chat(hf, MESSAGES, add_generation_prompt=True)


def test_spm_template_details(pairs):
    tok, hf = pairs["spm"]
    text = tok.apply_chat_template(MESSAGES, tools=TOOLS, date_string="26 Jul 2024")
    assert text == _hf_chat(
        hf, MESSAGES, add_generation_prompt=True, tools=TOOLS, date_string="26 Jul 2024"
    )
    assert text.startswith("<s><|start_header_id|>system")
    assert "Today Date: 26 Jul 2024\nUser turns: 2\n" in text
    assert '"description": "Weather for a city, e.g. <Zürich> & \\"Köln\\""' in text  # no escaping
    assert "\n    " not in text.split("<|eot_id|>", 1)[1].replace('\n    "', "")  # lstrip_blocks
    ids = tok.chat_ids(MESSAGES)
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    assert tok.eos_token_ids == [2, tok.token_to_id("<|eot_id|>")]
    assert tok.model_max_length == 2048  # tokenizer_config has the "no limit" sentinel


def test_raise_exception_in_template(pairs):
    tok, hf = pairs["spm"]
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate"):
        tok.apply_chat_template(bad)
    with pytest.raises(Exception, match="Conversation roles must alternate"):
        _hf_chat(hf, bad)


def test_content_parts_and_none_fields(pairs):
    tok, hf = pairs["tiny"]
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}],
        },
        {"role": "assistant", "content": None, "tool_calls": None},
    ]
    flat = [{"role": "user", "content": "Hello there"}, {"role": "assistant"}]
    text = tok.apply_chat_template(parts)
    assert text == tok.apply_chat_template(flat) == _hf_chat(hf, flat, add_generation_prompt=True)
    assert "Hello there" in text
    # the spm template does not understand lists: the normalisation must happen before rendering
    tok2, hf2 = pairs["spm"]
    parts2 = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    flat2 = [{"role": "user", "content": "ab"}]
    kw = {"date_string": "1 Jan 2025"}
    assert tok2.apply_chat_template(parts2, **kw) == _hf_chat(
        hf2, flat2, add_generation_prompt=True, **kw
    )
    with pytest.raises(ValueError, match="image_url"):
        tok.apply_chat_template(
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]
        )
    with pytest.raises(ValueError):
        tok.apply_chat_template([])
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"content": "x"}])


def test_named_templates_and_missing_template(pairs, model_dirs, tmp_path):
    tok, hf = pairs["meta-json-bos"]
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == _hf_chat(hf, msgs, add_generation_prompt=True)
    assert tok.apply_chat_template(msgs, tools=TOOLS) == _hf_chat(
        hf, msgs, add_generation_prompt=True, tools=TOOLS
    )
    assert tok.apply_chat_template(msgs, tools=TOOLS).startswith("<s>TOOLS=[{")

    # chat_template.jinja takes precedence over tokenizer_config.json
    files = Tokenizer.read_files(model_dirs["tiny"])
    files["chat_template.jinja"] = (
        b"{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    )
    assert Tokenizer.from_files(files).apply_chat_template(msgs) == "[user]hi"

    tok_wp, _ = pairs["wordpiece"]
    assert not tok_wp.has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok_wp.apply_chat_template(msgs)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok_wp.chat_ids(msgs)


def test_from_files_equals_from_dir(model_dirs):
    d = model_dirs["tiny"]
    files = Tokenizer.read_files(d)
    assert set(files) <= set(TOKENIZER_FILES) and "tokenizer.json" in files
    a, b = Tokenizer.from_dir(d), Tokenizer.from_files({**files, "model.safetensors": b"x"})
    assert a.encode("Hello there") == b.encode("Hello there")
    assert a.apply_chat_template(MESSAGES) == b.apply_chat_template(MESSAGES)
    assert a.eos_token_ids == b.eos_token_ids == [2]
    assert (a.vocab_size, a.model_max_length) == (512, 4096)
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_files({"tokenizer_config.json": files["tokenizer_config.json"]})


def test_sandbox_blocks_unsafe_templates(model_dirs):
    files = Tokenizer.read_files(model_dirs["tiny"])
    files["chat_template.jinja"] = b"{{ messages.__class__.__mro__ }}"
    with pytest.raises(Exception):  # noqa: B017 - SecurityError or ChatTemplateError
        Tokenizer.from_files(files).apply_chat_template([{"role": "user", "content": "x"}])
    files["chat_template.jinja"] = b"{% set ns = namespace() %}{% set ns._x = 1 %}"
    with pytest.raises(Exception):  # noqa: B017
        Tokenizer.from_files(files).apply_chat_template([{"role": "user", "content": "x"}])


# ---------------------------------------------------------------------------------------------
# Incremental detokenizer
# ---------------------------------------------------------------------------------------------


def _stream(tok, ids, *, skip=True, rng=None, sizes=(1,)):
    det = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    chunks = []
    i = 0
    while i < len(ids):
        n = rng.choice(sizes) if rng else sizes[0]
        chunks.append(det.push(ids[i : i + n]))
        i += n
    chunks.append(det.flush())
    return chunks


@pytest.mark.parametrize("kind", TOKENIZER_KINDS)
def test_detokenizer_random_ids_equal_full_decode(pairs, kind):
    tok, hf = pairs[kind]
    rng = random.Random(1234)
    n = tok.vocab_size
    byte_ids = sorted(tok.byte_fallback_ids) or list(range(n))
    special = [tok.token_to_id(t) for t in tok.special_tokens.values()]
    for trial in range(400):
        length = rng.randrange(0, 40)
        ids = []
        for _ in range(length):
            r = rng.random()
            if r < 0.3:
                ids.append(rng.choice(byte_ids))  # multi-byte pieces, invalid bytes
            elif r < 0.4:
                ids.append(rng.choice(special))
            else:
                ids.append(rng.randrange(n))
        skip = trial % 2 == 0
        chunks = _stream(tok, ids, skip=skip, rng=rng, sizes=(1, 1, 2, 3, 7))
        full = tok.decode(ids, skip_special_tokens=skip)
        assert full == hf.decode(ids, skip_special_tokens=skip)
        assert "".join(chunks) == full, (kind, ids, chunks)
        if FFFD not in full:
            assert not any(FFFD in c for c in chunks)


UNICODE_TEXTS = [
    "日本語のテキスト、中文文本と한국어 😀👍🏽🇫🇷 — “quotes” naïve café",
    "emoji run 🎉🎉🎉 then ascii, then 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and Ωμέγα",
    "The little server woke up before anyone else. Don't stop , it 's fine !",
]


@pytest.mark.parametrize("kind", TOKENIZER_KINDS)
def test_detokenizer_unicode_stream_never_breaks_characters(pairs, kind):
    tok, _ = pairs[kind]
    for text in UNICODE_TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        full = tok.decode(ids, skip_special_tokens=True)
        for sizes in ((1,), (2,), (5,)):
            chunks = _stream(tok, ids, sizes=sizes)
            assert "".join(chunks) == full
            assert not any(FFFD in c for c in chunks), chunks
    # the byte-level tiny tokenizer really splits characters over several tokens
    if kind == "tiny":
        ids = tok.encode("😀", add_special_tokens=False)
        assert len(ids) > 1 and tok.decode(ids[:1]) == FFFD


def test_detokenizer_emits_promptly(pairs):
    """Text is released as soon as it is final, not just at flush (byte-level tokenizer)."""
    tok, _ = pairs["tiny"]
    ids = tok.encode(UNICODE_TEXTS[0] + " " + CORPUS[:400], add_special_tokens=False)
    det = IncrementalDetokenizer(tok)
    emitted = ""
    last_clean = ""
    for k in range(1, len(ids) + 1):
        emitted += det.push([ids[k - 1]])
        prefix = tok.decode(ids[:k])
        if not prefix.endswith(FFFD):
            last_clean = prefix
        assert emitted == last_clean, k
    assert det.flush() == ""


def test_detokenizer_metaspace_prefix_space(pairs):
    """Leading '▁' of the first token is dropped, later ones become spaces, even across
    windows and skipped special tokens."""
    tok, hf = pairs["meta-json-bos"]
    ids = tok.encode("Hello world again and again", add_special_tokens=False)
    eos = tok.token_to_id("</s>")
    seq = [eos] + ids[:2] + [eos, eos] + ids[2:] + [eos]
    for skip in (True, False):
        assert "".join(_stream(tok, seq, skip=skip)) == hf.decode(seq, skip_special_tokens=skip)


def test_detokenizer_window_stays_small(pairs, monkeypatch):
    tok, _ = pairs["tiny"]
    seen = []
    orig = tok.decode_raw

    def spy(ids, skip):
        seen.append(len(ids))
        return orig(ids, skip)

    monkeypatch.setattr(tok, "decode_raw", spy)
    ids = tok.encode(CORPUS * 3, add_special_tokens=False)
    assert len(ids) > 2000
    det = IncrementalDetokenizer(tok)
    out = "".join(det.push([i]) for i in ids) + det.flush()
    assert out == CORPUS * 3
    assert max(seen) <= 8, max(seen)
    assert len(seen) <= 2 * len(ids) + 2  # at most two small decodes per token

    # a long run of UTF-8 lead bytes (each one an invalid character) must not grow the window
    seen.clear()
    lead = tok.token_to_id("â")  # byte 0xE2
    a = tok.token_to_id("a")
    garbage = [lead] * 300 + [a] + [lead] * 50
    det = IncrementalDetokenizer(tok)
    chunks = [det.push([i]) for i in garbage] + [det.flush()]
    monkeypatch.undo()
    assert "".join(chunks) == tok.decode(garbage)
    assert max(seen) <= 24, max(seen)

    # skipped special tokens never enter the window
    eos = tok.token_to_id("<|im_end|>")
    det = IncrementalDetokenizer(tok, skip_special_tokens=True)
    assert det.push(tok.encode("Hi", add_special_tokens=False)) == "Hi"
    assert det.push([eos] * 500) == ""
    assert det.window_size <= 2
    assert det.push(tok.encode(" there", add_special_tokens=False)) + det.flush() == " there"


def test_detokenizer_after_flush(pairs):
    tok, _ = pairs["tiny"]
    det = IncrementalDetokenizer(tok)
    assert det.push([]) == ""
    assert det.flush() == ""
    with pytest.raises(RuntimeError):
        det.push([1])


# ---------------------------------------------------------------------------------------------
# Stop strings
# ---------------------------------------------------------------------------------------------


def _run_stops(stops, pieces):
    m = StopStringMatcher(stops)
    out = []
    hit = False
    for p in pieces:
        text, hit = m.push(p)
        out.append(text)
        if hit:
            break
    if not hit:
        out.append(m.flush())
    return "".join(out), hit, m


def test_stop_split_across_pushes():
    assert _run_stops(["STOP"], ["hello S", "TO", "P world"])[:2] == ("hello ", True)
    assert _run_stops(["STOP"], ["hello ST", "OP"])[:2] == ("hello ", True)
    assert _run_stops(["STOP"], ["a", "S", "T", "O", "P", "b"])[:2] == ("a", True)
    # partial match that does not complete is released
    assert _run_stops(["STOP"], ["hello STO", "RM"])[:2] == ("hello STORM", False)
    assert _run_stops(["STOP"], ["tail ST"])[:2] == ("tail ST", False)  # flush releases it


def test_stop_holds_back_only_possible_prefixes():
    m = StopStringMatcher(["\n\nUser:"])
    assert m.push("Hello\n") == ("Hello", False)
    assert m.push("\nUs") == ("", False)
    assert m.push("age") == ("\n\nUsage", False)
    m2 = StopStringMatcher(["xyz"])
    assert m2.push("abc") == ("abc", False)  # nothing held when no prefix matches


def test_stop_at_start_and_multiple_stops():
    assert _run_stops(["<end>"], ["<end>rest"])[:2] == ("", True)
    text, hit, m = _run_stops(["bar", "foo"], ["xx fo", "o bar"])
    assert (text, hit, m.matched) == ("xx ", True, "foo")
    text, hit, m = _run_stops(["###", "\n"], ["line one", "\nline two ###"])
    assert (text, hit, m.matched) == ("line one", True, "\n")


def test_stop_overlapping_prefixes():
    # "ab" completes before "abc" could: cut before "ab", whatever the chunking
    for pieces in (["xabc"], ["xa", "bc"], ["x", "a", "b", "c"]):
        text, hit, m = _run_stops(["abc", "ab"], pieces)
        assert (text, hit, m.matched) == ("x", True, "ab"), pieces
    # a stop completing earlier wins over one starting earlier
    for pieces in (["abcd"], ["a", "b", "c", "d"], ["ab", "cd"]):
        text, hit, m = _run_stops(["abcd", "bc"], pieces)
        assert (text, hit, m.matched) == ("a", True, "bc"), pieces
    # self-overlapping stop: "aab" inside "aaab"
    for pieces in (["aaab"], ["a", "a", "a", "b"], ["aa", "ab"]):
        assert _run_stops(["aab"], pieces)[:2] == ("a", True), pieces


def test_stop_never_leaks_stop_text():
    rng = random.Random(7)
    alphabet = "ab c\n<|>"
    for _ in range(2000):
        stops = list(
            {
                "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 4)))
                for _ in range(rng.randrange(1, 3))
            }
        )
        full = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 30)))
        # reference: the earliest end of any stop, cut at that stop's start
        ends = [(full.find(s) + len(s), full.find(s)) for s in stops if s in full]
        expected = full[: min(ends)[1]] if ends else full
        pieces, i = [], 0
        while i < len(full):
            n = rng.randrange(1, 5)
            pieces.append(full[i : i + n])
            i += n
        m = StopStringMatcher(stops)
        out = ""
        for p in pieces:
            text, hit = m.push(p)
            out += text
            assert not any(s in out for s in stops)
            if hit:
                break
        out += m.flush()
        assert out == expected, (stops, pieces)
        assert m.stopped == bool(ends)
        if ends:
            assert m.push("more") == ("", True)


def test_stop_validation():
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])
    with pytest.raises(TypeError):
        StopStringMatcher([b"x"])
    m = StopStringMatcher([])
    assert m.push("anything") == ("anything", False) and m.flush() == ""


# ---------------------------------------------------------------------------------------------
# Import hygiene
# ---------------------------------------------------------------------------------------------


def test_gateway_text_does_not_import_torch_or_transformers():
    tiny = ensure_tiny_model()
    code = (
        "import sys, json\n"
        "import gateway.text as t\n"
        "tok = t.Tokenizer.from_dir(sys.argv[1])\n"
        "ids = tok.chat_ids([{'role': 'user', 'content': 'hi'}])\n"
        "d = t.IncrementalDetokenizer(tok); d.push(ids); d.flush()\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
        "print(json.dumps(bad))\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, str(tiny)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1]) == []
