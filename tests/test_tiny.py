"""Tests for the built-in tiny model (engine/tiny.py)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import tiny
from engine.tiny import TINY_MODEL_NAME, ensure_tiny_model, tiny_model_dir

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("tiny-cache"))


# ---------------------------------------------------------------------------------------------
# Paths and building
# ---------------------------------------------------------------------------------------------


def test_dir_layout_and_default_root(tmp_path, monkeypatch):
    d = tiny_model_dir(tmp_path)
    assert d.parent == tmp_path
    assert d.name.startswith(TINY_MODEL_NAME + "-")
    assert d.name == f"{TINY_MODEL_NAME}-{tiny.recipe_hash()}"
    assert not d.exists()  # tiny_model_dir never builds

    monkeypatch.setenv("DISAGG_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tiny_model_dir().parent == tmp_path / "explicit"
    monkeypatch.delenv("DISAGG_CACHE_DIR")
    assert tiny_model_dir().parent == tmp_path / "xdg" / "disagg-serve"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert tiny_model_dir().parent == tmp_path / "home" / ".cache" / "disagg-serve"


def test_recipe_change_gives_new_dir(tmp_path, monkeypatch):
    before = tiny_model_dir(tmp_path)
    monkeypatch.setattr(tiny, "SEED", tiny.SEED + 1)
    assert tiny_model_dir(tmp_path) != before


def test_files_present(model_dir):
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        tiny.MARKER_NAME,
    ):
        assert (model_dir / name).is_file(), name
    # Nothing but the model dir is left in the cache root (no temp dirs).
    assert [p.name for p in model_dir.parent.iterdir()] == [model_dir.name]


def test_idempotent_no_rebuild(tmp_path, monkeypatch):
    d = ensure_tiny_model(tmp_path)
    marker = d / tiny.MARKER_NAME
    st = marker.stat()

    def boom(_out):
        raise AssertionError("rebuilt an already complete model dir")

    monkeypatch.setattr(tiny, "_build_into", boom)
    assert ensure_tiny_model(tmp_path) == d
    assert marker.stat().st_mtime_ns == st.st_mtime_ns
    assert marker.stat().st_ino == st.st_ino


def test_builds_are_byte_identical(model_dir, tmp_path):
    other = ensure_tiny_model(tmp_path)
    assert other != model_dir
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (other / name).read_bytes() == (model_dir / name).read_bytes(), name


def test_incomplete_dir_is_rebuilt(tmp_path):
    d = tiny_model_dir(tmp_path)
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")  # partial junk, no marker
    assert ensure_tiny_model(tmp_path) == d
    assert tiny.is_complete(d)
    assert json.loads((d / "config.json").read_text())["model_type"] == "llama"
    assert [p.name for p in tmp_path.iterdir()] == [d.name]


def test_losing_publish_race_discards_temp(model_dir, tmp_path):
    marker = model_dir / tiny.MARKER_NAME
    mtime = marker.stat().st_mtime_ns
    tmp = model_dir.with_name(f".{model_dir.name}.tmp-test")
    tmp.mkdir()
    (tmp / "config.json").write_text("{}")
    (tmp / tiny.MARKER_NAME).write_text("{}")
    assert tiny._publish(tmp, model_dir) == model_dir
    assert not tmp.exists()
    assert marker.stat().st_mtime_ns == mtime
    assert json.loads((model_dir / "config.json").read_text())["model_type"] == "llama"


def _race_worker(cache_dir: str, barrier, results) -> None:
    barrier.wait(timeout=60)  # both processes start building at the same moment
    try:
        results.put(str(ensure_tiny_model(cache_dir)))
    except BaseException as e:  # report instead of dying silently
        results.put(f"error: {e!r}")
        raise


def test_concurrent_processes(tmp_path):
    ctx = mp.get_context("spawn")  # no fork of a process that may already run torch threads
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [
        ctx.Process(target=_race_worker, args=(str(tmp_path), barrier, results)) for _ in range(2)
    ]
    for p in procs:
        p.start()
    try:
        paths = sorted(results.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    expected = tiny_model_dir(tmp_path)
    assert paths == [str(expected), str(expected)]
    assert tiny.is_complete(expected)
    assert [p.name for p in tmp_path.iterdir()] == [expected.name]  # loser's temp dir removed
    cfg = json.loads((expected / "config.json").read_text())
    assert cfg["vocab_size"] == 512


def test_cli(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-m", "engine.tiny", "--help"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "--cache-dir" in out
    # The CLI prints the path; use a pre-built dir so this stays fast (and checks idempotence).
    expected = ensure_tiny_model(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "engine.tiny", "--cache-dir", str(tmp_path)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == str(expected)


# ---------------------------------------------------------------------------------------------
# Contents
# ---------------------------------------------------------------------------------------------


def test_config(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == "llama"
    expected = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 512,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 0,
        "eos_token_id": 2,
    }
    assert {k: cfg[k] for k in expected} == expected
    assert cfg["rms_norm_eps"] == pytest.approx(1e-5)
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert gen["bos_token_id"] == 0 and gen["eos_token_id"] == 2


def test_safetensors_weights(model_dir):
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = str(model_dir / "model.safetensors")
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    tensors = load_file(path)

    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(2):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        names |= {p + f"self_attn.{x}_proj.weight" for x in "qkvo"}
        names |= {p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
    assert set(tensors) == names
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert tensors["model.embed_tokens.weight"].shape == (512, 64)
    assert tensors["lm_head.weight"].shape == (512, 64)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (64, 64)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (32, 64)
    assert tensors["model.layers.0.self_attn.v_proj.weight"].shape == (32, 64)
    assert tensors["model.layers.0.self_attn.o_proj.weight"].shape == (64, 64)
    assert tensors["model.layers.1.mlp.gate_proj.weight"].shape == (128, 64)
    assert tensors["model.layers.1.mlp.down_proj.weight"].shape == (64, 128)
    norm = tensors["model.norm.weight"]
    assert (norm - 1).abs().max() < 0.2 and not torch.equal(norm, torch.ones_like(norm))
    assert 0.5 < tensors["model.embed_tokens.weight"].std() < 2.0


UNICODE_SAMPLES = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "line one\nline two\r\n\ttabbed\n\n",
    "Café naïve résumé façade — “quotes” ‘single’ …",
    "日本語のテキストと中文文本，还有한국어",
    "emoji 🚀🔥 family 👩‍👩‍👧‍👦 flag 🇺🇳 skin 👍🏽",
    "Ελληνικά, русский, עברית, العربية, हिन्दी",
    "math ∑∫√∞ ≠ ≤ and zero\u200bwidth and nul\x00byte",
    "",
]


def test_tokenizer_roundtrip(model_dir):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = AutoTokenizer.from_pretrained(model_dir)
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert len(tok) == 512
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (
        "<|endoftext|>",
        "<|im_end|>",
        "<|endoftext|>",
    )
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 2, 0)
    assert tok.convert_tokens_to_ids("<|im_start|>") == 1
    for text in UNICODE_SAMPLES:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text, text
        assert all(0 <= i < 512 for i in ids)
    # Specials in text are single tokens and merges actually compress English text.
    assert tok.encode("<|im_start|>user<|im_end|>", add_special_tokens=False)[0] == 1
    english = "The server reads the whole prompt and writes the cache."
    assert len(tok.encode(english)) < len(english.encode()) // 2


def test_tokenizer_json_is_byte_level(model_dir):
    data = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    assert data["model"]["type"] == "BPE"
    assert data["pre_tokenizer"]["type"] == "ByteLevel"
    assert data["pre_tokenizer"]["add_prefix_space"] is False
    assert data["decoder"]["type"] == "ByteLevel"
    assert len(data["model"]["vocab"]) == 512  # the trainer puts the specials in the vocab too
    assert [t["content"] for t in data["added_tokens"]] == [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
    ]


def test_chat_template(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there 👋"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi there 👋<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tok.apply_chat_template(messages[:2], tokenize=False)
    assert no_prompt == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi there 👋<|im_end|>\n"
    )
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    assert tok.apply_chat_template(parts, tokenize=False) == "<|im_start|>user\nab<|im_end|>\n"


def test_transformers_load_and_generate(model_dir):
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    model, info = LlamaForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info.get("mismatched_keys")
    model.eval()
    assert model.dtype == torch.float32

    tok = AutoTokenizer.from_pretrained(model_dir)
    enc = tok("The little server", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=8, do_sample=False, pad_token_id=0)
    new = out[0, enc["input_ids"].shape[1] :].tolist()
    assert len(new) == 8
    assert len(set(new)) > 1, new

    # Attention must matter: changing the first prompt token changes the last position's logits.
    ids = enc["input_ids"]
    other = ids.clone()
    other[0, 0] = (int(ids[0, 0]) + 7) % 512
    with torch.no_grad():
        a = model(ids).logits[0, -1]
        b = model(other).logits[0, -1]
    assert (a - b).abs().max() > 1e-2


def test_configs_record_a_transformers_version(model_dir, tmp_path):
    """The tiny model's and a dummy preset's config.json record a
    ``transformers_version`` of 5.0.0 or later: transformers 4.57.2 to early
    5.x takes a local tokenizer whose config records none for Mistral's, and
    warns at every load that its tokenization is wrong. A preset's own
    version, where it has one, is kept."""
    from engine.dummy_model import write_dummy_model

    dummy = write_dummy_model("qwen3-0.6b", tmp_path / "dummy")
    for d in (model_dir, dummy):
        cfg = json.loads((d / "config.json").read_text())
        major = int(cfg["transformers_version"].split(".")[0])
        assert major >= 5, d
    own = {**json.loads((dummy / "config.json").read_text()), "transformers_version": "4.51.0"}
    kept = write_dummy_model(own, tmp_path / "own")
    assert json.loads((kept / "config.json").read_text())["transformers_version"] == "4.51.0"
