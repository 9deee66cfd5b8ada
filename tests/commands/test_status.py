"""`batchgen status` reads a run's state off disk: progress, duplicates, the part in flight and its journal."""

from __future__ import annotations

import json

from batchgen.commands.status import describe
from batchgen.output.journal import Journal, journal_key, journal_path
from batchgen.records import Result


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


def test_the_heartbeat_record_round_trips_and_reads_older_and_newer_files(tmp_path):
    import json

    from batchgen.output.heartbeat import Heartbeat, read_heartbeat, status_name, write_heartbeat

    beat = Heartbeat(state="running", rows_done=3, rows_total=10, errors={"empty_prompt": 1}, shard=1, num_shards=2,
                     current_part={"index": 3, "samples_planned": 4, "samples_journaled": 1, "samples_reused": 0})
    write_heartbeat(tmp_path, beat)
    path = tmp_path / status_name(1, 2)
    assert path.name == "_status.shard-00001.json"
    assert read_heartbeat(path) == beat and beat.updated_at
    raw = json.loads(path.read_text())
    path.write_text(json.dumps({k: v for k, v in raw.items() if k != "duplicate_ids"} | {"from_the_future": 1}))
    older_newer = read_heartbeat(path)
    assert older_newer.duplicate_ids == 0 and older_newer.rows_done == 3
    path.write_text("{torn")
    assert read_heartbeat(path) is None
