"""benchmarks/wake_latency.py times each direction of a ZMQ exchange on the
host's shared monotonic clock, for every gap and both ways of waiting."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.wake_latency import main


def test_record_has_both_directions_per_gap_and_mode(tmp_path: Path) -> None:
    out = tmp_path / "wake.json"
    main(["--gaps-ms", "0", "20", "--messages", "3", "--output-file", str(out)])
    record = json.loads(out.read_text())
    rows = record["rows"]
    assert [(r["spin"], r["gap_ms"]) for r in rows] == [
        (False, 0.0),
        (False, 20.0),
        (True, 0.0),
        (True, 20.0),
    ]
    for r in rows:
        # One way on a loopback socket: more than nothing, less than the
        # 20 ms the server pauses before it answers (which is not counted).
        assert 0 < r["to_server_ms_median"] < 20.0, r
        assert 0 < r["back_ms_median"] < 20.0, r
    assert record["command"].startswith("wake_latency.py")
