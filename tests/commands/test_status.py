"""`batchgen status` reads a run's state off disk: progress, duplicates, the part in flight and its journal; its
headline counts the work done wherever it is (committed parts ahead of a killed writer's status file, samples
journaled by a stopped run)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
from filelock import FileLock

from batchgen.commands.compose import config_from
from batchgen.commands.retry import main as retry_main
from batchgen.commands.status import describe
from batchgen.commands.status import main as status_main
from batchgen.commands.view import main as view_main
from batchgen.errors import BatchgenError
from batchgen.output.journal import Journal, journal_key, journal_path, read_journal
from batchgen.records import Result
from tests.conftest import REPO, dummy_overrides, keyed_rows, read_output, run_cli, write_parquet
from tests.output.ledger.test_nights import night, tickets

HEADLINE = re.compile(r"_status\.json: (?P<state>[a-z ()]+): rows (?P<rows>\d+)/(?P<total>\d+) \([\d.]+%\) committed"
                      r"(?: \+ (?P<journaled>\d+) samples journaled[^,]*)?, error rows \d+ \([^)]*\), "
                      r"(?P<tokens>\d+) generated tokens, (?P<rate>[\d.]+) generated tok/s after load")


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
    assert ("_status.json: stopped: rows 10/30 (33.3%) committed + 7 samples journaled (3.5 rows: 45.0% with them), "
            "error rows 1 (empty_prompt=1), 108 generated tokens, 12.5 tok/s") in text  # 80 committed, 28 journaled
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


def headline(out) -> dict:
    found = HEADLINE.search(describe(out))
    assert found, describe(out)
    return found.groupdict()


def test_after_sigint_the_headline_counts_the_journaled_samples_and_their_tokens(tiny_model, tmp_path):
    """One part of 12 rows, stopped by SIGINT with some samples journaled and no part committed: the headline counts
    those samples and their tokens (it said `rows 0/12 (0.0%), ..., 0 generated tokens, 37.04 tok/s`)."""
    data = write_parquet(tmp_path / "in.parquet", keyed_rows(12, "r", 4))
    out = tmp_path / "out"
    args = dummy_overrides(tiny_model, data, out, "dataset.id_column=uid", "run.rows_per_part=12",
                           "sampling.max_new_tokens=20", "+engine.extra_args.delay_s=0.01",
                           "+engine.extra_args.eos_rate=0.0")
    job = subprocess.Popen([sys.executable, "-m", "batchgen", *args], cwd=REPO, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    journal, deadline = journal_path(out, 0), time.monotonic() + 120
    while not (journal.exists() and len(read_journal(journal)[1]) >= 2):
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[1][-3000:]
        time.sleep(0.02)
    os.kill(job.pid, signal.SIGINT)
    assert job.wait(timeout=30) == 130, job.communicate()[1][-3000:]
    _, kept, _ = read_journal(journal)
    said = headline(out)
    assert said["state"] == "stopped" and said["rows"] == "0" and not list(out.glob("part-*.parquet"))
    assert int(said["journaled"]) == len(kept) >= 2
    assert int(said["tokens"]) == sum(r.num_generated_tokens for r in kept) > 0 and float(said["rate"]) > 0


def test_after_sigkill_the_headline_does_not_lag_the_committed_parts(tiny_model, tmp_path):
    """SIGKILLed right after a part's commit, before the status file heard of it: the headline counts the part's rows
    and tokens from its file (it said `rows 0/12`, the last heartbeat's)."""
    data = write_parquet(tmp_path / "in.parquet", keyed_rows(12, "r", 6))
    out = tmp_path / "out"
    killed = run_cli(dummy_overrides(tiny_model, data, out, "dataset.id_column=uid", "run.rows_per_part=3",
                                     "sampling.max_new_tokens=6"), env={"BATCHGEN_TEST_KILL_AT": "part committed"})
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert json.loads((out / "_status.json").read_text())["rows_done"] == 0  # the status file lags the part
    said = headline(out)
    assert said["state"] == "stopped (no live writer)" and (said["rows"], said["total"]) == ("3", "12")
    assert int(said["tokens"]) >= sum(read_output(out).column("num_generated_tokens").to_pylist()) > 0


def test_a_failure_quoting_a_row_reaches_the_terminal_escaped_on_the_console_and_in_status(tiny_model, tmp_path):
    """run.on_bad_row=fail stops at a row whose id holds terminal escapes, a bidi override and lines that look like
    batchgen's own: the CLI's error line and `batchgen status`'s last error print them escaped."""
    from tests.commands.test_terminal import HOSTILE, assert_safe

    data = write_parquet(tmp_path / "in.parquet", [{"uid": f"u0{HOSTILE}", "prompt": None}])
    out = tmp_path / "out"
    failed = run_cli(dummy_overrides(tiny_model, data, out, "dataset.id_column=uid", "run.on_bad_row=fail"))
    assert failed.returncode == 1 and "run.on_bad_row=fail" in failed.stderr
    assert_safe(failed.stderr)
    said = describe(out)
    assert "last error: row u0x\\x1b]0;pwned\\x07" in said
    assert_safe(said)


def test_status_of_an_increment_root_lists_its_nights_with_retries_and_a_total(tiny_model, tmp_path, capsys):
    """`batchgen status ROOT` on a `batchgen increment` root answered `no batchgen run here`. Now: each night
    (complete, unfinished, being written), its rows and error rows and those after a published retry, the totals and
    the union; and `batchgen view ROOT` reads the retried night's published rows once, the retry's answers winning."""
    root, data = tmp_path / "nights", tmp_path / "in.parquet"
    limits = ("engine.max_model_len=64", "sampling.max_new_tokens=4", "run.too_long=skip", "run.max_error_rate=0.9")
    tickets(data, 6, long=frozenset({1, 4}))
    night(tiny_model, root, "2026-12-05", data, *limits)  # t01, t04 too long: error rows
    assert retry_main([str(root / "2026-12-05"), "run.too_long=truncate_left"], config_from) == 0
    tickets(data, 9, long=frozenset({1, 4, 7}))
    night(tiny_model, root, "2026-12-06", data, *limits)  # t06..t08, t07 errs
    tickets(data, 14, long=frozenset({1, 4, 7}))  # t07 again: over run.max_error_rate, the night stops unfinished
    with pytest.raises(BatchgenError, match="run.max_error_rate"):
        night(tiny_model, root, "2026-12-07", data, *limits[:3], "run.max_error_rate=0.1")
    capsys.readouterr()
    assert status_main([str(root)]) == 0
    said = capsys.readouterr().out.splitlines()
    assert said == [
        f"{root}: batchgen increment root, 3 nights (2 complete)",
        "  2026-12-05: complete: rows 6, error rows 2 (too_long=2); after retry attempt-001: 0 error rows of 6 "
        "(2 before retries)",
        "  2026-12-06: complete: rows 3 (6 skipped: other nights'), error rows 1 (too_long=1)",
        "  2026-12-07: unfinished (no live writer: a rerun the same night resumes it, a later night generates its "
        "rows again): rows 1 (7 skipped: other nights'), 8/14 input rows committed, error rows 1 (too_long=1)",
        "  all nights: rows 10, error rows 2 after retries (4 before)",
        f"  their union (batchgen view {root}): 9 ids, each once; 1 of them erred in every night that has them"]
    with FileLock(str(root / "2026-12-07" / "_lock")):  # a live writer of that night (a rerun of it)
        assert "  2026-12-07: being written: rows 1 (7 skipped: other nights'), 8/14 input" in describe(root)
    assert view_main([str(root), "--to", str(tmp_path / "union.parquet")]) == 0
    rows = pq.read_table(tmp_path / "union.parquet").to_pylist()
    assert sorted(r["id"] for r in rows) == [f"t{i:02d}" for i in range(9)]  # every committed id once
    assert {r["id"]: r["attempt"] for r in rows if r["attempt"]} == {"t01": 1, "t04": 1}  # the retry's answers
    assert [r["id"] for r in rows if r["error"] is not None] == ["t07"]
