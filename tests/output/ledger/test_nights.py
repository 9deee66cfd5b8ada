"""ledger/nights.py and run.skip_existing over a root of nights (ledger/existing.py's ledger), as `batchgen increment`
sets them: every finished night under the root counts whatever its date (a missed night run late, a clock set back),
found where the root is now (a moved root), and the union of the nights (`batchgen view ROOT`, the docs' duckdb line)
holds each id once with `batchgen retry`'s answers."""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchgen.output.ledger.nights import union_batches
from batchgen.output.manifest import NIGHTS_BESIDE, read_manifest
from batchgen.run.runner import run_job
from tests.conftest import REPO, compose_job, dummy_overrides, read_output, run_cli, write_parquet


def tickets(path: Path, last: int, long: frozenset[int] = frozenset()) -> Path:
    """The growing input: tickets t00..t`last`-1, those in `long` too long for the job's model length."""
    return write_parquet(path, [{"uid": f"t{i:02d}", "prompt": ("word " * 200 if i in long else f"ticket {i}")}
                                for i in range(last)])


def night(model: str, root: Path, date: str, data: Path, *extra: str) -> list[str]:
    """A night as `batchgen increment` runs it: ROOT/DATE, run.skip_existing the root; the ids it generated."""
    out = root / date
    run_job(compose_job(dummy_overrides(model, data, out, "dataset.id_column=uid", "run.rows_per_part=4",
                                        f"run.skip_existing={root}", *extra)))
    return sorted(read_output(out).column("id").to_pylist())


def test_every_finished_night_counts_whatever_its_date_and_wherever_the_root_moved(tiny_model, tmp_path, caplog):
    root, data = tmp_path / "nights", tmp_path / "in.parquet"
    tickets(data, 5)
    assert night(tiny_model, root, "2026-12-05", data) == [f"t{i:02d}" for i in range(5)]
    tickets(data, 8)
    assert night(tiny_model, root, "2026-12-07", data) == ["t05", "t06", "t07"]
    assert night(tiny_model, root, "2026-12-06", data) == []  # a missed night run late: the later night's ids held
    tickets(data, 10)
    assert night(tiny_model, root, "2026-12-01", data) == ["t08", "t09"]  # a clock set back: not a first night
    assert read_manifest(root / "2026-12-01")["output_config"]["run"]["skip_existing"] == NIGHTS_BESIDE
    moved = tmp_path / "new-disk" / "nights"
    shutil.move(root, moved)  # another disk, another mount point
    tickets(data, 11)
    with caplog.at_level(logging.WARNING):
        assert night(tiny_model, moved, "2026-12-08", data) == ["t10"]
    assert "no longer holds an output" not in caplog.text


def docs_union_query(root: Path) -> str:
    """The docs' duckdb line (docs/output-and-resume.md, "Nightly increments"), its example root replaced by `root`."""
    text = (REPO / "docs" / "output-and-resume.md").read_text()
    sql = re.search(r'duckdb -c "(\nWITH .*?)"\n', text, re.S).group(1)
    return sql.replace("/data/outputs/annotate", str(root))


@pytest.mark.slow
def test_the_union_of_the_nights_holds_each_id_once_with_retried_answers_in_view_and_duckdb(tiny_model, tmp_path):
    duckdb = pytest.importorskip("duckdb")
    root, data = tmp_path / "nights", tmp_path / "in.parquet"
    limits = ("engine.max_model_len=64", "sampling.max_new_tokens=4", "run.too_long=skip", "run.max_error_rate=0.9")
    tickets(data, 6, long=frozenset({1, 4}))
    night(tiny_model, root, "2026-12-05", data, *limits)  # t01, t04 too long: error rows
    retried = run_cli(["retry", str(root / "2026-12-05"), "run.too_long=truncate_left"])
    assert retried.returncode == 0, retried.stderr[-3000:]
    tickets(data, 9, long=frozenset({1, 4, 7}))
    assert night(tiny_model, root, "2026-12-06", data, *limits) == ["t06", "t07", "t08"]  # t07 errs here
    union = list(union_batches(root))
    rows = sorted((r for t in union for r in t.to_pylist()), key=lambda r: r["id"])
    assert [r["id"] for r in rows] == [f"t{i:02d}" for i in range(9)]  # every id once
    assert [r["id"] for r in rows if r["error"] is not None] == ["t07"]  # t01, t04: the retry's answers
    assert {r["id"]: r["attempt"] for r in rows if r["attempt"]} == {"t01": 1, "t04": 1}
    shown = run_cli(["view", str(root), "--to", str(tmp_path / "union.parquet")])
    assert shown.returncode == 0 and "9 rows written" in shown.stderr, shown.stderr[-2000:]
    pick = ["id", "sample_index", "generation", "error", "attempt"]
    key = lambda r: (r["id"], r["sample_index"])  # noqa: E731
    view = sorted(pq.read_table(tmp_path / "union.parquet").select(pick).to_pylist(), key=key)
    assert view == sorted((r for t in union for r in t.select(pick).to_pylist()), key=key)
    sql = duckdb.sql(docs_union_query(root)).arrow()
    sql = sql.read_all() if hasattr(sql, "read_all") else sql
    assert sorted(sql.select(pick).to_pylist(), key=key) == view  # the docs' line reads the same rows


@pytest.mark.slow
def test_increment_into_a_delta_table_holds_each_id_once_after_a_missed_night_run_late(tiny_model, tmp_path):
    """output.sink=delta: every night commits its rows to the one Delta table; a missed night run late with --date,
    then the next night, generate nothing twice, so the table itself holds each id once."""
    pytest.importorskip("deltalake", reason="output.sink=delta needs deltalake: pip install 'batchgen[delta]'")
    from deltalake import DeltaTable

    root, data, table = tmp_path / "nights", tmp_path / "in.parquet", tmp_path / "delta-table"
    job = dummy_overrides(tiny_model, data, root, "dataset.id_column=uid", "run.rows_per_part=4",
                          "output.sink=delta", f"output.table={table}")
    for date, last in (("2026-12-05", 5), ("2026-12-07", 8), ("2026-12-06", 8), ("2026-12-08", 10)):
        tickets(data, last)  # 2026-12-06 was missed: run late, after 2026-12-07, with --date
        done = run_cli(["increment", "--date", date, *job])
        assert done.returncode == 0, (date, done.stderr[-3000:])
    ids = DeltaTable(str(table)).to_pyarrow_table(columns=["id"]).column("id").to_pylist()
    assert sorted(ids) == [f"t{i:02d}" for i in range(10)]  # each id once: 10 rows, not 13 or 18
    assert sorted(read_output(root / "2026-12-08").column("id").to_pylist()) == ["t08", "t09"]
