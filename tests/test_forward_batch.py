"""``build_forward_batch`` against a plain reading of its fields, for short
rows (decode) and long ones (prompt chunks, built by numpy), mixed."""

from __future__ import annotations

import random

from engine.forward_batch import LONG_EXTEND, ExtendSpec, build_forward_batch


def test_rows_match_a_plain_reading() -> None:
    rng = random.Random(0)
    ps = 16
    specs = []
    for n, start, logits in [
        (1, 700, "last"),
        (LONG_EXTEND + 1, 37, "last"),
        (1000, 0, "all"),
        (3, 5, "none"),
        (LONG_EXTEND, 64, "last"),
    ]:
        pages = rng.sample(range(1, 10_000), -(-(start + n) // ps) + 2)
        specs.append(ExtendSpec([rng.randrange(50_000) for _ in range(n)], start, pages, logits))
    b = build_forward_batch(specs, ps, "cpu")
    ids, pos, pages, slots, logits_rows = [], [], [], [], []
    for spec in specs:
        row0 = len(ids)
        for i, tok in enumerate(spec.new_ids):
            p = spec.start + i
            ids.append(tok)
            pos.append(p)
            pages.append(spec.page_table[p // ps])
            slots.append(p % ps)
            if spec.logits == "all" or (spec.logits == "last" and i == len(spec.new_ids) - 1):
                logits_rows.append(row0 + i)
    assert b.input_ids.tolist() == ids
    assert b.positions.tolist() == pos
    assert b.write_pages.tolist() == pages
    assert b.write_slots.tolist() == slots
    assert b.logits_indices.tolist() == logits_rows
    assert b.seq_lens == [s.start + len(s.new_ids) for s in specs]
    assert b.extend_lens == [len(s.new_ids) for s in specs]
    assert b.page_tables == [s.page_table[: -(-(s.start + len(s.new_ids)) // ps)] for s in specs]
