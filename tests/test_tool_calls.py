"""Tool calls and structured-output fields in the gateway, without workers:
the parsers on fixed texts of each family's format (whole and streamed in
pieces), the grammar a forced tool choice gets, the 400s of bad fields, and
the tiny model's tool template against transformers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import jsonschema
import pytest

from gateway.openai.choices import ChoiceEvent
from gateway.openai.errors import APIError
from gateway.openai.structured import response_format_grammar, structured_outputs_grammar
from gateway.openai.tools import plan_tools, template_messages, tool_call_events
from gateway.text import Tokenizer
from gateway.text.tool_parsers import (
    ForcedToolParser,
    HermesToolParser,
    Llama3JsonToolParser,
    ToolCall,
    ToolCallParser,
    parser_for_template,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}

QWEN_TEXT = (
    "Let me look that up.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
)
QWEN_CALLS = [
    ToolCall("get_weather", '{"city": "Paris", "unit": "c"}'),
    ToolCall("add", '{"a": 1, "b": 2}'),
]
LLAMA_TEXT = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}; '
    '{"name": "add", "parameters": {"a": 1, "b": 2}}'
)


def pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def streamed(parser: ToolCallParser, text: str, size: int) -> tuple[str, list[ToolCall]]:
    content, calls = "", []
    for piece in pieces(text, size):
        c, k = parser.feed(piece)
        content += c
        calls += k
    c, k = parser.finish()
    return content + c, calls + k


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_hermes_calls_streamed_in_pieces(size: int) -> None:
    assert streamed(HermesToolParser(), QWEN_TEXT, size) == ("Let me look that up.", QWEN_CALLS)


def test_hermes_content_only_and_broken_calls() -> None:
    text = "No tools needed: 2 < 3 and <tool_cal is not a tag.\n"
    assert HermesToolParser().parse(text) == (text, [])
    broken = "<tool_call>\n{not json}\n</tool_call> after"
    assert HermesToolParser().parse(broken) == (broken, [])
    # The last tag left open at the end of the output still counts.
    assert HermesToolParser().parse('<tool_call>\n{"name": "add", "arguments": {"a": 1}}') == (
        "",
        [ToolCall("add", '{"a": 1}')],
    )
    # Qwen3's thinking stays content.
    think = '<think>\nhmm\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>'
    assert HermesToolParser().parse(think) == ("<think>\nhmm\n</think>", [ToolCall("add", "{}")])


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_llama3_json_calls(size: int) -> None:
    assert streamed(Llama3JsonToolParser(), LLAMA_TEXT, size) == ("", QWEN_CALLS)
    plain = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
    assert streamed(Llama3JsonToolParser(), plain, size) == ("", QWEN_CALLS[1:])
    text = "The answer is {42}."
    assert streamed(Llama3JsonToolParser(), text, size) == (text, [])
    not_call = '{"answer": 42}'
    assert streamed(Llama3JsonToolParser(), not_call, size) == (not_call, [])


def test_forced_output() -> None:
    one = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
    assert ForcedToolParser().parse(one) == ("", QWEN_CALLS[1:])
    many = '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, ' + one + "]"
    assert ForcedToolParser().parse(many) == ("", QWEN_CALLS)
    cut = '{"name": "add", "argu'  # max_tokens ran out
    assert ForcedToolParser().parse(cut) == (cut, [])


def test_format_from_template(model_dir: str) -> None:
    assert parser_for_template(Tokenizer.from_dir(model_dir).chat_template_text) == "hermes"
    llama = '... Respond in the format {"name": function name, "parameters": ...} <|python_tag|>'
    assert parser_for_template(llama) == "llama3_json"


def test_forced_grammars_fit_their_tools() -> None:
    named = plan_tools([WEATHER, ADD], {"type": "function", "function": {"name": "add"}}, None)
    assert named.mode == "forced" and named.constraint.param == "tools"
    schema = json.loads(named.constraint.grammar.spec)
    jsonschema.validate({"name": "add", "arguments": {"a": 1, "b": 2}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_weather", "arguments": {"a": 1, "b": 2}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "add", "arguments": {"a": "x", "b": 2}}, schema)
    single = json.loads(plan_tools([WEATHER, ADD], "required", False).constraint.grammar.spec)
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "x", "unit": "f"}}, single)
    parallel = json.loads(plan_tools([WEATHER, ADD], "required", True).constraint.grammar.spec)
    jsonschema.validate([{"name": "add", "arguments": {"a": 1, "b": 2}}], parallel)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], parallel)
    assert plan_tools([WEATHER], None, None).mode == "auto"
    assert plan_tools([WEATHER], "none", None).mode == "none"
    assert plan_tools(None, None, None).tools is None


@pytest.mark.parametrize(
    ("tools", "choice", "parallel", "param"),
    [
        (None, "required", None, "tool_choice"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, None, "tool_choice"),
        ([WEATHER], "sometimes", None, "tool_choice"),
        ([{"type": "function", "function": {"name": "has space"}}], None, None, "tools"),
        ([WEATHER, WEATHER], None, None, "tools"),
        ([{"type": "retrieval"}], None, None, "tools"),
        ([WEATHER], None, "yes", "parallel_tool_calls"),
    ],
)
def test_bad_tool_fields(tools: object, choice: object, parallel: object, param: str) -> None:
    with pytest.raises(APIError) as e:
        plan_tools(tools, choice, parallel)
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize(
    ("value", "param"),
    [
        ({"type": "yaml"}, "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        (
            {"type": "json_schema", "json_schema": {"schema": []}},
            "response_format.json_schema.schema",
        ),
        (
            {"type": "json_schema", "json_schema": {"schema": {}, "strict": 1}},
            "response_format.json_schema.strict",
        ),
        ("json", "response_format"),
    ],
)
def test_bad_response_format(value: object, param: str) -> None:
    with pytest.raises(APIError) as e:
        response_format_grammar(value)
    assert e.value.status == 400 and e.value.param == param


def test_structured_outputs_field() -> None:
    assert structured_outputs_grammar({"regex": "[a-z]+"}).kind == "regex"
    assert structured_outputs_grammar({"choice": ["a", "b"]}).spec == '["a", "b"]'
    assert structured_outputs_grammar({"json": '{"type": "object"}'}).kind == "json_schema"
    assert structured_outputs_grammar({"grammar": 'root ::= "x"'}).kind == "ebnf"
    for bad in ({}, {"regex": "a", "choice": ["a"]}, {"choice": []}, {"json": "{bad"}, {"xml": 1}):
        with pytest.raises(APIError) as e:
            structured_outputs_grammar(bad)
        assert e.value.param.startswith("structured_outputs")


def test_history_with_tool_calls_renders_as_transformers(model_dir: str) -> None:
    transformers = pytest.importorskip("transformers")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "c"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    ]
    ours = Tokenizer.from_dir(model_dir).apply_chat_template(
        template_messages(messages), tools=[WEATHER, ADD]
    )
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    theirs = hf.apply_chat_template(
        template_messages(messages),
        tools=[WEATHER, ADD],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert ours == theirs
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"' in ours
    assert "<tool_response>\n18C\n</tool_response>" in ours and '"name": "add"' in ours


def test_events_carry_tool_calls() -> None:
    async def events() -> AsyncIterator[ChoiceEvent]:
        for k, piece in enumerate(pieces(QWEN_TEXT, 9)):
            yield ChoiceEvent(piece, [k], [0.0], None, 0)
        yield ChoiceEvent("", [99], [0.0], "stop", 0)

    async def collect() -> list[ChoiceEvent]:
        return [ev async for ev in tool_call_events(events(), HermesToolParser())]

    out = asyncio.run(collect())
    assert "".join(ev.text for ev in out) == "Let me look that up."
    calls = [c for ev in out for c in ev.tool_calls or ()]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather"), (1, "add")]
    assert out[-1].finish_reason == "tool_calls"
    assert [t for ev in out for t in ev.token_ids] == [*range(len(out) - 1), 99]
