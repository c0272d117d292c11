"""Failures the gateway reports for what they are. A tool call cut by the
length limit leaves no markup in the content: the text before it is content,
the unfinished call is dropped, and the choice ends with "length"."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from gateway.openai.choices import ChoiceEvent
from gateway.openai.tools import tool_call_events
from gateway.text.tool_parsers import (
    ForcedToolParser,
    HermesToolParser,
    Llama3JsonToolParser,
    ToolCall,
    ToolCallParser,
)

# -- a tool call cut by the length limit ----------------------------------------------


CUT_CASES: dict[str, tuple[type[ToolCallParser], str, str, list[ToolCall]]] = {
    # Each: the parser, an output cut by max_tokens, its content and its calls.
    "forced-list": (
        ForcedToolParser,
        '[{"name": "add", "arguments": {"a": 1}}, {"name": "get_time", "arguments',
        "",
        [ToolCall("add", '{"a": 1}')],
    ),
    "forced-name": (ForcedToolParser, '{"name": "get_ti', "", []),
    "hermes": (
        HermesToolParser,
        'Let me check.\n<tool_call>\n{"name": "get_time", "argu',
        "Let me check.\n",
        [],
    ),
    "hermes-tag": (HermesToolParser, "Let me check. <tool_c", "Let me check. ", []),
    "hermes-after-call": (
        HermesToolParser,
        '<tool_call>{"name": "add", "arguments": {}}</tool_call>\n<tool_call>{"arguments": {',
        "",
        [ToolCall("add", "{}")],
    ),
    "llama3": (Llama3JsonToolParser, '<|python_tag|>{"name": "get_time", "param', "", []),
    "llama3-second": (
        Llama3JsonToolParser,
        '{"name": "add", "parameters": {}}; {"parameters": {"a"',
        "",
        [ToolCall("add", "{}")],
    ),
}


@pytest.mark.parametrize("case", sorted(CUT_CASES))
def test_tool_call_cut_by_length_leaves_no_markup(case: str) -> None:
    cls, text, content, calls = CUT_CASES[case]
    assert cls().parse(text, cut=True) == (content, calls)
    # Streamed in pieces of every size: the same.
    for size in range(1, len(text) + 1):
        parser = cls()
        got = ""
        for i in range(0, len(text), size):
            got += parser.feed(text[i : i + size])[0]
        got += parser.finish(cut=True)[0]
        assert got == content, size
    # Not cut (the model stopped there): the text is kept, as before.
    assert cls().parse(text)[0] != content


def test_cut_tool_call_in_the_choice_events() -> None:
    """Through ``tool_call_events``, streamed as a response writes it: the
    text before the cut call is content, the call is gone, and the choice
    ends with "length"."""
    text = 'Sure.\n<tool_call>\n{"name": "get_time", "arguments'

    async def events() -> AsyncIterator[ChoiceEvent]:
        pieces = [text[i : i + 5] for i in range(0, len(text), 5)]
        for k, piece in enumerate(pieces):
            last = k == len(pieces) - 1
            yield ChoiceEvent(piece, [k], [0.0], "length" if last else None, 0)

    async def collect() -> list[ChoiceEvent]:
        return [ev async for ev in tool_call_events(events(), HermesToolParser())]

    out = asyncio.run(collect())
    assert "".join(ev.text for ev in out) == "Sure.\n"
    assert all(ev.tool_calls is None for ev in out)
    assert out[-1].finish_reason == "length"
