"""Tool calls in generated text, parsed as the text streams in.

Each parser takes the text of one choice piece by piece (``feed``) and
returns the text that is plain content, safe to send now, and the tool-call
deltas that the text makes; ``finish`` returns what is left at the end.
Formats:

- ``HermesToolParser``: Qwen2.5 / Qwen3 (and Hermes) tags,
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number,
  with content before and between them;
- ``Llama3JsonToolParser``: Llama 3.1-3.3 JSON calls, an output that is
  ``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``,
  several separated by ``;``), else plain content;
- ``ForcedToolParser``: the output of a grammar-forced call (``tool_choice``
  "required" or a named function): one ``{"name", "arguments"}`` object or a
  list of them.

Calls stream: once a call's ``"name"`` string has been read whole and its
arguments object begins, the call's first delta names it and every later one
carries the next piece of the arguments text, up to the end of that object
and never past it. A call whose arguments come before its name, or are given
as a JSON string, is sent whole once its object ends.

The arguments of a call are the model's own text of its arguments object
(for arguments given as a JSON string: the string's content, stripped; none
given: ``{}``), so the pieces of a streamed call put together are the same
text as the call parsed whole.

A call that does not parse stays content, so no generated text is lost: text
that is not call syntax is content, and an output that turns out not to be
calls before any call was sent is content as a whole. Once a call has been
sent it stays a call (cut short by the end of the output, its arguments are
what came). Whitespace-only content next to tool calls is dropped (held back
until content that is not whitespace follows).

An output cut by its length limit (``finish(cut=True)``) may end inside a
call that was not sent yet: that call is dropped, not turned into content
(its markup is no text for the user; the text before it is content as
usual), and so is the start of a tag or the syntax between calls.
"""

from __future__ import annotations

import secrets
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any, NamedTuple

from gateway.text.call_scanner import WS, CallScanner, skip_ws
from gateway.text.call_scanner import ToolCall as ToolCall  # part of this module's interface


class ToolCallDelta(NamedTuple):
    """A piece of a streamed call. A call's first delta names it; later ones
    only carry more of its arguments text."""

    index: int
    """The call's index among the choice's calls."""
    name: str | None
    """The call's name on its first delta, else None."""
    arguments: str
    """The next piece of the arguments text (maybe empty on the first delta)."""

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI streamed ``tool_calls`` entry: the first one with a fresh
        ``id``, ``type`` and name, later ones only ``index`` and arguments."""
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {
            "index": self.index,
            "id": "call_" + secrets.token_hex(12),
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def merge_deltas(deltas: Iterable[ToolCallDelta]) -> list[ToolCallDelta]:
    """``deltas`` with each run of deltas of one call made one delta."""
    out: list[ToolCallDelta] = []
    for d in deltas:
        if out and out[-1].index == d.index:
            last = out[-1]
            out[-1] = last._replace(arguments=last.arguments + d.arguments)
        else:
            out.append(d)
    return out


def join_deltas(deltas: Iterable[ToolCallDelta]) -> list[ToolCall]:
    """The whole calls that ``deltas`` make, in index order."""
    names: dict[int, str] = {}
    args: dict[int, list[str]] = {}
    for d in deltas:
        if d.name is not None:
            names[d.index] = d.name
        args.setdefault(d.index, []).append(d.arguments)
    return [ToolCall(names[i], "".join(args[i])) for i in sorted(args)]


class _CallReader:
    """One call being read, and how much of it has been sent."""

    def __init__(self, args_keys: tuple[str, ...]) -> None:
        self.scan = CallScanner(args_keys)
        self.index: int | None = None
        """The call's index once its first delta was sent (None: not yet)."""
        self.sent = 0
        """Where the arguments text not sent yet begins."""


def _leftover(scan: CallScanner, stop: int) -> str:
    """The text of a streamed call, from the end of its arguments to
    ``stop``, that is not part of the call: none when the object closes
    properly, misses only its closing brace, or is cut short in its
    arguments; else all of it (kept as content)."""
    if scan.args_end is None:
        return ""
    if scan.end is not None:
        rest = scan.text[scan.end : stop]
    else:
        rest = scan.text[scan.args_end : stop]
        if rest.strip() == "}":
            return ""
    return rest if rest.strip() else ""


