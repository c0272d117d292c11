"""Tool calls in generated text, parsed as the text streams in.

Each parser takes the text of one choice piece by piece (``feed``) and
returns the text that is plain content, safe to send now, and the tool calls
completed so far; ``finish`` returns what is left at the end. Formats:

- ``HermesToolParser``: Qwen2.5 / Qwen3 (and Hermes) tags,
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number,
  with content before and between them;
- ``Llama3JsonToolParser``: Llama 3.1-3.3 JSON calls, an output that is
  ``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``,
  several separated by ``;``), else plain content;
- ``ForcedToolParser``: the output of a grammar-forced call (``tool_choice``
  "required" or a named function): one ``{"name", "arguments"}`` object or a
  list of them.

A call that does not parse stays content, so no generated text is lost.
Whitespace-only content next to tool calls is dropped (held back until
content that is not whitespace follows).
"""

from __future__ import annotations

import json
import secrets
from abc import ABC, abstractmethod
from typing import Any, NamedTuple


class ToolCall(NamedTuple):
    name: str
    arguments: str
    """The arguments as JSON text (an object)."""

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        """The OpenAI ``tool_calls`` entry, with a fresh id; ``index`` for a
        streamed delta."""
        call: dict[str, Any] = {
            "id": "call_" + secrets.token_hex(12),
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


def call_from_json(
    obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")
) -> ToolCall | None:
    """The call that a decoded JSON value names (None: it is not one)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolCallParser(ABC):
    def __init__(self) -> None:
        self.num_calls = 0
        self._ws = ""
        """Trailing whitespace of the content, held back."""

    @abstractmethod
    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Content that can be sent now, and the calls completed by ``text``."""

    @abstractmethod
    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left at the end of the output."""

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """A whole output at once."""
        content, calls = self.feed(text)
        rest, more = self.finish()
        return content + rest, calls + more

    def _content(self, text: str, calls: list[ToolCall], final: bool = False) -> str:
        self.num_calls += len(calls)
        text = self._ws + text
        kept = text.rstrip()
        self._ws = text[len(kept) :]
        if calls and not kept.strip():
            kept = ""
        if final:
            if not self.num_calls:
                kept += self._ws
            self._ws = ""
        return kept


class HermesToolParser(ToolCallParser):
    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._inside = False

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if not self._inside:
                i = self._buf.find(self.OPEN)
                if i < 0:
                    # Hold back what may be the start of a tag.
                    cut = len(self._buf) - _prefix_overlap(self._buf, self.OPEN)
                    content.append(self._buf[:cut])
                    self._buf = self._buf[cut:]
                    break
                content.append(self._buf[:i])
                self._buf = self._buf[i + len(self.OPEN) :]
                self._inside = True
            else:
                j = self._buf.find(self.CLOSE)
                if j < 0:
                    break
                body, self._buf = self._buf[:j], self._buf[j + len(self.CLOSE) :]
                self._inside = False
                call = _json_call(body)
                if call is None:
                    content.append(self.OPEN + body + self.CLOSE)
                else:
                    calls.append(call)
        return self._content("".join(content), calls), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self._buf = self._buf, ""
        if self._inside:
            self._inside = False
            # The model may end the output inside its last tag.
            call = _json_call(rest)
            if call is not None:
                return self._content("", [call], final=True), [call]
            rest = self.OPEN + rest
        return self._content(rest, [], final=True), []


class Llama3JsonToolParser(ToolCallParser):
    PYTHON_TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._calls: bool | None = None
        """Whether the output is tool calls (None: not known yet)."""

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        if self._calls is None:
            head = self._buf.lstrip()
            if not head or (self.PYTHON_TAG.startswith(head) and head != self.PYTHON_TAG):
                return "", []
            self._calls = head.startswith(("{", self.PYTHON_TAG))
        if self._calls:
            return "", []
        out, self._buf = self._buf, ""
        return self._content(out, []), []

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self._buf = self._buf, ""
        if self._calls:
            calls = _llama_calls(rest)
            if calls:
                return self._content("", calls, final=True), calls
        return self._content(rest, [], final=True), []


class ForcedToolParser(ToolCallParser):
    def __init__(self) -> None:
        super().__init__()
        self._buf = ""

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        return "", []

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self._buf = self._buf, ""
        try:
            value = json.loads(rest)
        except ValueError:
            value = None  # cut short (max_tokens): the text stays content
        items = value if isinstance(value, list) else [value]
        calls = [call_from_json(v, ("arguments",)) for v in items]
        if value is None or not calls or any(c is None for c in calls):
            return self._content(rest, [], final=True), []
        done = [c for c in calls if c is not None]
        return self._content("", done, final=True), done


def _json_call(body: str) -> ToolCall | None:
    try:
        return call_from_json(json.loads(body))
    except ValueError:
        return None


def _llama_calls(text: str) -> list[ToolCall] | None:
    """``{...}; {...}`` after an optional python tag, each a call (None: not so)."""
    text = text.strip().removeprefix(Llama3JsonToolParser.PYTHON_TAG).strip()
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    pos = 0
    while pos < len(text):
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        call = call_from_json(obj)
        if call is None:
            return None
        calls.append(call)
        while pos < len(text) and text[pos] in " \t\r\n;":
            pos += 1
    return calls or None


def _prefix_overlap(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}
"""Parsers of the tool-call formats models write on their own ("auto")."""


def parser_for_template(template: str) -> str:
    """The format of the model whose chat template is ``template``: Qwen's
    tags when it names them, Llama 3's JSON when it asks for "parameters" or
    knows the python tag, else the tags."""
    if HermesToolParser.OPEN in template:
        return "hermes"
    if Llama3JsonToolParser.PYTHON_TAG in template or '"parameters"' in template:
        return "llama3_json"
    return "hermes"
