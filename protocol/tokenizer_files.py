"""The files a worker serves at ``GET /tokenizer`` so that a gateway on another
host can tokenize without the checkpoint: ``{"files": {name: base64}}``."""

from __future__ import annotations

import base64
from pathlib import Path

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "config.json",
    "chat_template.jinja",
)


def pack(model_dir: str | Path) -> dict[str, dict[str, str]]:
    d = Path(model_dir)
    return {
        "files": {
            name: base64.b64encode((d / name).read_bytes()).decode()
            for name in TOKENIZER_FILES
            if (d / name).is_file()
        }
    }


def unpack(body: dict[str, dict[str, str]]) -> dict[str, bytes]:
    return {
        name: base64.b64decode(data)
        for name, data in body["files"].items()
        if name in TOKENIZER_FILES
    }
