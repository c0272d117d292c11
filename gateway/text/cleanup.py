"""transformers' ``clean_up_tokenization``, over a whole text or over a stream."""

from __future__ import annotations

from gateway.text.stop_strings import partial_suffix_len

# transformers' `clean_up_tokenization`: applied one after another to the whole decoded text.
CLEANUP_REPLACEMENTS: tuple[tuple[str, str], ...] = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


def clean_up(text: str) -> str:
    for old, new in CLEANUP_REPLACEMENTS:
        text = text.replace(old, new)
    return text


class StreamingReplace:
    """``str.replace(old, new)`` over a text stream: the concatenated output of ``push``es and
    ``flush`` equals ``full_text.replace(old, new)``."""

    __slots__ = ("_old", "_new", "_held")

    def __init__(self, old: str, new: str) -> None:
        self._old, self._new, self._held = old, new, ""

    def push(self, text: str) -> str:
        buf = self._held + text
        old, new = self._old, self._new
        pieces = []
        pos = 0
        while (j := buf.find(old, pos)) >= 0:  # left to right, non-overlapping, like str.replace
            pieces += (buf[pos:j], new)
            pos = j + len(old)
        # Hold back the tail that could still start a match once more text arrives.
        k = partial_suffix_len(buf[pos:], (old,))
        pieces.append(buf[pos : len(buf) - k])
        self._held = buf[len(buf) - k :]
        return "".join(pieces)

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


class StreamingCleanup:
    """``clean_up`` over a text stream: the concatenated output of ``push``es and ``flush``
    equals ``clean_up(full_text)``."""

    def __init__(self) -> None:
        self._stages = [StreamingReplace(old, new) for old, new in CLEANUP_REPLACEMENTS]

    def push(self, text: str) -> str:
        for stage in self._stages:
            text = stage.push(text)
        return text

    def flush(self) -> str:
        out = ""
        for i, stage in enumerate(self._stages):
            # What one stage held back still goes through every later stage.
            tail = stage.flush()
            for later in self._stages[i + 1 :]:
                tail = later.push(tail)
            out += tail
        return out
