"""`batchgen status` reads a run's state off disk: progress, duplicates, the part in flight and its journal."""

from __future__ import annotations

import json

from batchgen.journal import Journal, journal_key, journal_path
from batchgen.records import Result
from batchgen.status import describe


def test_status_shows_the_journaled_samples_of_the_part_in_flight(tmp_path):
    (tmp_path / "_manifest.json").write_text("{}")
    (tmp_path / "_status.json").write_text(json.dumps({
        "state": "stopped", "rows_done": 10, "rows_failed": 1, "rows_total": 30, "errors": {"empty_prompt": 1},
        "generated_tokens": 80, "tokens_per_s": 12.5, "eta_s": None, "duplicate_ids": 3, "updated_at": "now",
        "error": "stopped by SIGTERM"}))
    key = journal_key(part=1, first_row=10, ids=[f"r{i}" for i in range(10, 20)], config_hash="h", n=2)
    journal, _ = Journal.open(journal_path(tmp_path, 1), key, valid_keys=set(range(20)))
    with journal:
        for k in range(7):
            journal.append(Result(key=k, text="x", finish_reason="length", num_prompt_tokens=3,
                                  num_generated_tokens=4))
    with open(journal_path(tmp_path, 1), "ab") as f:
        f.write(b"\x05\x00")  # a torn tail
    text = describe(tmp_path)
    assert "_status.json: stopped: rows 10/30 (33.3%), error rows 1 (empty_prompt=1)" in text
    assert "duplicate ids: 3 rows" in text and "last error: stopped by SIGTERM" in text
    assert "part 00001 in flight: 7 of 20 samples journaled, torn tail of 2 bytes (dropped on resume)" in text
    assert "no run holds the lock" in text
