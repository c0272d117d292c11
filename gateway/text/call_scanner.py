"""An incremental reader of one tool-call object's text, ``{"name": ...,
"arguments": {...}}``, as it streams in: where the arguments value starts and
ends, the call's name once that string is whole, where the object ends, or
that the text is no JSON object (``gateway.text.tool_parsers`` streams calls
with it)."""

from __future__ import annotations

import json
import re
from typing import NamedTuple


class ToolCall(NamedTuple):
    """A whole call."""

    name: str
    arguments: str
    """The arguments as JSON text (an object)."""


WS = " \t\n\r"
_STRING_STOP = re.compile(r'["\\]')
_NESTED_STOP = re.compile(r'["{}\[\]]')
_SCALAR_STOP = re.compile(r"[,}\] \t\n\r]")

(
    _START,
    _FIRST_KEY,
    _NEXT_KEY,
    _KEY,
    _COLON,
    _VALUE,
    _STRING,
    _NESTED,
    _SCALAR,
    _AFTER,
    _DONE,
    _FAILED,
) = range(12)
_BETWEEN_TOKENS = (_START, _FIRST_KEY, _NEXT_KEY, _COLON, _VALUE, _AFTER)


class CallScanner:
    """Reads the text of one call object, ``{"name": ..., "arguments":
    {...}}``, as it arrives (leading whitespace skipped): where its arguments
    value starts and ends, its name once that string is whole, where the
    object ends, or that the text is no JSON object.

    The object's members are read token by token; a member's value is skipped
    by string/escape state and bracket depth, then checked with ``json`` once
    it ends, so a text the scanner reads to its closing brace is a valid JSON
    object. Of repeated members, the first counts. Text after the object is
    kept in ``text`` but not read."""

    def __init__(self, args_keys: tuple[str, ...]) -> None:
        self.args_keys = args_keys
        self.text = ""
        self.pos = 0
        """How far the text has been read: in a value, the text before ``pos``
        is part of it (an escape's backslash waits for its next character)."""
        self.name: str | None = None
        self.arguments: str | None = None
        """The canonical arguments text, once the arguments value ended."""
        self.args_start: int | None = None
        self.args_end: int | None = None
        self.streamable = False
        """The arguments are an object that began after the name was read."""
        self.end: int | None = None
        """Where the object ended (after its closing brace)."""
        self.failed = False
        """The text is not a JSON object (read up to ``pos``)."""
        self.bad = False
        """A JSON object, but no call: the name is not a non-empty string, or
        the arguments not an object."""
        self._state = _START
        self._key = ""
        self._start = 0
        self._depth = 0
        self._in_string = False
        self._seen_name = False

    @property
    def active(self) -> bool:
        """Still reading the object."""
        return self.end is None and not self.failed

    def feed(self, text: str) -> None:
        self.text += text
        if self.active:
            self._scan()

    def call(self) -> ToolCall | None:
        """The whole call (None: not one, or not ended)."""
        if self.end is None or self.bad or self.name is None:
            return None
        return ToolCall(self.name, "{}" if self.arguments is None else self.arguments)

    def _fail(self, pos: int) -> None:
        self.failed = True
        self._state = _FAILED
        self.pos = pos

    def _scan(self) -> None:
        t, n, i = self.text, len(self.text), self.pos
        while i < n:
            s = self._state
            if s in _BETWEEN_TOKENS:
                while i < n and t[i] in WS:
                    i += 1
                if i == n:
                    break
                ch = t[i]
                if s == _START:
                    if ch != "{":
                        return self._fail(i)
                    self._state = _FIRST_KEY
                    i += 1
                elif s in (_FIRST_KEY, _NEXT_KEY):
                    if ch == "}" and s == _FIRST_KEY:
                        self.end = self.pos = i + 1
                        self._state = _DONE
                        return None
                    if ch != '"':
                        return self._fail(i)
                    self._start = i
                    self._state = _KEY
                    i += 1
                elif s == _COLON:
                    if ch != ":":
                        return self._fail(i)
                    self._state = _VALUE
                    i += 1
                elif s == _VALUE:
                    self._start = i
                    if self._key in self.args_keys and self.args_start is None:
                        self.args_start = i
                        self.streamable = ch == "{" and self.name is not None
                    if ch == '"':
                        self._state = _STRING
                        i += 1
                    elif ch in "{[":
                        self._state = _NESTED
                        self._depth = 1
                        self._in_string = False
                        i += 1
                    else:
                        self._state = _SCALAR
                elif ch == ",":  # _AFTER
                    self._state = _NEXT_KEY
                    i += 1
                elif ch == "}":
                    self.end = self.pos = i + 1
                    self._state = _DONE
                    return None
                else:
                    return self._fail(i)
            elif s in (_KEY, _STRING) or (s == _NESTED and self._in_string):
                m = _STRING_STOP.search(t, i)
                if m is None:
                    i = n
                    break
                k = m.start()
                if t[k] == "\\":
                    if k + 1 >= n:
                        i = k
                        break
                    i = k + 2
                    continue
                i = k + 1
                if s == _NESTED:
                    self._in_string = False
                elif s == _KEY:
                    try:
                        self._key = json.loads(t[self._start : i])
                    except ValueError:
                        return self._fail(i)
                    self._state = _COLON
                elif not self._value_end(i):
                    return None
            elif s == _NESTED:
                m = _NESTED_STOP.search(t, i)
                if m is None:
                    i = n
                    break
                ch = t[m.start()]
                i = m.end()
                if ch == '"':
                    self._in_string = True
                elif ch in "{[":
                    self._depth += 1
                else:
                    self._depth -= 1
                    if not self._depth and not self._value_end(i):
                        return None
            else:  # _SCALAR: ends at the delimiter after it, which is not read
                m = _SCALAR_STOP.search(t, i)
                if m is None:
                    i = n
                    break
                i = m.start()
                if not self._value_end(i):
                    return None
        self.pos = i
        return None

    def _value_end(self, end: int) -> bool:
        """A member's value ended at ``end``: check it (False: the text failed)."""
        raw = self.text[self._start : end]
        is_args = self._start == self.args_start
        if is_args:
            self.args_end = end
        try:
            value = json.loads(raw)
        except ValueError:
            self._fail(end)
            return False
        if self._key == "name" and not self._seen_name:
            self._seen_name = True
            if isinstance(value, str) and value:
                self.name = value
            else:
                self.bad = True
        elif is_args:
            if isinstance(value, dict):
                self.arguments = raw
            elif isinstance(value, str) and is_object_text(value):
                self.arguments = value.strip()
            else:
                self.bad = True
        self._state = _AFTER
        return True


def is_object_text(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WS:
        i += 1
    return i
