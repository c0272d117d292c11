"""``python -m engine``: its engine flags are EngineConfig's settings, and it runs."""

from __future__ import annotations

import dataclasses

import pytest

from engine import __main__ as engine_cli
from engine.config import EngineConfig


def test_every_engine_setting_is_a_flag_with_its_default() -> None:
    names = {f.name for f in engine_cli.ENGINE_FLAGS}
    assert names == {f.name for f in dataclasses.fields(EngineConfig) if f.metadata.get("flag")}
    page_size = next(f for f in engine_cli.ENGINE_FLAGS if f.name == "page_size")
    assert page_size.default == EngineConfig().page_size


def test_generates_on_the_tiny_model(capsys: pytest.CaptureFixture[str]) -> None:
    engine_cli.main(
        [
            "--device",
            "cpu",
            "--max-tokens",
            "3",
            "--num-pages",
            "64",
            "--prompt",
            "Hi",
            "--prompt",
            "Yo",
        ]
    )
    out = capsys.readouterr().out
    assert out.count("--- prompt:") == 2
    assert "(3 tokens, finish=length)" in out
    assert "generated 6 tokens" in out
