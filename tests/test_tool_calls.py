"""Tool calls and structured-output fields in the gateway, without workers:
the parsers on fixed texts of each family's format (whole, and streamed cut
at every boundary and at random: the same content and calls, the arguments
streamed in pieces as they arrive, malformed calls kept as content), the
streamed and whole responses agreeing, the grammar a forced tool choice gets, the 400s of bad fields, and
the tiny model's tool template against transformers."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from unittest.mock import ANY

import jsonschema
import pytest

from gateway.openai.choices import ChoiceEvent
from gateway.openai.errors import APIError
from gateway.openai.responses import ResponseContext, full_response
from gateway.openai.shapes import ChatShape
from gateway.openai.sse import StreamWriter
from gateway.openai.structured import response_format_grammar, structured_outputs_grammar
from gateway.openai.tools import plan_tools, template_messages, tool_call_events
from gateway.text import Tokenizer
from gateway.text.tool_parsers import (
    ForcedToolParser,
    HermesToolParser,
    Llama3JsonToolParser,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    join_deltas,
    merge_deltas,
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
TRICKY_ARGS = (
    '{"q": "a \\"quoted\\" } ] { [ text \\\\ with </tool_call> and \\u00e9 inside",'
    ' "filters": {"tags": ["x", "y"], "n": [1, -2.5e3, {"deep": null}]}, "ok": true, "é": "ü"}'
)
LLAMA_TEXT = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}; '
    '{"name": "add", "parameters": {"a": 1, "b": 2}}'
)
FORCED_MANY = (
    '[\n  {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}},\n'
    '  {"name": "add", "arguments": {"a": 1, "b": 2}}\n]'
)

Case = tuple[type[ToolCallParser], str, str, list[ToolCall]]

CASES: dict[str, Case] = {
    # Each: the parser, a whole output, its content and its calls.
    "hermes": (HermesToolParser, QWEN_TEXT, "Let me look that up.", QWEN_CALLS),
    "hermes-tricky-arguments": (
        HermesToolParser,
        f'<tool_call>\n{{"name": "search", "arguments": {TRICKY_ARGS}}}\n</tool_call>\nDone.',
        "\nDone.",
        [ToolCall("search", TRICKY_ARGS)],
    ),
    "hermes-think": (
        HermesToolParser,
        '<think>\nhmm\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>',
        "<think>\nhmm\n</think>",
        [ToolCall("add", "{}")],
    ),
    # The model may end the output inside its last tag, or forget the brace
    # that closes the call (the call still counts).
    "hermes-open-at-end": (
        HermesToolParser,
        '<tool_call>\n{"name": "add", "arguments": {"a": 1}}',
        "",
        [ToolCall("add", '{"a": 1}')],
    ),
    "hermes-missing-brace": (
        HermesToolParser,
        'Sure. <tool_call>{"name": "add", "arguments": {"a": 1}</tool_call>',
        "Sure.",
        [ToolCall("add", '{"a": 1}')],
    ),
    "hermes-more-members": (
        HermesToolParser,
        '<tool_call>{"name": "add", "arguments": {"a": 1}, "id": [7, {"x": "}"}]}</tool_call>',
        "",
        [ToolCall("add", '{"a": 1}')],
    ),
    # Sent whole: arguments before the name, as a JSON string, or none.
    "hermes-arguments-first": (
        HermesToolParser,
        '<tool_call>{"arguments": {"a": 1}, "name": "add"}</tool_call>\n'
        '<tool_call>{"name": "add", "arguments": " {\\"b\\": 2} "}</tool_call>\n'
        '<tool_call>{"name": "now"}</tool_call>',
        "",
        [ToolCall("add", '{"a": 1}'), ToolCall("add", '{"b": 2}'), ToolCall("now", "{}")],
    ),
    "llama3": (Llama3JsonToolParser, LLAMA_TEXT, "", QWEN_CALLS),
    "llama3-plain": (
        Llama3JsonToolParser,
        ' {"name": "add", "parameters": {"a": 1, "b": 2}}\n',
        "",
        QWEN_CALLS[1:],
    ),
    "llama3-parameters-first": (
        Llama3JsonToolParser,
        '{"parameters": {"a": 1, "b": 2}, "name": "add"}; {"name": "add", "parameters": {}}',
        "",
        [QWEN_CALLS[1], ToolCall("add", "{}")],
    ),
    "forced-one": (
        ForcedToolParser,
        '{"name": "add", "arguments": {"a": 1, "b": 2}}',
        "",
        QWEN_CALLS[1:],
    ),
    "forced-many": (ForcedToolParser, FORCED_MANY, "", QWEN_CALLS),
    "forced-tricky-arguments": (
        ForcedToolParser,
        f'[{{"name": "search", "arguments": {TRICKY_ARGS}}}]',
        "",
        [ToolCall("search", TRICKY_ARGS)],
    ),
}

MALFORMED: dict[str, tuple[type[ToolCallParser], str]] = {
    # Outputs with no call in them: all of each is content.
    "hermes-no-tag": (HermesToolParser, "No tools needed: 2 < 3 and <tool_cal is no tag.\n"),
    "hermes-not-json": (HermesToolParser, "<tool_call>\n{not json}\n</tool_call> after"),
    "hermes-name-not-string": (
        HermesToolParser,
        '<tool_call>{"name": 5, "arguments": {}}</tool_call>',
    ),
    "hermes-no-name": (HermesToolParser, '<tool_call>{"arguments": {"a": 1}}</tool_call>'),
    "hermes-arguments-not-object": (
        HermesToolParser,
        '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',
    ),
    "hermes-bad-member": (
        HermesToolParser,
        '<tool_call>{"name": "add", "x": tru, "arguments": {}}</tool_call>',
    ),
    "hermes-junk-after-object": (
        HermesToolParser,
        '<tool_call>{"arguments": {}, "name": "add"} oops</tool_call>',
    ),
    "hermes-cut-before-arguments": (HermesToolParser, '<tool_call>{"name": "add", "argu'),
    "llama3-content": (Llama3JsonToolParser, "The answer is {42}."),
    "llama3-not-call": (Llama3JsonToolParser, '{"answer": 42}'),
    "llama3-tag-only": (Llama3JsonToolParser, "<|python_tag|>"),
    "llama3-second-broken": (
        Llama3JsonToolParser,
        '{"parameters": {}, "name": "add"} x {"name": "add", "parameters": {}}',
    ),
    "forced-cut": (ForcedToolParser, '{"name": "add", "argu'),
    "forced-empty-list": (ForcedToolParser, "[ ]"),
    "forced-string": (ForcedToolParser, '"add"'),
    "forced-not-call": (
        ForcedToolParser,
        '[{"name": "add", "arguments": 5}, {"name": "add", "arguments": {}}]',
    ),
}


def pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def chunkings(text: str, seed: int = 0) -> list[list[str]]:
    """The text cut in two at every boundary, one character at a time, and
    cut at random places."""
    out = [[text[:k], text[k:]] for k in range(len(text) + 1)]
    out.append(list(text))
    rng = random.Random(seed)
    for _ in range(40):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return out


def run(parser: ToolCallParser, chunks: list[str]) -> tuple[str, list[list[ToolCallDelta]]]:
    """The content and, per piece (then ``finish``), the deltas, merged as
    ``tool_call_events`` merges them."""
    content, per_piece = "", []
    for piece in chunks:
        c, d = parser.feed(piece)
        content += c
        per_piece.append(merge_deltas(d))
    c, d = parser.finish()
    per_piece.append(merge_deltas(d))
    return content + c, per_piece


def check_deltas(per_piece: list[list[ToolCallDelta]]) -> dict[int, list[ToolCallDelta]]:
    """The deltas by call, checked for OpenAI's streamed shape: calls begin
    in index order, one after the other; a call's first delta names it (id,
    type, name) and later ones carry only its index and more arguments; at
    most one delta per call in a chunk."""
    by_call: dict[int, list[ToolCallDelta]] = {}
    for deltas in per_piece:
        indices = [d.index for d in deltas]
        assert len(indices) == len(set(indices))
        for d in deltas:
            assert d.index == len(by_call) - 1 or (d.index == len(by_call) and d.name)
            by_call.setdefault(d.index, []).append(d)
            entry = d.to_openai()
            if d is by_call[d.index][0]:
                assert entry["id"].startswith("call_") and entry["type"] == "function"
                assert entry["function"]["name"] == d.name and d.name
            else:
                assert d.name is None and d.arguments
                assert entry == {"index": d.index, "function": {"arguments": d.arguments}}
    return by_call


@pytest.mark.parametrize("case", sorted(CASES))
def test_streamed_calls_at_every_cut(case: str) -> None:
    cls, text, content, calls = CASES[case]
    assert cls().parse(text) == (content, calls)
    for chunks in chunkings(text):
        got, per_piece = run(cls(), chunks)
        by_call = check_deltas(per_piece)
        streamed = [
            ToolCall(ds[0].name or "", "".join(d.arguments for d in ds))
            for _, ds in sorted(by_call.items())
        ]
        assert (got, streamed) == (content, calls), chunks
        for call in streamed:
            assert isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_calls_stay_content(case: str) -> None:
    cls, text = MALFORMED[case]
    if case == "llama3-second-broken":
        # The first call was sent whole: the rest of the output is content.
        expected: tuple[str, list[ToolCall]] = (
            ' x {"name": "add", "parameters": {}}',
            [ToolCall("add", "{}")],
        )
    else:
        expected = (text, [])
    assert cls().parse(text) == expected
    for chunks in chunkings(text):
        got, per_piece = run(cls(), chunks)
        check_deltas(per_piece)
        assert (got, join_deltas(d for ds in per_piece for d in ds)) == expected, chunks


def streamed_so_far(parser: ToolCallParser, text: str) -> tuple[str, dict[int, str]]:
    content, per_piece = run(parser, list(text))
    return content, {
        i: "".join(d.arguments for d in ds) for i, ds in check_deltas(per_piece).items()
    }


@pytest.mark.parametrize(
    ("cls", "text", "calls"),
    [
        (HermesToolParser, QWEN_TEXT, QWEN_CALLS),
        (
            HermesToolParser,
            f'<tool_call>{{"name": "search", "arguments": {TRICKY_ARGS}}}</tool_call>',
            [ToolCall("search", TRICKY_ARGS)],
        ),
        (Llama3JsonToolParser, LLAMA_TEXT, QWEN_CALLS),
        (ForcedToolParser, FORCED_MANY, QWEN_CALLS),
    ],
)
def test_arguments_stream_as_they_arrive(
    cls: type[ToolCallParser], text: str, calls: list[ToolCall]
) -> None:
    """At every prefix of the output, each call whose name was read has sent
    its arguments text as far as the prefix reaches into it (an escape's
    backslash waits for the next character), and never past its end."""
    starts = []
    pos = 0
    for call in calls:
        pos = text.index(call.arguments, pos)
        starts.append(pos)
        pos += len(call.arguments)
    for k in range(len(text) + 1):
        parser = cls()
        sent: dict[int, str] = {}
        for ch in text[:k]:
            _, deltas = parser.feed(ch)
            for d in deltas:
                sent[d.index] = sent.get(d.index, "") + d.arguments
        for i, (call, start) in enumerate(zip(calls, starts)):
            if k <= start:
                assert i not in sent, k
                continue
            visible = call.arguments[: k - start]
            got = sent[i]
            assert visible.startswith(got) and len(visible) - len(got) <= 1, (k, got)
            assert got == visible or visible.endswith("\\"), (k, got)


def test_cut_short_and_broken_after_streaming() -> None:
    """A call whose arguments began streaming stays a call: cut short by the
    end of the output, its arguments are what came; text after its arguments
    that is no call syntax is content."""
    cut = 'Hi <tool_call>\n{"name": "add", "arguments": {"a": 1, "b'
    assert HermesToolParser().parse(cut) == ("Hi", [ToolCall("add", '{"a": 1, "b')])
    # Its tag ends with its object: what follows other than the closing tag
    # is text outside the tags (the model left the tag out).
    junk = '<tool_call>{"name": "add", "arguments": {"a": 1}} oops</tool_call> end'
    assert HermesToolParser().parse(junk) == (
        " oops</tool_call> end",
        [ToolCall("add", '{"a": 1}')],
    )
    untagged = (
        '<tool_call>{"name": "add", "arguments": {"a": 1}}\n'
        '<tool_call>{"name": "add", "arguments": {"b": 2}</tool_call>'
    )
    assert HermesToolParser().parse(untagged) == (
        "",
        [ToolCall("add", '{"a": 1}'), ToolCall("add", '{"b": 2}')],
    )
    llama = '{"name": "add", "parameters": {"a": 1}} and more'
    assert Llama3JsonToolParser().parse(llama) == (" and more", [ToolCall("add", '{"a": 1}')])
    brace = '{"name": "add", "parameters": {"a": 1}; {"name": "add", "parameters": {"b": 2}}'
    assert Llama3JsonToolParser().parse(brace) == (
        "",
        [ToolCall("add", '{"a": 1}'), ToolCall("add", '{"b": 2}')],
    )
    forced = '[{"name": "add", "arguments": {"a": 1}}, {"name": "add", "arguments": {"b":'
    assert ForcedToolParser().parse(forced) == (
        "",
        [ToolCall("add", '{"a": 1}'), ToolCall("add", '{"b":')],
    )


def test_whole_calls_send_one_delta() -> None:
    """A call whose arguments come before its name goes out whole, in one
    delta, when its object ends."""
    text = '<tool_call>{"arguments": {"a": 1}, "name": "add"}\n</tool_call>'
    _, per_piece = run(HermesToolParser(), list(text))
    assert [d for ds in per_piece for d in ds] == [ToolCallDelta(0, "add", '{"a": 1}')]


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


def test_stream_and_whole_response_agree(model_dir: str) -> None:
    """A choice's events through the tool-call parser, written as SSE chunks
    and as a whole response: the chunks' deltas put together per index (as
    the SDKs do) are the whole response's calls, ids included."""
    tokenizer = Tokenizer.from_dir(model_dir)
    ctx = ResponseContext(ChatShape(tokenizer, None), "chatcmpl-x", "m", [[1]], [[1]], 1, False)
    text = QWEN_TEXT + "\nAll done."

    async def events() -> AsyncIterator[ChoiceEvent]:
        for k, piece in enumerate(pieces(text, 4)):
            yield ChoiceEvent(piece, [k], [0.0], None, 0)
        yield ChoiceEvent("", [99], [0.0], "stop", 0)

    async def collect() -> list[ChoiceEvent]:
        return [ev async for ev in tool_call_events(events(), HermesToolParser())]

    out = asyncio.run(collect())
    assert out[-1].finish_reason == "tool_calls"
    assert [t for ev in out for t in ev.token_ids] == [*range(len(pieces(text, 4))), 99]
    writer = StreamWriter(ctx, include_usage=False)
    chunks = [*writer.opening(), *(writer.event(0, ev) for ev in out)]
    content, calls, finish = "", {}, None
    for chunk in filter(None, chunks):
        assert chunk.startswith("data: ")
        choice = json.loads(chunk.removeprefix("data: "))["choices"][0]
        content += choice["delta"].get("content", "")
        finish = choice["finish_reason"] or finish
        for d in choice["delta"].get("tool_calls", ()):
            if d["index"] not in calls:
                assert set(d) == {"index", "id", "type", "function"}
                calls[d["index"]] = {**d, "function": dict(d["function"])}
            else:
                assert d == {"index": d["index"], "function": {"arguments": ANY}}
                calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    assert sum(len(ev.tool_calls or ()) for ev in out) > 2 * len(calls)  # streamed in pieces
    message = full_response(ctx, [out])["choices"][0]["message"]
    # Whitespace between the calls is held and goes out with the content after them.
    assert content == message["content"] == "Let me look that up.\n\n\nAll done."
    assert finish == "tool_calls"
    assert message["tool_calls"] == [
        {k: v for k, v in calls[i].items() if k != "index"} for i in sorted(calls)
    ]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        tuple(c) for c in QWEN_CALLS
    ]
    # The openai SDK's own stream helper puts the same calls together.
    streaming = pytest.importorskip("openai.lib.streaming.chat")
    chunk_type = pytest.importorskip("openai.types.chat").ChatCompletionChunk
    state = streaming.ChatCompletionStreamState()
    for chunk in filter(None, chunks):
        state.handle_chunk(chunk_type.model_validate_json(chunk.removeprefix("data: ")))
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert [
        {
            "id": c.id,
            "type": c.type,
            "function": c.function.model_dump(exclude={"parsed_arguments"}),
        }
        for c in final.message.tool_calls or ()
    ] == message["tool_calls"]
