"""The stream detokenizer: token ids in, final text out, one delta at a time."""

from __future__ import annotations

from collections.abc import Iterable

from gateway.text.cleanup import StreamingCleanup
from gateway.text.tokenizer import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Token ids in, text out, one delta at a time.

    ``push(ids)`` returns the newly finalized text and ``flush()`` the rest at the end; their
    concatenation equals ``tokenizer.decode(all_ids, skip_special_tokens=...)`` exactly. Text is
    held back while it is not final: a trailing U+FFFD (a character split over tokens), an open
    run of byte-fallback tokens, a possible clean-up pattern.

    Each token is decoded in a small window: the ids from the start of the previously emitted
    span onwards, diffed against the decode of that span, so decoders that treat the first token
    specially (prefix spaces) or merge bytes across tokens come out as in a full decode, and the
    cost per token does not grow with the length of the output.
    """

    # When this many ids are pending (e.g. a long run of invalid bytes), look for a split point.
    _MAX_PENDING = 8

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._byte_ids = tokenizer.byte_fallback_ids
        # Skipped special tokens are dropped before the decoder runs, so they never enter the
        # window (a run of them can not grow it, and they do not end a byte-fallback run).
        self._hidden_ids = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._ids: list[int] = []  # window: ids from the prefix offset on
        self._read = 0  # ids[:read] is the already emitted span of the window
        self._prefix_text = ""  # decode(ids[:read])
        self._cleanup = StreamingCleanup() if tokenizer.cleans_up_spaces else None
        self._done = False

    @property
    def window_size(self) -> int:
        """Number of ids currently kept for decoding (bounded for ordinary text)."""
        return len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode_raw(ids, self._skip)

    def _advance(self, read: int, emitted_text: str) -> str:
        """The window's ids[:read] are final: emit, then restart the window at the old read
        offset (keeping one emitted span as left context)."""
        out = emitted_text[len(self._prefix_text) :]
        del self._ids[: self._read]
        self._read = read - self._read
        self._prefix_text = self._decode(self._ids[: self._read])
        return out

    def _step(self, token_id: int) -> str:
        if token_id in self._hidden_ids:
            return ""
        ids = self._ids
        if len(ids) == self._read and not self._prefix_text.endswith(_REPLACEMENT_CHAR):
            # Fast path: nothing pending and the emitted text ends on a character
            # boundary, so a token that stands alone appends its own text; the
            # window then holds just that token, as the general path leaves it.
            text = self._tok.standalone_text(token_id)
            if text is not None:
                self._ids = [token_id]
                self._read = 1
                self._prefix_text = text
                return text
        ids.append(token_id)
        if token_id in self._byte_ids:
            return ""  # an open byte-fallback run can still change (it is decoded as a group)
        text = self._decode(ids)
        prefix = self._prefix_text
        if (
            len(text) > len(prefix)
            and text.startswith(prefix)
            and not text.endswith(_REPLACEMENT_CHAR)
        ):
            return self._advance(len(ids), text)
        if len(ids) - self._read > self._MAX_PENDING:
            return self._split_pending(text)
        return ""

    def _split_pending(self, text: str) -> str:
        """Many ids pending (e.g. a run of invalid bytes, each ending the text in U+FFFD): emit
        up to a point m after which decoding restarts cleanly, checked as
        decode(ids[:m]) + decode(ids[m:]) == decode(ids)."""
        ids, prefix = self._ids, self._prefix_text
        for m in range(len(ids) - 1, max(self._read, len(ids) - 5), -1):
            if ids[m - 1] in self._byte_ids:
                continue
            head = self._decode(ids[:m])
            if len(head) <= len(prefix) or not head.startswith(prefix):
                continue
            if head + self._decode(ids[m:]) == text:
                return self._advance(m, head)
        return ""

    def _post(self, text: str) -> str:
        return text if self._cleanup is None else self._cleanup.push(text)

    def push(self, ids: Iterable[int]) -> str:
        """Add generated ids; returns the text that became final."""
        if self._done:
            raise RuntimeError("IncrementalDetokenizer.push after flush")
        if type(ids) is list and len(ids) == 1:
            text = self._step(int(ids[0]))  # the common delta: one token
        else:
            text = "".join([self._step(int(i)) for i in ids])
        return text if self._cleanup is None else self._cleanup.push(text)

    def flush(self) -> str:
        """End of the stream: the text still held back (may end in U+FFFD if the ids do)."""
        if self._done:
            return ""
        self._done = True
        text = self._decode(self._ids)
        out = text[len(self._prefix_text) :] if len(text) > len(self._prefix_text) else ""
        self._ids, self._read, self._prefix_text = [], 0, ""
        out = self._post(out)
        if self._cleanup is not None:
            out += self._cleanup.flush()
        return out