class ToolCallParser(ABC):
    ARGS_KEYS: tuple[str, ...] = ("arguments", "parameters")
    """The members that may hold a call's arguments (the first found counts)."""

    def __init__(self) -> None:
        self.num_calls = 0
        """Calls begun (their first delta sent)."""
        self._ws = ""
        """Trailing whitespace of the content, held back."""

    @abstractmethod
    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Content that can be sent now, and the call deltas that ``text`` makes."""

    @abstractmethod
    def finish(self, cut: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """What is left at the end of the output; ``cut``: the output was cut
        by its length limit (a call it ends in is dropped, not content)."""

    def parse(self, text: str, cut: bool = False) -> tuple[str, list[ToolCall]]:
        """A whole output at once (``cut``: as ``finish``)."""
        content, deltas = self.feed(text)
        rest, more = self.finish(cut)
        return content + rest, join_deltas(deltas + more)

    def _content(self, text: str, final: bool = False) -> str:
        text = self._ws + text
        kept = text.rstrip()
        self._ws = text[len(kept) :]
        if final:
            if not self.num_calls:
                kept += self._ws
            self._ws = ""
        return kept

    def _begin(self) -> int:
        self.num_calls += 1
        return self.num_calls - 1

    def _stream(self, call: _CallReader, out: list[ToolCallDelta]) -> None:
        """The deltas of what ``call`` read since the last time, if it streams."""
        scan = call.scan
        name = None
        if call.index is None:
            if not scan.streamable:
                return
            assert scan.args_start is not None
            call.index, call.sent, name = self._begin(), scan.args_start, scan.name
        stop = scan.args_end if scan.args_end is not None else scan.pos
        piece = scan.text[call.sent : stop]
        call.sent = max(call.sent, stop)
        if name is not None or piece:
            out.append(ToolCallDelta(call.index, name, piece))

    def _send_whole(self, call: ToolCall, out: list[ToolCallDelta]) -> None:
        out.append(ToolCallDelta(self._begin(), call.name, call.arguments))


class HermesToolParser(ToolCallParser):
    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        """Text outside the tags not sent yet (what may begin a tag)."""
        self._call: _CallReader | None = None
        """The call inside the open tag."""
        self._search = 0
        """Where in the call's text the search for the closing tag resumes."""

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._buf += text
        content: list[str] = []
        out: list[ToolCallDelta] = []
        while True:
            if self._call is None:
                i = self._buf.find(self.OPEN)
                if i < 0:
                    # Hold back what may be the start of a tag.
                    cut = len(self._buf) - _prefix_overlap(self._buf, self.OPEN)
                    content.append(self._buf[:cut])
                    self._buf = self._buf[cut:]
                    break
                content.append(self._buf[:i])
                self._buf = self._buf[i + len(self.OPEN) :]
                self._call = _CallReader(self.ARGS_KEYS)
                self._search = 0
            call = self._call
            call.scan.feed(self._buf)
            self._buf = ""
            self._stream(call, out)
            end = self._tag_end(call)
            if end is None:
                break
            stop, resume = end
            content.append(self._end_call(call, stop, out))
            self._buf = call.scan.text[resume:]
            self._call = None
        return self._content("".join(content)), out

    def _tag_end(self, call: _CallReader) -> tuple[int, int] | None:
        """Where the call's text ends, and where the text after its tag
        resumes (None: not known yet).

        Invariant: while the scanner reads the object, the closing tag is
        text of it (inside a JSON string; outside one it ends the reading as
        a failure), so a call's arguments may quote the tag. A streamed call
        ends with its object (or where its reading failed, when only the
        closing brace is missing): what follows is its closing tag, or, when
        the model left the tag out, text outside the tags (content or the
        next call). A call not streamed runs to the next closing tag, as a
        whole that is one call or content."""
        scan = call.scan
        if scan.active:
            return None
        start = max(self._search, scan.end if scan.end is not None else scan.pos)
        text = scan.text
        if call.index is not None:
            if scan.end is None:
                start = skip_ws(text, start)
                if text.startswith("}", start):  # after arguments that failed their check
                    start += 1
            i = skip_ws(text, start)
            if text.startswith(self.CLOSE, i):
                return i, i + len(self.CLOSE)
            if self.CLOSE.startswith(text[i:]):
                self._search = start
                return None
            return start, start
        j = text.find(self.CLOSE, start)
        if j < 0:
            self._search = max(start, len(text) - len(self.CLOSE) + 1)
            return None
        return j, j + len(self.CLOSE)

    def _end_call(
        self, call: _CallReader, stop: int, out: list[ToolCallDelta], close: str = CLOSE
    ) -> str:
        """The call's tag ends at ``stop`` in its text (``close``: the text
        that ends it): its deltas if it was not streamed, and the content it
        leaves."""
        scan = call.scan
        if call.index is not None:
            return _leftover(scan, stop)
        whole = scan.call()
        if whole is not None and not scan.text[scan.end : stop].strip():
            self._send_whole(whole, out)
            return ""
        return self.OPEN + scan.text[:stop] + close

    def finish(self, cut: bool = False) -> tuple[str, list[ToolCallDelta]]:
        out: list[ToolCallDelta] = []
        rest, self._buf = self._buf, ""
        if cut:
            rest = ""  # what may begin a tag, cut short
        call, self._call = self._call, None
        if call is not None:
            # The model may end the output inside its last tag.
            rest = self._end_call(call, len(call.scan.text), out, close="")
            if call.index is not None and self.CLOSE.startswith(rest.strip()):
                rest = ""  # the start of the closing tag, cut short
            elif cut and call.index is None and not out:
                rest = ""  # a call cut short before it could be sent
        return self._content(rest, final=True), out


