"""Nightly increments (run.skip_existing): a second night over yesterday's rows plus new ones generates only the new
ones, and the union equals one run over all rows; a different output config is refused. On engine=dummy (its
samples are a function of each request, as a real engine's are of its seed)."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from batchgen.errors import ConfigError
from batchgen.run.runner import run_job
from tests.conftest import compose_job, corpus, dummy_overrides, read_output, run_cli, write_parquet

TEXTS = corpus(60, seed=17)


def rows(lo, hi):
    return [{"uid": f"t{i:03d}", "prompt": TEXTS[i]} for i in range(lo, hi)]


def night(model, data, out, *extra):
    return compose_job(dummy_overrides(model, data, out, "dataset.id_column=uid", "run.rows_per_part=16",
                                       "sampling=sample", "sampling.max_new_tokens=8", *extra))


def by_id(table: pa.Table) -> list[dict]:
    return sorted(table.to_pylist(), key=lambda r: (r["id"], r["sample_index"]))


def test_the_second_night_generates_only_the_new_rows_and_the_union_is_one_run(tiny_model, tmp_path):
    first = write_parquet(tmp_path / "day1.parquet", rows(0, 40))
    second = write_parquet(tmp_path / "day2.parquet", rows(0, 60))  # yesterday's 40 rows and 20 new ones
    run_job(night(tiny_model, first, tmp_path / "out1"))
    out2 = tmp_path / "out2"
    summary = run_job(night(tiny_model, second, out2, f"run.skip_existing={tmp_path / 'out1'}"))
    got = read_output(out2)
    assert sorted(got.column("id").to_pylist()) == [f"t{i:03d}" for i in range(40, 60)]  # only the new ones
    assert summary.totals.skipped == 40 and "skipped: 40 rows already generated" in summary.render()
    status = json.loads((out2 / "_status.json").read_text())
    assert status["rows_skipped"] == 40 and status["state"] == "done"
    manifest = json.loads((out2 / "_manifest.json").read_text())
    assert manifest["output_config"]["run"]["skip_existing"] == str((tmp_path / "out1").resolve())
    run_job(night(tiny_model, second, tmp_path / "all"))
    union = pa.concat_tables([read_output(tmp_path / "out1"), got])
    assert by_id(union) == by_id(read_output(tmp_path / "all"))
    assert "skipped: 40 rows" in run_cli(["status", str(out2)]).stdout


def test_rows_that_erred_are_generated_again_and_another_config_is_refused(tiny_model, tmp_path):
    day1 = rows(0, 20)
    day1[3]["prompt"] = ""  # an error row yesterday: generated again tonight
    first = write_parquet(tmp_path / "day1.parquet", day1)
    run_job(night(tiny_model, first, tmp_path / "out1"))
    second = write_parquet(tmp_path / "day2.parquet", rows(0, 24))
    run_job(night(tiny_model, second, tmp_path / "out2", f"run.skip_existing={tmp_path / 'out1'}"))
    assert sorted(read_output(tmp_path / "out2").column("id").to_pylist()) == ["t003", "t020", "t021", "t022",
                                                                              "t023"]
    with pytest.raises(ConfigError, match="run.skip_existing: .* another output config .*sampling.max_new_tokens"):
        run_job(night(tiny_model, second, tmp_path / "out3", f"run.skip_existing={tmp_path / 'out1'}",
                      "sampling.max_new_tokens=9"))
    assert not (tmp_path / "out3").exists()
