"""Built-in default model: a tiny random-weight Llama checkpoint plus a byte-level BPE tokenizer.

Everything is generated locally and deterministically (no network, no model hub): the tokenizer
is trained on a fixed English text embedded below and the weights come from a seeded
``torch.Generator``. The result is a regular Hugging Face style model directory::

    config.json  generation_config.json  model.safetensors
    tokenizer.json  tokenizer_config.json  special_tokens_map.json  .complete

The directory lives under a cache root and its name contains a hash of the build recipe, so a
recipe change produces a fresh directory instead of reusing a stale one. Builds go to a temporary
sibling directory that is atomically renamed into place, which makes :func:`ensure_tiny_model`
idempotent and safe to call from several processes at once.

Command line: ``python -m engine.tiny [--cache-dir DIR]`` builds (if needed) and prints the path.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "TINY_MODEL_NAME",
    "default_cache_root",
    "ensure_tiny_model",
    "is_complete",
    "tiny_model_dir",
]

TINY_MODEL_NAME = "tiny-llama"

# Bump when the build code changes in a way the recipe dict below does not capture.
RECIPE_VERSION = 2

CONFIG_TRANSFORMERS_VERSION = "5.0.0"
"""The ``transformers_version`` the config.json files written here record
(transformers writes the version that saved a config). transformers from
4.57.2 to early 5.x takes a local tokenizer whose config records none as
possibly Mistral's, with a broken pre-tokenizer regex, and warns at every
load that its tokenization is wrong; every version of that check passes a
config that records 5.0.0 or later."""

MARKER_NAME = ".complete"
_TMP_INFIX = ".tmp-"

BOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
EOS_TOKEN = IM_END
SPECIAL_TOKENS = [BOS_TOKEN, IM_START, IM_END]  # ids 0, 1, 2 (trainer puts specials first)

VOCAB_SIZE = 512
SEED = 1234

# Init scales. The embedding is large so the residual stream is token-dominated; the linear layers
# use std = gain / sqrt(fan_in), so attention and MLP contributions are of the same order as the
# embedding (a model whose attention is negligible would hide KV-cache / position bugs).
EMBED_STD = 1.0
LM_HEAD_STD = 0.05
LINEAR_GAIN = 1.0
NORM_NOISE_STD = 0.02

MODEL_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "torch_dtype": "float32",
    "dtype": "float32",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "initializer_range": 0.02,
    "pretraining_tp": 1,
    "use_cache": True,
    "bos_token_id": 0,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

CHAT_TEMPLATE = (
    # Qwen2.5's layout: tools listed in a system turn, calls as <tool_call>
    # tags, tool results as <tool_response> in a user turn. Without tools a
    # conversation renders as plain ChatML.
    "{%- macro text(message) %}"
    "{%- if message['content'] is string %}"
    "{{- message['content'] }}"
    "{%- elif message['content'] is not none and message['content'] is defined %}"
    "{{- message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') }}"
    "{%- endif %}"
    "{%- endmacro %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- text(messages[0]) + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}"
    "{%- endif %}"
    "{{- '\\n<tool_response>\\n' + text(message) + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + text(message) }}"
    "{%- for call in message['tool_calls'] or [] %}"
    "{%- set fn = call['function'] if call['function'] is defined else call %}"
    "{%- if loop.first and text(message) %}{{- '\\n' }}{%- elif not loop.first %}{{- '\\n' }}"
    "{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{%- if fn['arguments'] is string %}{{- fn['arguments'] }}"
    "{%- else %}{{- fn['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# Training text for the tokenizer. Written for this module; any change alters the recipe hash.
CORPUS = """\
The little server woke up before anyone else in the building. Its fans spun slowly at first,
then settled into a steady hum, and the status lights blinked green one after another. Every
morning it did the same small things: it checked its disks, it read its configuration, and it
waited for the first request of the day to arrive from somewhere far away.

A request is a simple thing. Someone types a question, the words are turned into numbers, and
the numbers travel through many layers of arithmetic until new numbers come out the other side.
Those numbers are turned back into words, one token at a time, and the answer is sent home. The
person who asked the question rarely thinks about the journey, and that is exactly how it should
be. Good machinery is quiet machinery.

The work is split in two. The first part reads the whole prompt at once and writes down what it
has seen in a compact form called the cache. The second part takes that cache and produces the
reply, one step after another, always remembering what came before. Because the two parts have
different needs, they can live on different machines, and the cache is copied between them over
a fast network. When the copy is finished, the second machine continues the story as if it had
read the prompt itself.

On rainy days the queue grows long. People ask for recipes, for poems about their cats, for help
with homework, for the capital of a country they will visit next summer. The server does not
mind. It sorts the requests into batches, gives each one a fair share of memory, and keeps the
longest ones from starving the short ones. When memory runs low it pauses a few requests, saves
their progress, and brings them back later without losing a single word.

