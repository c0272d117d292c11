"""Tool calling on the chat endpoint: the request's ``tools``, ``tool_choice``
and ``parallel_tool_calls`` checked and turned into what the rest of the
gateway needs (the tools the chat template renders, the grammar that forces a
call, the parser that finds calls in the text), the conversation's earlier
calls made ready for the template, and a choice's events with their tool
calls taken out of the text."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

from gateway.openai.choices import ChoiceEvent
from gateway.openai.errors import APIError
from gateway.openai.structured import Constraint
from gateway.text.tool_parsers import PARSERS, ForcedToolParser, ToolCallParser, merge_deltas
from protocol.finish import FinishReason
from protocol.sampling import GrammarSpec

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
MAX_TOOLS = 128


class ToolPlan(NamedTuple):
    """What a request's tool fields ask for."""

    tools: list[dict[str, Any]] | None = None
    """The tools as the chat template gets them (None: no tools)."""
    mode: str = "none"
    """"none" (plain text), "auto" (calls parsed from the text) or "forced"."""
    constraint: Constraint = Constraint()
    """The grammar of a forced call."""

    def parser(self, auto_format: str) -> ToolCallParser | None:
        """A fresh parser for one choice (None: the text is all content);
        ``auto_format``: the model's own format (``PARSERS``)."""
        if self.mode == "forced":
            return ForcedToolParser()
        if self.mode == "auto":
            return PARSERS[auto_format]()
        return None


def plan_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolPlan:
    """Check the tool fields (``APIError`` 400 naming the field at fault)."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise APIError(400, "parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    if tools is None:
        if tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return ToolPlan()
    functions = _check_tools(tools)
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan(tools, "none")
    if choice == "auto":
        return ToolPlan(tools, "auto")
    if choice == "required":
        schemas = [_call_schema(f) for f in functions.values()]
        one = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        schema = (
            {"type": "array", "items": one, "minItems": 1}
            if parallel_tool_calls is not False
            else one
        )
        return ToolPlan(tools, "forced", _forced(schema))
    name = _named_choice(choice)
    if name not in functions:
        raise APIError(
            400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice"
        )
    return ToolPlan(tools, "forced", _forced(_call_schema(functions[name])))


def _forced(schema: dict[str, Any]) -> Constraint:
    return Constraint(GrammarSpec("json_schema", json.dumps(schema, ensure_ascii=False)), "tools")


def _named_choice(choice: Any) -> str:
    fn = choice.get("function") if isinstance(choice, dict) else None
    if (
        not isinstance(choice, dict)
        or choice.get("type") != "function"
        or not isinstance(fn, dict)
        or not isinstance(fn.get("name"), str)
    ):
        raise APIError(
            400,
            "tool_choice must be 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    return fn["name"]


def _check_tools(tools: Any) -> dict[str, dict[str, Any]]:
    """The tools' functions by name."""
    if not isinstance(tools, list) or not tools:
        raise APIError(400, "tools must be a non-empty list", param="tools")
    if len(tools) > MAX_TOOLS:
        raise APIError(400, f"at most {MAX_TOOLS} tools", param="tools")
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise APIError(
                400, f'{where} must be {{"type": "function", "function": {{...}}}}', param="tools"
            )
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise APIError(
                400, f"{where}.function.name must be 1-64 letters, digits, _ . or -", param="tools"
            )
        if name in functions:
            raise APIError(400, f"two tools are named {name!r}", param="tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise APIError(400, f"{where}.function.parameters must be a JSON schema", param="tools")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise APIError(400, f"{where}.function.description must be a string", param="tools")
        functions[name] = fn
    return functions


def _call_schema(fn: dict[str, Any]) -> dict[str, Any]:
    """One call of ``fn``: its name, then arguments that fit its parameters."""
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"enum": [fn["name"]]}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as chat templates expect it: the arguments of earlier
    tool calls as objects (OpenAI sends them as JSON text; templates such as
    Qwen's and Llama's write them with ``tojson``)."""
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if calls is None:
            out.append(m)
            continue
        if not isinstance(calls, list):
            raise APIError(400, f"messages[{i}].tool_calls must be a list", param="messages")
        fixed = []
        for call in calls:
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise APIError(
                    400,
                    f"messages[{i}].tool_calls entries need function.name and function.arguments",
                    param="messages",
                )
            args = fn.get("arguments")
            if isinstance(args, str):
                with contextlib.suppress(ValueError):
                    args = json.loads(args)
            fixed.append({**call, "function": {**fn, "arguments": args}})
        out.append({**m, "tool_calls": fixed})
    return out


async def tool_call_events(
    events: AsyncIterator[ChoiceEvent], parser: ToolCallParser
) -> AsyncIterator[ChoiceEvent]:
    """``events`` with the tool calls taken out of their text: each event
    carries the content that is safe to send and, in ``tool_calls``, the
    deltas of the calls that its text makes (OpenAI's streamed form: a call's
    first delta has its ``index``, ``id``, ``type`` and name, later ones only
    its ``index`` and the next piece of its arguments). A choice that made
    calls and stopped ends with "tool_calls"; one cut by its length limit
    inside a call not sent yet drops that call (``ToolCallParser.finish``)
    and ends with "length"."""
    async with contextlib.aclosing(events):  # type: ignore[type-var]
        async for ev in events:
            text, deltas = parser.feed(ev.text)
            finish = ev.finish_reason
            if finish is not None:
                rest, more = parser.finish(cut=finish == FinishReason.LENGTH)
                text, deltas = text + rest, deltas + more
            if finish == FinishReason.STOP and parser.num_calls:
                finish = "tool_calls"
            calls = [d.to_openai() for d in merge_deltas(deltas)]
            yield ev._replace(text=text, finish_reason=finish, tool_calls=calls or None)


def whole_tool_calls(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The calls that a choice's streamed ``tool_calls`` deltas make, each
    whole (its first delta with the arguments of all its deltas put
    together), in index order."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        call = calls.get(d["index"])
        if call is None:
            calls[d["index"]] = {**d, "function": dict(d["function"])}
        else:
            call["function"]["arguments"] += d["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]
