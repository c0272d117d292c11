"""Stop strings: a text stream cut exactly before the first one."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def partial_suffix_len(text: str, patterns: Iterable[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``patterns``."""
    best = 0
    for pat in patterns:
        k = min(len(pat) - 1, len(text))
        while k > best:
            if text.endswith(pat[:k]):
                best = k
                break
            k -= 1
    return best


class StopStringMatcher:
    """Cut a text stream exactly before the first stop string.

    ``push(text)`` returns ``(safe_text, stopped)``: ``safe_text`` can be emitted now (it cannot
    be part of a stop string), and once a stop string has been seen, nothing after its start is
    ever returned. The stop that completes first in the stream wins (among stops completing at
    the same point, the one starting earliest). ``flush()`` releases the held-back tail at the
    end of the stream when no stop was hit.
    """

    def __init__(self, stops: Sequence[str] | None) -> None:
        if isinstance(stops, str):
            stops = [stops]
        stops = list(stops or ())
        for s in stops:
            if not isinstance(s, str):
                raise TypeError(f"stop strings must be str, got {type(s).__name__}")
            if not s:
                raise ValueError("stop strings must not be empty")
        self._stops = list(dict.fromkeys(stops))
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that was hit

    @property
    def stops(self) -> list[str]:
        return list(self._stops)

    def push(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self._stops:
            return text, False
        buf = self._held + text
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for s in self._stops:
            i = buf.find(s)
            if i >= 0:
                cand = (i + len(s), i, s)
                if best is None or cand[:2] < best[:2]:
                    best = cand
        if best is not None:
            self.stopped, self.matched, self._held = True, best[2], ""
            return buf[: best[1]], True
        k = partial_suffix_len(buf, self._stops)
        self._held = buf[len(buf) - k :] if k else ""
        return buf[: len(buf) - k], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held