_CALL, _MORE, _BAD = range(3)
"""What follows in a list of calls: a call object, nothing yet, no call syntax."""


class _CallListParser(ToolCallParser):
    """An output that is only calls, one after another, in some syntax
    around them (``_read``). Invariant: until a call is sent, the whole
    output is kept, and it all becomes content when it turns out not to be
    calls; once one is sent, only the text from where the calls end is."""

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        """Text not read yet."""
        self._whole = ""
        """The whole output, while no call has been sent."""
        self._gap = ""
        """The syntax read since the last call (or the output's start)."""
        self._call: _CallReader | None = None
        self._plain = False
        """The rest of the output is content."""

    @abstractmethod
    def _read(self, text: str) -> tuple[int, int]:
        """Reads the syntax at the start of ``text`` up to the next call:
        how many characters, and what follows them (``_CALL``: a call object
        begins; ``_MORE``: the rest of the text waits for more; ``_BAD``: not
        call syntax)."""

    def _after_call(self) -> None:
        """A call object ended."""

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        if self._plain:
            return self._content(text), []
        if not self.num_calls:
            self._whole += text
        self._buf += text
        content: list[str] = []
        out: list[ToolCallDelta] = []
        while not self._plain:
            call = self._call
            if call is None:
                n, what = self._read(self._buf)
                self._gap += self._buf[:n]
                self._buf = self._buf[n:]
                if what == _MORE:
                    break
                if what == _BAD:
                    content.append(self._give_up(self._gap + self._buf))
                    break
                call = self._call = _CallReader(self.ARGS_KEYS)
            scan = call.scan
            scan.feed(self._buf)
            self._buf = ""
            self._stream(call, out)
            if scan.active:
                break
            if call.index is None:
                whole = scan.call()
                if whole is None:
                    content.append(self._give_up(self._gap + scan.text))
                    break
                self._send_whole(whole, out)
            elif scan.end is None:  # the object broke after its arguments were sent
                assert scan.args_end is not None
                if scan.text[scan.args_end : scan.pos].strip():
                    content.append(self._give_up(scan.text[scan.args_end :]))
                    break
                # Only the closing brace is missing: the calls go on from there.
            self._buf = scan.text[scan.pos :]
            self._gap = ""
            self._call = None
            self._after_call()
        if self.num_calls:
            self._whole = ""
        return self._content("".join(content)), out

    def _give_up(self, rest: str) -> str:
        """The content that the output is from here on: all of it when no
        call was sent, else ``rest``."""
        self._plain = True
        self._buf = ""
        return rest if self.num_calls else self._whole

    def finish(self, cut: bool = False) -> tuple[str, list[ToolCallDelta]]:
        rest = ""
        if not self._plain:
            call = self._call
            if call is not None and call.index is not None:
                rest = _leftover(call.scan, len(call.scan.text))
            elif cut:
                # Cut short while still calls: the call it ends in (and the
                # syntax before it) is dropped.
                rest = ""
            elif not self.num_calls:
                rest = self._whole
            elif call is None:
                rest = self._buf
            else:
                rest = self._gap + call.scan.text
        self._buf = self._whole = self._gap = ""
        self._call = None
        self._plain = True
        return self._content(rest, final=True), []


class Llama3JsonToolParser(_CallListParser):
    PYTHON_TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self._open = False
        """The output begins as calls (a ``{`` or the python tag)."""

    def _read(self, text: str) -> tuple[int, int]:
        i = 0
        if not self._open:
            i = len(text) - len(text.lstrip())
            head = text[i:]
            if head.startswith(self.PYTHON_TAG):
                i += len(self.PYTHON_TAG)
            elif not head or self.PYTHON_TAG.startswith(head):
                return i, _MORE
            elif head[0] != "{":
                return i, _BAD
            self._open = True
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
        if i == len(text):
            return i, _MORE
        return i, (_CALL if text[i] == "{" else _BAD)


class ForcedToolParser(_CallListParser):
    ARGS_KEYS = ("arguments",)

    def __init__(self) -> None:
        super().__init__()
        self._state = "start"
        """What comes next: "start" (``[`` or a call), "first" (a call or
        ``]``), "call", "next" (``,`` or ``]``) or "end" (nothing)."""
        self._list = False

    def _read(self, text: str) -> tuple[int, int]:
        i = 0
        while True:
            while i < len(text) and text[i] in WS:
                i += 1
            if i == len(text):
                return i, _MORE
            ch, state = text[i], self._state
            if state == "start" and ch == "[":
                self._list = True
                self._state = "first"
            elif state in ("start", "first", "call") and ch == "{":
                return i, _CALL
            elif (state == "first" and ch == "]") or (state == "next" and ch == "]"):
                self._state = "end"
            elif state == "next" and ch == ",":
                self._state = "call"
            else:
                return i, _BAD
            i += 1

    def _after_call(self) -> None:
        self._state = "next" if self._list else "end"


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
