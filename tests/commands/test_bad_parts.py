"""A part-*.parquet that batchgen cannot read as its own (truncated, or a foreign Parquet file under a part's name):
`batchgen retry` and `batchgen view` exit 2 naming the file and why, never a traceback nor a silent read that drops
rows; the Python view (and so run.skip_existing) raises the same BadPartError. On engine=dummy."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.errors import BadPartError
from batchgen.output.view import latest
from batchgen.run.runner import run_job
from tests.commands.test_retry import finished_job, job_args
from tests.conftest import compose_job, run_cli


def assert_refused(args: list[str], path, why: str) -> None:
    done = run_cli(args, timeout=120)
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    assert str(path) in done.stderr and why in done.stderr, done.stderr[-3000:]
    assert "Traceback" not in done.stderr


def test_a_truncated_part_is_refused_by_retry_and_view_naming_it(tiny_model, tmp_path):
    out, _ = finished_job(tiny_model, tmp_path)
    part = out / "part-00001.parquet"
    part.write_bytes(part.read_bytes()[:-40])  # its footer cut off: a copy or a disk that stopped short
    assert_refused(["retry", str(out), "--kinds", "too_long", "run.too_long=truncate_left"], part,
                   "not a readable Parquet file")
    assert_refused(["view", str(out)], part, "not a readable Parquet file")
    assert not (out / "_attempts").exists()  # refused before an attempt was started
    with pytest.raises(BadPartError, match="part-00001.parquet"):
        latest(out)


def test_a_foreign_parquet_under_a_parts_name_is_refused_not_read_silently(tiny_model, tmp_path):
    out, _ = finished_job(tiny_model, tmp_path)
    foreign = out / "part-00009.parquet"
    pq.write_table(pa.table({"x": [1, 2, 3]}), foreign)
    assert_refused(["view", str(out)], foreign, "no column id, sample_index")
    assert_refused(["retry", str(out), "--kinds", "too_long"], foreign, "no column id, sample_index")
    assert_refused(["report", str(out), "--out", str(tmp_path / "page.html")], foreign, "no column id, sample_index")


def test_run_skip_existing_refuses_a_bad_part_of_the_night_it_skips(tiny_model, tmp_path):
    night, _ = finished_job(tiny_model, tmp_path)
    (night / "part-00002.parquet").write_bytes(b"not parquet at all")
    data = tmp_path / "in.parquet"
    with pytest.raises(BadPartError, match="part-00002.parquet: not a readable Parquet file"):
        run_job(compose_job(job_args(tiny_model, data, tmp_path / "next", f"run.skip_existing={night}")))
