"""A labelled Prometheus histogram family in the text format, for the stage
timings of the gateway and of the workers. Torch-free.

A worker's engine process keeps the family and ships it to its front as a
plain dict (``snapshot`` / ``from_snapshot``), which renders it on /metrics.
"""

from __future__ import annotations

import bisect
from typing import Any

STAGE_BUCKETS: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
"""Seconds: from 100 us (a stage inside one process) to a minute (a queue)."""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class _Series:
    __slots__ = ("counts", "total", "n")

    def __init__(self, buckets: int) -> None:
        self.counts = [0] * (buckets + 1)
        self.total = 0.0
        self.n = 0


class HistogramFamily:
    """Histograms of one metric, one per combination of label values."""

    def __init__(
        self,
        name: str,
        help_: str,
        labels: tuple[str, ...],
        buckets: tuple[float, ...] = STAGE_BUCKETS,
    ) -> None:
        self.name, self.help, self.labels, self.buckets = name, help_, labels, buckets
        self._series: dict[tuple[str, ...], _Series] = {}

    def observe(self, values: tuple[str, ...], seconds: float) -> None:
        """One observation of the series with label ``values`` (in ``labels`` order)."""
        series = self._series.get(values)
        if series is None:
            series = self._series[values] = _Series(len(self.buckets))
        series.counts[bisect.bisect_left(self.buckets, seconds)] += 1
        series.total += seconds
        series.n += 1

    def count(self, values: tuple[str, ...]) -> int:
        series = self._series.get(values)
        return 0 if series is None else series.n

    def render(self, const_labels: dict[str, str] | None = None) -> list[str]:
        """The family in the text exposition format; ``const_labels`` go first
        on every series."""
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        fixed = [f'{k}="{_escape(v)}"' for k, v in (const_labels or {}).items()]
        for values, s in sorted(self._series.items()):
            labels = ",".join(
                [*fixed, *(f'{k}="{_escape(v)}"' for k, v in zip(self.labels, values))]
            )
            acc = 0
            for bound, c in zip(self.buckets, s.counts):
                acc += c
                out.append(f'{self.name}_bucket{{{labels},le="{bound}"}} {acc}')
            out.append(f'{self.name}_bucket{{{labels},le="+Inf"}} {s.n}')
            out.append(f"{self.name}_sum{{{labels}}} {s.total}")
            out.append(f"{self.name}_count{{{labels}}} {s.n}")
        return out

    def snapshot(self) -> dict[str, Any]:
        """The family as plain data (msgpack/JSON-able)."""
        return {
            "name": self.name,
            "help": self.help,
            "labels": list(self.labels),
            "buckets": list(self.buckets),
            "series": [[list(v), s.counts, s.total, s.n] for v, s in self._series.items()],
        }

    @classmethod
    def from_snapshot(cls, data: dict[str, Any]) -> HistogramFamily:
        fam = cls(data["name"], data["help"], tuple(data["labels"]), tuple(data["buckets"]))
        for values, counts, total, n in data["series"]:
            s = fam._series[tuple(values)] = _Series(len(fam.buckets))
            s.counts, s.total, s.n = list(counts), float(total), int(n)
        return fam