Numbers such as 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 42, 100, 256, 1024 and 2048 appear everywhere:
in sizes, in counters, in timestamps like 2024-01-15 09:30:00, and in version strings like 1.2.3.
Punctuation matters too: commas, periods, colons; quotes "like these", brackets (and parentheses),
questions? exclamations! and the occasional semicolon. Text also contains names, places, and
words borrowed from other languages, such as cafe, naive, resume, and fiancee.

At night, when the traffic slows down, the engineers look at the charts. They measure how long
the first token takes to appear, how fast the following tokens stream out, and how many requests
finish every second. If a line on the chart moves the wrong way, they read the logs, form a
guess, change one thing, and measure again. It is patient work, but it is also a good kind of
work, because every small improvement is shared by everyone who asks a question tomorrow.

The tiny model in this story knows almost nothing. Its weights were chosen by a random number
generator with a fixed seed, so it will say the same strange things every time. That is its whole
purpose: it is small enough to load in a moment, it follows the same rules as a real model, and it
lets the rest of the system be tested from end to end without downloading anything at all.
"""


# --------------------------------------------------------------------------------------------
# Paths
# --------------------------------------------------------------------------------------------


def _recipe() -> dict[str, Any]:
    return {
        "recipe_version": RECIPE_VERSION,
        "name": TINY_MODEL_NAME,
        "config": MODEL_CONFIG,
        "vocab_size": VOCAB_SIZE,
        "special_tokens": SPECIAL_TOKENS,
        "bos": BOS_TOKEN,
        "eos": EOS_TOKEN,
        "pad": PAD_TOKEN,
        "chat_template": CHAT_TEMPLATE,
        "corpus": CORPUS,
        "seed": SEED,
        "init": [EMBED_STD, LM_HEAD_STD, LINEAR_GAIN, NORM_NOISE_STD],
    }


def recipe_hash() -> str:
    """Short hash of everything that determines the built files."""
    blob = json.dumps(_recipe(), sort_keys=True, separators=(",", ":")).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()[:12]


def default_cache_root() -> Path:
    """``$DISAGG_CACHE_DIR``, else ``$XDG_CACHE_HOME/disagg-serve``, else ``~/.cache/disagg-serve``."""
    explicit = os.environ.get("DISAGG_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "disagg-serve"
    return Path.home() / ".cache" / "disagg-serve"


def tiny_model_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the tiny model lives (does not build it). ``cache_dir`` overrides the cache root."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    return root / f"{TINY_MODEL_NAME}-{recipe_hash()}"


def is_complete(model_dir: str | os.PathLike[str]) -> bool:
    """True if ``model_dir`` holds a finished build (its marker file is written last)."""
    return (Path(model_dir) / MARKER_NAME).is_file()


# --------------------------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _env(**overrides: str):
    saved = {k: os.environ.get(k) for k in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The trainer's merge order is fully determined by counts with ties broken by pair ids, but
    # keep the training single-threaded anyway so the result can't depend on scheduling.
    with _env(TOKENIZERS_PARALLELISM="false", RAYON_NUM_THREADS="1"):
        tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)

    n = tok.get_vocab_size(with_added_tokens=True)
    if n != VOCAB_SIZE:
        raise RuntimeError(f"tiny tokenizer has {n} tokens, expected {VOCAB_SIZE}")
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:
            raise RuntimeError(f"special token {t!r} has id {tok.token_to_id(t)}, expected {i}")
    return tok


def _make_weights() -> dict[str, Any]:
    import torch

    c = MODEL_CONFIG
    hidden, inter, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    n_q, n_kv, vocab = c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"]

    g = torch.Generator(device="cpu").manual_seed(SEED)

    def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return (torch.randn(shape, generator=g, dtype=torch.float32) * std).contiguous()

    def linear(out_f: int, in_f: int) -> torch.Tensor:
        return normal((out_f, in_f), LINEAR_GAIN / in_f**0.5)

    def norm() -> torch.Tensor:
        return 1.0 + normal((hidden,), NORM_NOISE_STD)

    # Fixed generation order: changing it changes the weights (bump RECIPE_VERSION).
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal((vocab, hidden), EMBED_STD)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm()
        w[p + "self_attn.q_proj.weight"] = linear(n_q * hd, hidden)
        w[p + "self_attn.k_proj.weight"] = linear(n_kv * hd, hidden)
        w[p + "self_attn.v_proj.weight"] = linear(n_kv * hd, hidden)
        w[p + "self_attn.o_proj.weight"] = linear(hidden, n_q * hd)
        w[p + "post_attention_layernorm.weight"] = norm()
        w[p + "mlp.gate_proj.weight"] = linear(inter, hidden)
        w[p + "mlp.up_proj.weight"] = linear(inter, hidden)
        w[p + "mlp.down_proj.weight"] = linear(hidden, inter)
    w["model.norm.weight"] = norm()
    w["lm_head.weight"] = normal((vocab, hidden), LM_HEAD_STD)
    return w


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", "utf-8")


def _build_into(out: Path) -> None:
    """Write every file of the model into the (existing, empty) directory ``out``."""
    from safetensors.torch import save_file

    tok = _train_tokenizer()
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    assert MODEL_CONFIG["vocab_size"] == tok.get_vocab_size(with_added_tokens=True)
    assert MODEL_CONFIG["bos_token_id"] == ids[BOS_TOKEN]
    assert MODEL_CONFIG["eos_token_id"] == ids[EOS_TOKEN]
    assert MODEL_CONFIG["pad_token_id"] == ids[PAD_TOKEN]

    tok.save(str(out / "tokenizer.json"), pretty=True)

    max_len = MODEL_CONFIG["max_position_embeddings"]
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            "unk_token": None,
            "add_bos_token": False,
            "add_eos_token": False,
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": max_len,
            "padding_side": "left",
            "additional_special_tokens": [IM_START, IM_END],
            "chat_template": CHAT_TEMPLATE,
            "added_tokens_decoder": {
                str(ids[t]): {
                    "content": t,
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": False,
                    "single_word": False,
                    "special": True,
                }
                for t in SPECIAL_TOKENS
            },
        },
    )
    _write_json(
        out / "special_tokens_map.json",
        {
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            "additional_special_tokens": [IM_START, IM_END],
        },
    )
    _write_json(
        out / "config.json", {**MODEL_CONFIG, "transformers_version": CONFIG_TRANSFORMERS_VERSION}
    )
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": MODEL_CONFIG["bos_token_id"],
            "eos_token_id": MODEL_CONFIG["eos_token_id"],
            "pad_token_id": MODEL_CONFIG["pad_token_id"],
        },
    )
    weights = out / "model.safetensors"
    save_file(_make_weights(), str(weights), metadata={"format": "pt"})
    # save_file creates the file 0600; give it the same (umask-derived) mode as the other files.
    os.chmod(weights, (out / "config.json").stat().st_mode & 0o777)

    # Marker last: its presence means every other file is complete.
    _write_json(out / MARKER_NAME, {"name": TINY_MODEL_NAME, "recipe": recipe_hash()})


def _publish(tmp: Path, final: Path) -> Path:
    """Atomically move the finished build ``tmp`` to ``final``; if another process won, drop ours."""
    for _ in range(5):
        try:
            os.rename(tmp, final)
            return final
        except OSError:
            if is_complete(final):  # lost the race to a concurrent builder
                shutil.rmtree(tmp, ignore_errors=True)
                return final
            if not final.exists():  # transient: someone moved a stale dir away; retry
                continue
            # ``final`` exists but is not a complete build (e.g. written by hand or by an old,
            # non-atomic tool): move it out of the way, then retry.
            stale = final.with_name(f".{final.name}.stale-{uuid.uuid4().hex}")
            with contextlib.suppress(OSError):
                os.rename(final, stale)
                shutil.rmtree(stale, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)
    raise RuntimeError(f"could not publish a built model to {final}")


def ensure_tiny_model(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the tiny model directory, building it first if it is missing."""
    return build_once(tiny_model_dir(cache_dir), _build_into)


def build_once(final: Path, build: Callable[[Path], None]) -> Path:
    """``final``, built by ``build(tmp_dir)`` first if it is not complete
    (``build`` writes ``MARKER_NAME`` last).

    Idempotent and safe to call concurrently from several processes: each builder writes into its
    own temporary sibling directory and renames it into place atomically; a builder that loses the
    race discards its copy.
    """
    if is_complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}{_TMP_INFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        build(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _publish(tmp, final)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine.tiny",
        description=(
            f"Build (once) the built-in '{TINY_MODEL_NAME}' model: a tiny random-weight Llama "
            "checkpoint with a byte-level BPE tokenizer, generated deterministically without "
            "network access. Prints the model directory."
        ),
    )
    parser.add_argument(
        "--cache-dir",
        metavar="DIR",
        default=None,
        help=(
            "cache root to build into; the model goes in a versioned subdirectory of it "
            "(default: $DISAGG_CACHE_DIR, else $XDG_CACHE_HOME/disagg-serve, "
            "else ~/.cache/disagg-serve)"
        ),
    )
    args = parser.parse_args(argv)
    print(ensure_tiny_model(args.cache_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
