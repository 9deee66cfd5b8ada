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
    with pytest.raises(BatchgenError, match=r"holds the output of other rows or another config \(input.*: pass a new "
                                            r"output_dir=\.\.\., or overwrite=True to replace that output") as refused:
        batchgen.generate(rows(6), cfg, output_dir=tmp_path / "out")
    assert refused.value.__cause__ is None and refused.value.__suppress_context__  # one error, not two tracebacks
    replaced = batchgen.generate(rows(6), cfg, output_dir=tmp_path / "out", overwrite=True)
    assert replaced.column("id").to_pylist() == [f"q{i}" for i in range(6)]


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


def test_generate_takes_a_dataframe_and_names_rows_without_an_id_by_their_position(tiny_model):
    """A pandas DataFrame (a TypeError before, while docs/recipes.md said generate takes one) comes back as a
    DataFrame in its order, its columns carried; rows without an id are `row:N`, not `_input.parquet:N`."""
    import pandas as pd

    cfg = batchgen.load_job(overrides=["engine=dummy", f"engine.model={tiny_model}", "run.progress=false"])
    frame = pd.DataFrame({"prompt": ["one", "two", "three"], "lang": ["en", "fr", "de"]}, index=[7, 3, 5])
    out = batchgen.generate(frame, cfg)
    assert isinstance(out, pd.DataFrame)
    assert out["id"].tolist() == ["row:0", "row:1", "row:2"] and out["lang"].tolist() == ["en", "fr", "de"]
    keyed = batchgen.load_job("demo", ["engine=dummy", f"engine.model={tiny_model}", "run.progress=false"])
    some = batchgen.generate([{"id": "a", "instruction": "x", "input": "", "max_new_tokens": 2},
                              {"instruction": "y", "input": "", "max_new_tokens": 2}],
                             keyed, to="arrow")
    assert isinstance(some, pa.Table) and some.column("id").to_pylist() == ["a", "row:1"]


def test_a_session_loads_the_model_once_for_three_calls_with_generates_results(tiny_model, tmp_path, monkeypatch):
    """batchgen.Session keeps the hf engine loaded: three generate calls (one resumable in an output_dir) load the
    weights once (the real loader, counted), each giving what batchgen.generate gives, which loads them per call."""
    import batchgen.engines.hf.engine as hf_engine

    loads = []
    real = hf_engine._load_model
    monkeypatch.setattr(hf_engine, "_load_model", lambda *a, **k: loads.append(1) or real(*a, **k))
    overrides = [f"engine.model={tiny_model}", "engine.dtype=float32", "sampling.max_new_tokens=4",
                 "run.progress=false"]
    batches = [rows(3), rows(5)[3:], [{"prompt": "the river", "lang": "en"}]]
    cfg = batchgen.load_job("demo", overrides)
    alone = [batchgen.generate(batch, cfg if i < 2 else batchgen.load_job(overrides=overrides))
             for i, batch in enumerate(batches)]
    assert len(loads) == 3
    loads.clear()
    with batchgen.Session(job="demo", overrides=overrides) as s:
        first = s.generate(batches[0], output_dir=tmp_path / "out")
        second = s.generate(batches[1], to="arrow")
        assert len(loads) == 1
    with batchgen.Session(overrides=overrides) as s:
        third = s.generate(batches[2])
    assert len(loads) == 2
    columns = ["id", "generation", "finish_reason", "num_generated_tokens"]
    for got, want in zip((first, second, third), alone):
        assert got.select(columns).equals(want.select(columns))
    assert batchgen.generate(batches[0], cfg, output_dir=tmp_path / "out").equals(first)  # resumable: complete
