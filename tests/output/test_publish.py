"""A retry's publish (batchgen/output/publish.py): once an attempt is complete, the directory's readers (pandas,
pyarrow, duckdb over `out/*.parquet`) read the latest attempt of every row, each id once; the job's parts as committed
stay readable in _attempts/original/; a crash at any step of the publish leaves every id once, and a rerun of
`batchgen retry OUTPUT_DIR` finishes it. engine=dummy (no model loads)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

import batchgen.output.publish as publish_module
from batchgen.commands.compose import config_from
from batchgen.commands.report import _summary_rows, gather
from batchgen.commands.retry import main as retry_main
from batchgen.commands.status import describe
from batchgen.output.publish import PUBLISHED, pending, publish
from batchgen.output.view import latest
from batchgen.run.runner import run_job
from tests.commands.test_retry import finished_job, job_args
from tests.conftest import REPO, compose_job

FIX = ["--kinds", "too_long", "run.too_long=truncate_left"]
IDS = [f"r{i:02d}" for i in range(24)]
POINTS = ("publish: original kept", "publish: part under its temp name", "publish: part replaced",
          "publish: parts replaced")


class Killed(BaseException):
    """Stands for a SIGKILL at a kill point: nothing after it runs (publish has no cleanup that would)."""


def kill_at(monkeypatch, point: str) -> None:
    def kill_point(where: str) -> None:
        if where == point:
            raise Killed(where)

    monkeypatch.setattr(publish_module, "kill_point", kill_point)


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("part-*.parquet"))}


def read_dir(out: Path) -> list[dict]:
    """The directory as the README reads it (pandas' NaN for a null made None again)."""
    frame = pd.read_parquet(out)
    return frame.astype(object).where(frame.notna(), None).to_dict("records")


def test_a_retry_that_fixes_every_failed_row_is_what_pandas_pyarrow_and_duckdb_read(tiny_model, tmp_path):
    import duckdb

    out, long_ids = finished_job(tiny_model, tmp_path)
    first = digests(out)
    assert retry_main([str(out), *FIX], config_from) == 0
    rows = read_dir(out)
    assert [r["id"] for r in rows] == IDS and all(r["error"] is None for r in rows)  # each id once, no error
    assert pq.read_table(out).num_rows == 24
    sql = duckdb.sql(f"SELECT id, error FROM read_parquet('{out}/*.parquet')").fetchall()
    assert sorted(r[0] for r in sql) == IDS and all(r[1] is None for r in sql)
    view = latest(out).to_pylist()  # the view and the directory agree row for row
    assert [(r["id"], r["generation"]) for r in view] == [(r["id"], r["generation"]) for r in rows]
    assert [r["attempt"] for r in view] == [1 if r["id"] in long_ids else 0 for r in view]
    # the job's parts as committed: byte for byte in _attempts/original/, their error rows there
    kept = out / "_attempts" / "original"
    assert digests(kept) == first
    original = read_dir(kept)
    assert sorted(r["id"] for r in original if r["error"] is not None) == long_ids
    assert not pending(out)
    # the headlines: status and the report say what reading the directory says
    status = describe(out)
    assert f"{out}: complete; after retry attempt-001: 0 error rows of 24 (6 before retries)" in status
    assert "attempt-001: complete: 6 rows retried" in status and "0 rows still fail after it" in status
    retried = pq.read_table(out / "_attempts" / "attempt-001").column("num_generated_tokens").to_pylist()
    assert sum(retried) > 0  # the job's error rows generated nothing: the total is the rows' read now
    assert ["generated tokens (history, retries included)", sum(r["num_generated_tokens"] for r in rows)] in \
        _summary_rows(gather(out))
    assert ["error samples (latest view: after retries)", 0] in _summary_rows(gather(out))
    # a rerun of the job itself is a finished job's: every published part trusted as its own, nothing generated
    summary = run_job(compose_job(job_args(tiny_model, tmp_path / "in.parquet", out)))
    assert summary.state == "already_done" and digests(out) != first and read_dir(out) == rows


def test_a_second_attempt_republishes_only_what_it_changed(tiny_model, tmp_path):
    out, long_ids = finished_job(tiny_model, tmp_path)
    assert retry_main([str(out), "run.max_error_rate=1"], config_from) == 0  # every retried row errs again
    rows = read_dir(out)
    assert sorted(r["id"] for r in rows if r["error"] is not None) == long_ids and len(rows) == 24
    status = describe(out)
    assert "after retry attempt-001: 6 error rows of 24" in status and "6 rows still fail after it" in status
    assert retry_main([str(out), "run.too_long=truncate_left"], config_from) == 0
    rows = read_dir(out)
    assert [r["id"] for r in rows] == IDS and all(r["error"] is None for r in rows)
    assert "after retry attempt-002: 0 error rows of 24 (6 before retries)" in describe(out)


def unpublished(tiny_model, tmp_path, monkeypatch) -> Path:
    """A finished job whose retry completed and was killed before its publish replaced a part."""
    out, _ = finished_job(tiny_model, tmp_path)
    kill_at(monkeypatch, POINTS[0])
    with pytest.raises(Killed):
        retry_main([str(out), *FIX], config_from)
    monkeypatch.undo()
    assert pending(out) == 1
    return out


@pytest.mark.parametrize("point", POINTS)
def test_a_kill_at_each_step_of_the_publish_leaves_every_id_once_and_a_rerun_finishes_it(tiny_model, tmp_path,
                                                                                          monkeypatch, point):
    out = unpublished(tiny_model, tmp_path, monkeypatch)
    reference = tmp_path / "reference"
    shutil.copytree(out, reference)
    assert retry_main([str(reference)], config_from) == 0  # the pending publish, finished undisturbed
    kill_at(monkeypatch, point)
    with pytest.raises(Killed):
        publish(out, 1)
    monkeypatch.undo()
    rows = read_dir(out)  # the state the kill left: each id once, each part its old or its new rows
    assert [r["id"] for r in rows] == IDS
    assert pending(out) == 1
    assert retry_main([str(out)], config_from) == 0  # the rerun finishes the publish, and starts nothing new
    attempts = out / "_attempts"
    assert not (attempts / "attempt-002").exists() and (attempts / "attempt-001" / PUBLISHED).exists()
    assert read_dir(out) == read_dir(reference)
    assert digests(out) == digests(reference) and digests(out / "_attempts" / "original") == digests(
        reference / "_attempts" / "original")
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp part left behind


@pytest.mark.slow
def test_a_real_sigkill_at_each_step_of_the_publish_then_a_rerun_gives_each_id_once(tiny_model, tmp_path,
                                                                                    monkeypatch):
    out = unpublished(tiny_model, tmp_path, monkeypatch)
    for point in POINTS:
        here = tmp_path / point.replace(":", "").replace(" ", "-")
        shutil.copytree(out, here)
        killed = subprocess.run([sys.executable, "-m", "batchgen", "retry", str(here)], cwd=REPO,
                                capture_output=True, text=True, env=os.environ | {"BATCHGEN_TEST_KILL_AT": point})
        assert killed.returncode == -9, killed.stderr[-2000:]
        assert [r["id"] for r in read_dir(here)] == IDS
        done = subprocess.run([sys.executable, "-m", "batchgen", "retry", str(here)], cwd=REPO, capture_output=True,
                              text=True)
        assert done.returncode == 0 and "published attempt 1" in done.stdout, done.stderr[-2000:]
        rows = read_dir(here)
        assert [r["id"] for r in rows] == IDS and all(r["error"] is None for r in rows)
