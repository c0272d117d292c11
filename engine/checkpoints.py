"""Where a ``--model`` value's files are: a directory, a preset or a Hugging
Face repo id, made into a local directory the engine and the gateway read.

* None: the built-in tiny model, built in the cache on first use.
* A directory: as it is.
* A preset name (``engine.presets``) with ``--load-format dummy``: its
  config and a synthetic tokenizer, written in the cache on first use (no
  weight files: the weights are random).
* ``org/name``: a Hugging Face repo, downloaded into the Hugging Face cache
  (``HF_HOME``; ``HF_TOKEN`` for gated repos) on first use, config, tokenizer
  and safetensors only; later starts use the cached copy, offline too.
"""

from __future__ import annotations

import os
import re

REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
DOWNLOAD_PATTERNS = ("*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer*")
"""What a checkpoint needs to be served (no .bin, .pth or .gguf copies)."""


class ModelNotFound(ValueError):
    """The ``--model`` value names nothing this machine can load; says why."""


def is_repo_id(model: str) -> bool:
    """``org/name`` that is not a local path."""
    return bool(REPO_ID.match(model)) and not os.path.exists(model)


def served_name(model: str | None) -> str | None:
    """The model name clients see for a ``--model`` value (None: decided by
    whoever builds the default model): a repo id as it is, a directory's or
    preset's last component."""
    if model is None:
        return None
    if is_repo_id(model):
        return model
    return os.path.basename(os.path.normpath(model)) or model


def local_model_dir(model: str | None, load_format: str) -> str:
    """The local directory of ``model`` (see the module docstring). Raises
    ``ModelNotFound`` with a one-line reason."""
    from engine.presets import PRESETS

    if model is None:
        from engine.tiny import ensure_tiny_model

        return str(ensure_tiny_model())
    if os.path.isdir(model):
        return model
    if model in PRESETS:
        if load_format != "dummy":
            raise ModelNotFound(
                f"{model!r} is a preset of shapes without weights: add --load-format dummy"
            )
        from engine.dummy_model import ensure_preset_model

        return str(ensure_preset_model(model))
    if is_repo_id(model):
        return _download(model, load_format)
    raise ModelNotFound(
        f"--model {model!r} is not a directory, a preset ({', '.join(sorted(PRESETS))}) "
        "or a Hugging Face repo id (org/name)"
    )


def _download(repo: str, load_format: str) -> str:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelNotFound(
            f"--model {repo!r} is a Hugging Face repo id, and huggingface_hub is not "
            "installed (pip install huggingface_hub), or pass a checkpoint directory"
        ) from None
    # Random weights need no weight files.
    patterns = [p for p in DOWNLOAD_PATTERNS if load_format != "dummy" or p != "*.safetensors"]
    try:
        return snapshot_download(repo, allow_patterns=patterns)
    except Exception as e:  # offline, unknown or gated repo: each its own exception type
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ModelNotFound(
            f"cannot fetch {repo!r} from the Hugging Face Hub and it is not in the local "
            f"cache ({type(e).__name__}{': ' + first if first else ''}); download it where "
            "there is network access (huggingface-cli download), or pass a checkpoint "
            "directory"
        ) from None
