"""Fault injection on the tcp KV data channel, for the fault matrix
(``python -m benchmarks.fault_matrix``, ``harness/fault_matrix.py``) only. Off unless ``DISAGG_KV_FAULT_FILE``
names a file; nothing here runs in a normal worker.

The file holds one command, re-read whenever it changes (so faults can be
turned on and off while the workers run):

* ``drop N``: the next N data messages this process writes are lost on the
  way (counted as sent, never delivered): the receiver never acknowledges
  them, as when a network drops a segment of a connection that then stalls.
* ``delay S``: every data message waits S seconds before it goes out.
* anything else (``off``, empty): no fault.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

FAULT_FILE_ENV = "DISAGG_KV_FAULT_FILE"
_RECHECK_S = 0.05


@dataclass(frozen=True)
class Fault:
    drop: bool = False
    delay_s: float = 0.0


NO_FAULT = Fault()


class FaultHook:
    """Reads the fault file (at most every ``_RECHECK_S``) and decides, per
    data message, whether it is dropped or held back."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self._checked = 0.0
        self._drops_left = 0
        self._delay_s = 0.0

    @classmethod
    def from_env(cls) -> FaultHook | None:
        path = os.environ.get(FAULT_FILE_ENV)
        return cls(path) if path else None

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._checked < _RECHECK_S:
            return
        self._checked = now
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp == self._stamp:
                return
            with open(self.path) as f:
                words = f.read().split()
        except OSError:
            stamp, words = None, []
        if stamp == self._stamp:
            return
        self._stamp = stamp
        self._drops_left, self._delay_s = 0, 0.0
        try:
            if len(words) == 2 and words[0] == "drop":
                self._drops_left = max(0, int(words[1]))
            elif len(words) == 2 and words[0] == "delay":
                self._delay_s = max(0.0, float(words[1]))
        except ValueError:
            pass

    def next_message(self) -> Fault:
        """The fault of the data message about to be sent."""
        self._refresh()
        if self._drops_left > 0:
            self._drops_left -= 1
            return Fault(drop=True)
        if self._delay_s > 0:
            return Fault(delay_s=self._delay_s)
        return NO_FAULT
