"""The Python API: batchgen.load_job (a preset with overrides) and batchgen.generate (rows in memory in, the
latest-attempt view out as a pyarrow Table), under the job's resume and error rules."""

from __future__ import annotations

import pyarrow as pa
import pytest

import batchgen
from batchgen.errors import BatchgenError, ConfigError


def rows(n: int) -> list[dict]:
    return [{"id": f"q{i}", "instruction": f"Say {i}", "input": "" if i == 2 else f"item {i}", "max_new_tokens": 5}
            for i in range(n)]


def test_a_preset_runs_rows_held_in_memory(tiny_model, tmp_path):
    cfg = batchgen.load_job("demo", ["engine=dummy", f"engine.model={tiny_model}", "run.progress=false"])
    assert cfg.dataset.template == "{instruction}\n\n{input}" and cfg.dataset.id_column == "id"
    table = batchgen.generate(rows(6), cfg)
    assert table.column("id").to_pylist() == [f"q{i}" for i in range(6)]
    assert table.column("error").null_count == 6 and table.column("generation").null_count == 0
    assert cfg.output_dir == "data/outputs/demo"  # the caller's config is left as it was
    from datasets import Dataset

    assert batchgen.generate(pa.Table.from_pylist(rows(6)), cfg).equals(table)
    assert batchgen.generate(Dataset.from_list(rows(6)), cfg).equals(table)
    bad = rows(3) + [{"id": "q3", "instruction": None, "input": None, "max_new_tokens": 5}]
    erred = batchgen.generate(bad, cfg)  # a bad row costs its row, not the job
    assert erred.num_rows == 4 and erred.column("error").to_pylist()[3] is not None


def test_an_output_dir_makes_it_resumable_and_refuses_other_rows(tiny_model, tmp_path):
    cfg = batchgen.load_job("demo", ["engine=dummy", f"engine.model={tiny_model}", "run.progress=false",
                                     "run.rows_per_part=2"])
    first = batchgen.generate(rows(5), cfg, output_dir=tmp_path / "out")
    parts = sorted(p.stat().st_mtime_ns for p in (tmp_path / "out").glob("part-*.parquet"))
    again = batchgen.generate(rows(5), cfg, output_dir=tmp_path / "out")  # complete: nothing generated again
    assert again.equals(first)
    assert sorted(p.stat().st_mtime_ns for p in (tmp_path / "out").glob("part-*.parquet")) == parts
    with pytest.raises(BatchgenError, match="different input"):
        batchgen.generate(rows(6), cfg, output_dir=tmp_path / "out")


def test_load_job_names_mistakes_as_the_command_line_does(tiny_model):
    with pytest.raises(ConfigError, match=r"job=demmo: no such option \(did you mean job=demo\?\)"):
        batchgen.load_job("demmo")
    with pytest.raises(ConfigError, match=r"sampling.temprature: no such config key \(did you mean "
                                          r"sampling.temperature\?\)"):
        batchgen.load_job("demo", ["sampling.temprature=0.5"])


def test_load_job_without_a_preset_leaves_the_input_to_generate_and_run_job_names_what_is_missing(tiny_model,
                                                                                                  tmp_path):
    """No preset: dataset.path is generate's to set; a model left unset is named when the job runs, not as
    OmegaConf's 'missing mandatory value'."""
    cfg = batchgen.load_job(overrides=[f"engine.model={tiny_model}", "sampling.max_new_tokens=3",
                                       "engine.dtype=float32"])
    table = batchgen.generate([{"prompt": "one"}, {"prompt": "two"}], cfg)
    assert table.num_rows == 2 and table.column("num_generated_tokens").to_pylist() == [3, 3]
    bare = batchgen.load_job()
    bare.output_dir = str(tmp_path / "out")
    with pytest.raises(ConfigError) as err:
        batchgen.run_job(bare)
    assert "dataset.path is required" in str(err.value) and "engine.model is required" in str(err.value)
