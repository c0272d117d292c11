"""Per-stage means from the gateway's ``/metrics``: the stage histograms
(``gateway_stage_seconds`` and the workers' ``gateway_worker_stage_seconds``)
summed per stage in one snapshot, and the mean of each stage over the requests
between two snapshots. Torch-free."""

from __future__ import annotations

import re
from collections import defaultdict

_SAMPLE = re.compile(r"^(gateway_(?:worker_)?stage_seconds)_(sum|count)\{([^}]*)\} (\S+)$")


def stage_totals(metrics_text: str) -> dict[str, tuple[float, float]]:
    """``{"gateway:stage" or "<role>:stage": (sum_s, count)}`` from /metrics."""
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for line in metrics_text.splitlines():
        m = _SAMPLE.match(line)
        if m is None:
            continue
        metric, kind, labels, value = m.groups()
        tags = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        who = "gateway" if metric == "gateway_stage_seconds" else tags.get("role", "worker")
        key = f"{who}:{tags.get('stage', '?')}"
        out[key][0 if kind == "sum" else 1] += float(value)
    return {k: (v[0], v[1]) for k, v in out.items()}


def stage_means_ms(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, float]:
    """Mean of each stage over the requests between two snapshots, in ms."""
    means = {}
    for key, (s1, c1) in after.items():
        s0, c0 = before.get(key, (0.0, 0.0))
        if c1 > c0:
            means[key] = (s1 - s0) / (c1 - c0) * 1e3
    return means
